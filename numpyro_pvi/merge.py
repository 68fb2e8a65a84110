"""The server's merge: damped client deltas added to ``q`` and the factors, never leaving them invalid.

``q += rho * sum_m delta_m`` and ``t_m += rho * delta_m`` over the clients that sent a finite delta.
A merge that would leave ``q`` or any cavity ``q - t_m`` invalid is retried with ``rho`` halved
(:func:`~numpyro_pvi.backtracking.backtrack`) and, if no halving helps, rejected as a whole: the
server's state is never corrupted.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.families import Family, NatParams


class Merged(NamedTuple):
    """Result of :func:`merge`: new ``q`` and ``factors``, the damping used (0 if rejected), whether accepted."""

    q: NatParams
    factors: NatParams
    damping: jax.Array
    valid: jax.Array


def is_valid_state(family: Family, q: NatParams, factors: NatParams) -> jax.Array:
    """Whether ``q`` and every cavity ``q - t_m`` (``factors`` stacked ``(M, ...)``) are valid.

    **Example:** ``is_valid_state(pvi.MeanFieldGaussian(), state.q, state.factors)``
    """
    cavities = jax.tree.map(lambda a, f: a[None] - f, q, factors)
    return family.is_valid(q) & jnp.all(jax.vmap(family.is_valid)(cavities))


def merge(family: Family, q: NatParams, factors: NatParams, ids: jax.Array, deltas: NatParams,
          finite: jax.Array, damping: float, max_backtracks: int) -> Merged:
    """Apply ``q += rho * sum(deltas)`` and ``factors[ids] += rho * deltas`` with validity backtracking.

    :param factors: ``(M, ...)`` all client factors; ``ids`` ``(G,)`` the clients that sent ``deltas``.
    :param finite: ``(G,)`` which deltas to merge (finite and allowed); the others are dropped.
    :param damping: the largest ``rho`` tried; it is halved up to ``max_backtracks`` times.

    **Example:** ``merged = merge(family, state.q, state.factors, jnp.array([0, 1]), deltas, ok, 0.5, 5)``
    """
    deltas = jax.tree.map(lambda d: jnp.where(_expand(finite, d), d, 0.0), deltas)
    total = jax.tree.map(lambda d: jnp.sum(d, axis=0), deltas)

    def propose(rho: jax.Array) -> tuple:
        q_new = q + rho * total
        f_new = jax.tree.map(lambda f, d: f.at[ids].add(rho * d), factors, deltas)
        return (q_new, f_new), is_valid_state(family, q_new, f_new)

    out = backtrack(propose, damping, max_backtracks)
    q_new, f_new = out.value
    keep = lambda new, old: jnp.where(out.valid, new, old)  # noqa: E731
    return Merged(jax.tree.map(keep, q_new, q), jax.tree.map(keep, f_new, factors), out.step, out.valid)


def _expand(mask: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.reshape(mask, mask.shape + (1,) * (x.ndim - mask.ndim))
