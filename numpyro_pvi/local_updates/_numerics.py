"""Numerics the local updates share (internal): no update imports another's module.

* **Laplace** (:func:`laplace`, :func:`laplace_fit`, :func:`laplace_site`): damped Newton to a
  density's mode, and a family's Laplace approximation of a client's tilted distribution (the
  fallback of CVI steps, EP's proposal, SNEP's start).
* **NUTS** (:func:`nuts_draws`, :class:`NUTSSettings`): NumPyro's functional NUTS kernels in
  ``lax.scan`` with a unit mass matrix, in coordinates where one fits (whitened by a Gaussian
  approximation, or standardised by a family's
  :meth:`~numpyro_pvi.families.MeanParamFamily.chain_frame`).

The Stein control variates of EP's NUTS estimate and SNEP are the families'
(:mod:`numpyro_pvi.families.chain_moments`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from numpyro.infer.hmc import hmc

from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.families import FactorFamily, NatParams


def laplace(
    log_density: Callable, start: jax.Array, fallback: jax.Array, num_newton: int, tol: float = 1e-3
) -> tuple:
    """Mode and ``(D, D)`` precision of ``log_density`` by damped Newton steps from ``start``.

    Where the negative Hessian is not positive definite (a non-log-concave density, or far from the
    mode) it is replaced by its eigendecomposition with the eigenvalues made positive: their
    absolute values for a step (an ascent direction), floored at the smallest eigenvalue of the
    positive-definite ``fallback`` precision (so no step is longer than one with ``fallback``). Each
    step is halved until the density rises by at least ``1e-4`` of the predicted gain (Armijo; at
    most 30 halvings). The iteration stops after ``num_newton`` steps, once the Newton decrement
    ``g^T P^-1 g`` is below ``tol``, or when no halving rises. The returned precision is the
    negative Hessian at the mode if positive definite, else its eigenvalues floored the same way
    (``fallback`` if it is not finite).
    """
    value_grad, hessian = jax.value_and_grad(log_density), jax.hessian(log_density)
    floor = jnp.linalg.eigvalsh(fallback)[0]

    def curvature(z: jax.Array, newton: bool) -> jax.Array:
        evals, evecs = jnp.linalg.eigh(_sym(-hessian(z)))
        modified = jnp.maximum(jnp.abs(evals) if newton else evals, floor)
        precision = (evecs * jnp.where(evals[0] > 0, evals, modified)) @ evecs.T
        return jnp.where(jnp.all(jnp.isfinite(precision)), _sym(precision), fallback)

    def newton(carry: tuple) -> tuple:
        z, _, k = carry
        value, grad = value_grad(z)
        direction = jnp.linalg.solve(curvature(z, True), grad)
        gain = jnp.dot(grad, direction)  # the Newton decrement: twice the predicted rise

        def propose(step: jax.Array) -> tuple[jax.Array, jax.Array]:
            new = z + step * direction
            return new, log_density(new) >= value + 1e-4 * step * gain

        out = backtrack(propose, 1.0, max_halvings=30)
        moved = out.valid & jnp.all(jnp.isfinite(direction)) & jnp.isfinite(gain)
        done = ~moved | (gain < tol)
        return jnp.where(moved, out.value, z), done, k + 1

    mode, _, _ = jax.lax.while_loop(
        lambda c: (~c[1]) & (c[2] < num_newton),
        newton,
        (start, jnp.asarray(num_newton <= 0), jnp.asarray(0)),
    )
    precision = curvature(mode, False)
    return mode, precision, jnp.linalg.cholesky(precision)


def laplace_fit(
    family: FactorFamily, cavity: NatParams, q: NatParams, loglik: Callable, num_newton: int
) -> tuple[jax.Array, jax.Array]:
    """``(mode, P)``: the mode and negative Hessian of ``cavity * p(y_m | theta)`` in the family's
    Laplace coordinates ``x`` (:meth:`~numpyro_pvi.families.FactorFamily.laplace_log_density`), by
    Newton from ``q``'s mode."""

    def log_tilted(x: jax.Array) -> jax.Array:
        zeta, log_cavity = family.laplace_log_density(cavity, x)
        return log_cavity + loglik(zeta)

    mode, precision, _ = laplace(
        log_tilted, family.laplace_start(q), family.laplace_precision(cavity), num_newton
    )
    return mode, precision


def laplace_site(
    family: FactorFamily, cavity: NatParams, q: NatParams, loglik: Callable, num_newton: int
) -> NatParams:
    """The site ``from_laplace(mode, P) / cavity`` of the Laplace approximation of ``cavity * p(y_m
    | theta)`` (:func:`laplace_fit`)."""
    return family.from_laplace(*laplace_fit(family, cavity, q, loglik, num_newton)) - cavity


def _sym(matrix: jax.Array) -> jax.Array:
    return 0.5 * (matrix + matrix.T)


class NUTSSettings(NamedTuple):
    """How many NUTS chains, warm-up steps and draws per chain, and the tree depth
    (``MomentMatchingUpdate``'s ``NUTSMoments``)."""

    num_chains: int
    num_warmup: int
    num_samples: int
    max_tree_depth: int


def nuts_draws(
    potential: Callable,
    dim: int,
    rng_key: jax.Array,
    num_chains: int,
    num_warmup: int,
    num_samples: int,
    max_tree_depth: int,
) -> jax.Array:
    """``(num_chains * num_samples, dim)`` draws of ``exp(-potential(u))`` after ``num_warmup``
    adapted steps per chain.

    Each chain starts at ``N(0, 0.1^2)`` (the coordinates are centred on the target's bulk).

    **Example:** draws of ``N(1, 1)``:

    .. doctest::

        >>> import jax, jax.numpy as jnp
        >>> from numpyro_pvi.local_updates._numerics import nuts_draws
        >>> u = nuts_draws(
        ...     lambda u: 0.5 * jnp.sum((u - 1.0) ** 2), 1, jax.random.PRNGKey(0), 2, 100, 500, 4
        ... )
        >>> u.shape, bool(abs(float(u.mean()) - 1.0) < 0.2)
        ((1000, 1), True)
    """
    init_kernel, sample_kernel = hmc(potential_fn=potential, algo="NUTS")

    def chain(key: jax.Array) -> jax.Array:
        init_key, start_key = jax.random.split(key)
        u0 = 0.1 * jax.random.normal(start_key, (dim,))
        state = init_kernel(
            u0,
            num_warmup,
            step_size=0.5,
            adapt_mass_matrix=False,
            max_tree_depth=max_tree_depth,
            rng_key=init_key,
        )
        state, _ = jax.lax.scan(
            lambda s, _: (sample_kernel(s), None), state, None, length=num_warmup
        )
        _, us = jax.lax.scan(lambda s, _: (sample_kernel(s),) * 2, state, None, length=num_samples)
        return us.z

    return jax.vmap(chain)(jax.random.split(rng_key, num_chains)).reshape(-1, dim)


def nuts_kernel(potential_gen: Callable, max_tree_depth: int) -> Callable:
    """``(key, u, tau, step_size) -> (u, grad log p(u), accept prob)``: one NUTS transition (unit
    mass matrix, fixed step size) of the target ``exp(-potential_gen(tau)(u))``; SNEP's sampler."""
    init_kernel, sample_kernel = hmc(potential_fn_gen=potential_gen, algo="NUTS")

    def transition(key: jax.Array, u: jax.Array, tau: NatParams, step_size: jax.Array) -> tuple:
        hmc_state = init_kernel(
            u,
            0,
            step_size=step_size,
            adapt_step_size=False,
            adapt_mass_matrix=False,
            max_tree_depth=max_tree_depth,
            model_args=(tau,),
            rng_key=key,
        )
        hmc_state = sample_kernel(hmc_state, model_args=(tau,))
        return hmc_state.z, -hmc_state.z_grad, hmc_state.mean_accept_prob

    return transition


def adapted_log_step(log_step: jax.Array, accept: jax.Array) -> jax.Array:
    """The log step size after one Robbins-Monro step towards 80 % mean acceptance of the chains
    ``accept`` ``(C,)``."""
    return log_step + 0.1 * (jnp.mean(accept) - 0.8)


def where_tree(flag: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``flag`` holds, else ``old``, leaf by leaf (two pytrees of one structure)."""
    return jax.tree.map(lambda a, b: jnp.where(flag, a, b), new, old)
