"""The server's merge: damped client deltas added to ``q`` and the factors, never leaving them
invalid.

``q += rho * sum_m delta_m`` and ``t_m += rho * delta_m`` over the clients that sent a finite delta.
A merge that would leave ``q`` or a checked cavity ``q - t_m`` invalid is retried with ``rho``
halved (:func:`~numpyro_pvi.backtracking.backtrack`) and, if no halving helps, rejected as a whole:
the server's state is never corrupted.

Which cavities a merge checks depends on what checking costs. Diagonal precisions (mean-field) are
checked elementwise, so every client's cavity is checked. Dense precisions (full rank) need one
Cholesky per cavity, so a merge checks ``q`` and the cavities of the clients whose deltas it merges
(which they use next); any other client's cavity is checked when that client is next visited
(:mod:`numpyro_pvi.server.steps`), and an update from an invalid cavity is rejected as
``Rejection.INVALID`` without being merged. A round that samples 10 of 1,000 full-rank clients thus
checks 10 cavities, not 1,000.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.families import Family, NatParams
from numpyro_pvi.state import Rejection


class Merged(NamedTuple):
    """Result of :func:`merge`: new ``q`` and ``factors``, the damping used (0 if rejected), whether
    accepted."""

    q: NatParams
    factors: NatParams
    damping: jax.Array
    valid: jax.Array


def screen(deltas: NatParams, free_energy: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per client (leading axis): whether its delta and free energy are finite, and whether its
    delta is non-zero.

    **Example:** ``finite, moved = screen(result.delta, result.free_energy)``
    """
    finite, moved = jnp.isfinite(free_energy), jnp.zeros(jnp.shape(free_energy), bool)
    for leaf in jax.tree.leaves(deltas):
        flat = jnp.reshape(leaf, (leaf.shape[0], -1))
        finite &= jnp.all(jnp.isfinite(flat), axis=1)
        moved |= jnp.any(flat != 0, axis=1)
    return finite, moved


def rejection_codes(
    failure: jax.Array,
    finite: jax.Array,
    valid: jax.Array,
    allow: jax.Array | bool = True,
    cavity_ok: jax.Array | bool = True,
) -> jax.Array:
    """Why each client's update was not merged (a :class:`~numpyro_pvi.state.Rejection` code,
    ``NONE`` if it was).

    A client that sent nothing (timed out, raised, out of budget) says so before staleness does.
    """
    allow, cavity_ok, valid = (jnp.broadcast_to(x, finite.shape) for x in (allow, cavity_ok, valid))
    return jnp.select(
        [failure > 0, ~allow, ~cavity_ok, ~finite, ~valid],
        [failure, Rejection.STALE, Rejection.INVALID, Rejection.NON_FINITE, Rejection.INVALID],
        Rejection.NONE,
    )


def is_valid_state(
    family: Family,
    q: NatParams,
    factors: NatParams,
    ids: jax.Array | None = None,
    where: jax.Array | None = None,
) -> jax.Array:
    """Whether ``q`` and the cavities ``q - t_m`` of the clients ``ids`` (default: every client;
    ``factors`` stacked ``(M, ...)``) are valid; with ``where`` (one flag per id), only those
    cavities count.

    **Example:** ``is_valid_state(pvi.MeanFieldGaussian(), state.q, state.factors)``
    """
    chosen = factors if ids is None else jax.tree.map(lambda f: f[ids], factors)
    cavities = jax.tree.map(lambda a, f: a[None] - f, q, chosen)
    valid = jax.vmap(family.is_valid)(cavities)
    return family.is_valid(q) & jnp.all(valid if where is None else valid | ~where)


def checks_every_cavity(factors: NatParams) -> bool:
    """Whether a merge checks every client's cavity: when every block's second natural parameter is
    elementwise (diagonal precisions, Gamma/Beta/Dirichlet parameters), so checks cost no
    factorisation."""
    return all(leaf.ndim == factors.eta1.ndim for leaf in jax.tree.leaves(factors.eta2))


def cavities(
    family: Family, pulled: NatParams, factors: NatParams, ids: jax.Array
) -> tuple[NatParams, jax.Array]:
    """Clients ``ids``' cavities ``pulled - t_m`` (stacked over ``ids``) and whether each is valid
    when they start (all, where the merges check every cavity: :func:`checks_every_cavity`; a
    dense family's merges check only the merging clients', so the others' are checked here, on
    their visit).

    **Example:** ``cavity, cavity_ok = cavities(family, state.q, state.factors, ids)``
    """
    stacked = jax.tree.map(lambda a, f: a[None] - f[ids], pulled, factors)
    if checks_every_cavity(factors):
        return stacked, jnp.ones(jnp.shape(ids), bool)
    return stacked, jax.vmap(family.is_valid)(stacked)


def merge(
    family: Family,
    q: NatParams,
    factors: NatParams,
    ids: jax.Array,
    deltas: NatParams,
    finite: jax.Array,
    damping: float,
    max_backtracks: int,
) -> Merged:
    """Apply ``q += rho * sum(deltas)`` and ``factors[ids] += rho * deltas`` with validity
    backtracking.

    :param factors: ``(M, ...)`` all client factors; ``ids`` ``(G,)`` the clients that sent
        ``deltas``.
    :param finite: ``(G,)`` which deltas to merge (finite and allowed); the others are dropped.
    :param damping: the largest ``rho`` tried; it is halved up to ``max_backtracks`` times.

    Checks ``q`` and every cavity when the precisions are diagonal, else ``q`` and the cavities of
    ``ids`` (see the module docstring).

    **Example:** ``merged = merge(family, state.q, state.factors, jnp.array([0, 1]), deltas, ok,
    0.5, 5)``
    """
    deltas = jax.tree.map(lambda d: jnp.where(_expand(finite, d), d, 0.0), deltas)
    total = jax.tree.map(lambda d: jnp.sum(d, axis=0), deltas)
    every = checks_every_cavity(factors)
    # the rows a merged delta moves (ids may repeat a client only in entries that merge nothing)
    touched = jnp.zeros(factors.eta1.shape[0], bool).at[ids].max(finite) if every else None
    old_rows = jax.tree.map(lambda f: f[ids], factors)

    def propose(rho: jax.Array) -> tuple:
        # the factors are not updated here: q_new and a validity test of the cavities the merge
        # would leave, so a proposal costs no copy of all M factors (one pass over them to check
        # every cavity where that is checked, else the merged clients' only)
        q_new = q + rho * total
        new_rows = jax.tree.map(lambda f, d: f + rho * d, old_rows, deltas)
        valid = family.is_valid(q_new)
        valid &= jnp.all(jax.vmap(family.is_valid)(_cavities(q_new, new_rows)) | ~finite)
        if every:
            unmoved = jax.vmap(family.is_valid)(_cavities(q_new, factors))
            valid &= jnp.all(unmoved | touched)
        return q_new, valid

    out = backtrack(propose, damping, max_backtracks)
    # the factors moved once, by the damping taken (0, no move, where none was valid)
    f_new = jax.tree.map(lambda f, d: f.at[ids].add(out.step * d), factors, deltas)
    return Merged(
        jax.tree.map(lambda new, old: jnp.where(out.valid, new, old), out.value, q),
        f_new,
        out.step,
        out.valid,
    )


def _cavities(q: NatParams, factors: NatParams) -> NatParams:
    return jax.tree.map(lambda a, f: a[None] - f, q, factors)


def _expand(mask: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.reshape(mask, mask.shape + (1,) * (x.ndim - mask.ndim))
