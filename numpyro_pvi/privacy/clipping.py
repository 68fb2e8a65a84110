"""Per-row clipping of the data term's gradient for DP-SGD, by the reparameterisation's chain rule.

The data term ``E_q[log p(y_i | zeta)]`` of row ``i`` is estimated with draws ``zeta_s = loc + scale
@ eps_s`` shared by the rows (any other family: one reparameterised draw of its guide per fixed key;
:meth:`~numpyro_pvi.families.FactorFamily.reparameterised`), so its gradient with respect to the
guide's parameters ``params`` (``(loc, u)`` for a Gaussian family) is ``J^T g_i``: ``J`` the
Jacobian of ``params -> (zeta_1 .. zeta_S)`` (the same for every row) and ``g_i`` the row's
gradients in ``zeta``, ``g_is = grad_zeta log p(y_i | zeta_s) / S``. Hence

* only the per-row gradients **in zeta** are taken (``jax.vmap`` over rows, one block per global
  site: no padding of a site's block into the flat vector);
* each row's **norm** ``||J^T g_i||`` follows from them, computed by the family's
  parameterisation: by applying ``J^T`` (``jax.vjp``) to each row (the default: full rank,
  :class:`~numpyro_pvi.SiteFamilies`, ``Gamma``...), in closed form for
  :class:`~numpyro_pvi.MeanFieldGaussian` (``J`` is diagonal per draw: loc's gradient is ``sum_s
  g_is`` and ``u``'s is ``sum_s g_is * eps_s * dscale/du``);
* the **clipped sum** ``sum_i w_i J^T g_i = J^T sum_i w_i g_i`` (``w_i`` the clip factors) is one
  ordinary backward pass of the reweighted log-likelihood ``sum_i w_i log p(y_i | zeta_s)`` per
  draw: no per-row gradient in ``params`` is ever summed.

:func:`row_gradients` keeps the direct per-row gradients in ``params`` (the reference the tests
    compare with).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.local_updates.base import Client, ClientProblem


def clip_factors(grads: Any, clip_norm: float) -> jax.Array:
    """``(rows,)`` the factors ``min(1, clip_norm / ||row||)`` that clip each row (leading axis) of
    the pytree ``grads`` (its norm taken over all leaves) to Euclidean norm at most ``clip_norm``.

    **Example:** ``clip_factors((jnp.ones((3, 4)),), 1.0)`` is ``[0.5, 0.5, 0.5]``.
    """
    leaves = jax.tree.leaves(grads)
    return factors_from_squares(
        sum(jnp.sum(leaf.reshape(leaf.shape[0], -1) ** 2, axis=1) for leaf in leaves), clip_norm
    )


def factors_from_squares(squared_norms: jax.Array, clip_norm: float) -> jax.Array:
    """``min(1, clip_norm / sqrt(squared_norms))``, elementwise (a zero norm gives 1)."""
    return jnp.minimum(1.0, clip_norm / jnp.maximum(jnp.sqrt(squared_norms), 1e-30))


def clip_rows(grads: Any, clip_norm: float) -> Any:
    """Scale each row (leading axis) of the pytree ``grads`` to Euclidean norm at most
    ``clip_norm``.

    **Example:** ``clip_rows((jnp.ones((3, 4)),), 1.0)`` gives rows of norm 1.
    """
    factor = clip_factors(grads, clip_norm)
    return jax.tree.map(lambda g: g * factor.reshape((-1,) + (1,) * (g.ndim - 1)), grads)


def reparameterise(problem: ClientProblem, eps: jax.Array) -> Callable:
    """``params -> zeta`` ``(S, D)``: the guide's draws at the fixed randomness ``eps``.

    A Gaussian family: ``loc + scale @ eps_s`` from ``(loc, u)`` and standard normals ``eps`` ``(S,
    D)``; any other family: one reparameterised draw of its guide per key of ``eps`` ``(S, 2)``
    (:meth:`~numpyro_pvi.families.FactorFamily.reparameterised`).

    **Example:** ``zeta = reparameterise(problem, eps)((loc, u))``.
    """
    return problem.family.reparameterised(problem.dim).draws(eps)


def site_cuts(problem: ClientProblem) -> list[int]:
    """Where the flat ``zeta`` splits into the global sites' blocks (none without
    ``problem.sites``)."""
    if problem.sites is None:
        return []
    return [int(c) for c in np.cumsum([site.size for site in problem.sites.globals])[:-1]]


def zeta_row_gradients(problem: ClientProblem, zeta: jax.Array, client: Client) -> list:
    """``grads[s][k]``, ``(rows, size_k)``: ``grad log p(y_i | zeta_s)`` of every (padded) row at
    draw ``s``, in the block of global site ``k``.

    Each block is differentiated on its own (the others held fixed), so a row's gradient is never
    padded into the flat vector; the draws stay separate arrays (no stacking along a small middle
    axis). Masked rows give 0.

    **Example:** ``grads = zeta_row_gradients(problem, zeta, client)``; ``jnp.concatenate(grads[0],
    -1)`` is ``(rows, D)``.
    """
    rows = [a[:, None] if row else a for a, row in zip(client.arrays, problem.is_row)]
    axes = [0 if row else None for row in problem.is_row]
    cuts = site_cuts(problem)

    def row(block: jax.Array, k: int, blocks: list, arrays: list, mask: jax.Array) -> jax.Array:
        zeta = jnp.concatenate([block if j == k else b for j, b in enumerate(blocks)])
        return problem.log_likelihood(zeta, Client(arrays, mask, client.size))

    # one block at a time: the others are constants, so the
    def block_gradients(z: jax.Array) -> list:
        blocks = jnp.split(z, cuts)  # cotangent is never padded into the flat vector
        return [
            jax.vmap(jax.grad(row), in_axes=(None, None, None, axes, 0))(
                blocks[k], k, blocks, rows, client.mask[:, None]
            )
            for k in range(len(blocks))
        ]

    return [block_gradients(z) for z in zeta]  # S is small and static


def row_log_likelihoods(problem: ClientProblem, client: Client) -> Callable:
    """``zeta -> (rows,)``: the log-likelihood of each (padded) row at ``zeta`` (masked rows give
    0).

    **Example:** ``row_log_likelihoods(problem, client)(zeta).sum()`` is
    ``problem.log_likelihood(zeta, client)``.
    """
    rows = [a[:, None] if row else a for a, row in zip(client.arrays, problem.is_row)]
    axes = [0 if row else None for row in problem.is_row]

    def row(zeta: jax.Array, arrays: list, mask: jax.Array) -> jax.Array:
        return problem.log_likelihood(zeta, Client(arrays, mask, client.size))

    return lambda zeta: jax.vmap(row, in_axes=(None, axes, 0))(zeta, rows, client.mask[:, None])


def row_squared_norms(
    problem: ClientProblem, params: tuple, eps: jax.Array, client: Client
) -> jax.Array:
    """``(rows,)``: ``||J^T g_i||^2``, each row's squared gradient norm in ``params`` from its
    gradients in ``zeta`` (:func:`zeta_row_gradients`).

    The family's parameterisation computes it
    (:meth:`~numpyro_pvi.families.reparameterised.Reparameterised.row_squared_norms`): by
    ``jax.vjp`` in general, in closed form for :class:`~numpyro_pvi.MeanFieldGaussian`.

    **Example:** ``row_squared_norms(problem, (loc, u), eps, client)`` is ``(rows,)``.
    """
    parameters = problem.family.reparameterised(problem.dim)
    zeta = parameters.draws(eps)(params)
    grads = zeta_row_gradients(problem, zeta, client)
    return parameters.row_squared_norms(params, eps, grads, site_cuts(problem))


def clipped_sum(
    problem: ClientProblem,
    params: tuple,
    eps: jax.Array,
    client: Client,
    chosen: jax.Array,
    clip_norm: float,
) -> tuple:
    """``sum_{i chosen} clip(grad_i)``: the chosen rows' gradients in ``params`` of the data term,
    each clipped to norm ``clip_norm`` (see the module docstring for how).

    **Example:** ``summed = clipped_sum(problem, (loc, u), eps, client, client.mask, 1.0)``.
    """
    num_draws = eps.shape[0]
    zeta, pullback = jax.vjp(reparameterise(problem, eps), params)
    factors = factors_from_squares(row_squared_norms(problem, params, eps, client), clip_norm)
    weights = jax.lax.stop_gradient(jnp.where(chosen, factors, 0.0))
    loglik = row_log_likelihoods(problem, client)
    reweighted = jnp.stack([jax.vjp(loglik, z)[1](weights.astype(z.dtype))[0] for z in zeta])
    return pullback(reweighted / num_draws)[0]


def row_gradients(problem: ClientProblem, params: tuple, eps: jax.Array, client: Client) -> tuple:
    """Per-row gradients (``jax.vmap`` of ``jax.grad``) of ``E_q[log p(y_i | zeta)]`` with respect
    to ``params``.

    The direct computation, each row differentiated through the draws (:func:`reparameterise`): the
    reference :func:`clipped_sum` and :func:`row_squared_norms` are tested against. Each leaf gains
    a leading axis of the client's (padded) rows.

    **Example:** ``grads = row_gradients(problem, (loc, u), eps, client)``; ``grads[0]`` is ``(rows,
    D)`` (a Gaussian family).
    """
    draws = reparameterise(problem, eps)
    rows = [a[:, None] if row else a for a, row in zip(client.arrays, problem.is_row)]
    axes = [0 if row else None for row in problem.is_row]

    def row_term(params: tuple, arrays: list, mask: jax.Array) -> jax.Array:
        row = Client(arrays, mask, client.size)
        return jnp.mean(jax.vmap(lambda z: problem.log_likelihood(z, row))(draws(params)))

    return jax.vmap(jax.grad(row_term), in_axes=(None, axes, 0))(params, rows, client.mask[:, None])
