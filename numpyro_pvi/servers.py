"""Servers: which clients update against which ``q``, and how their deltas are merged.

A server is a *schedule* (groups of clients; the clients of a group all see the same ``q``) plus a
damping policy. Every server merges with :func:`merge`, which never corrupts the state: a non-finite
client delta is dropped, and a damped sum that would leave ``q`` or any cavity invalid is retried
with the damping halved, up to ``max_backtracks`` times, then rejected as a whole.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.families import MeanFieldGaussian, NatParams


class Server:
    """Base class: ``schedule(num_clients)`` and damping ``rho`` in ``(0, 1]`` with backtracking."""

    def __init__(self, damping: float = 1.0, max_backtracks: int = 5) -> None:
        if not (isinstance(damping, (int, float)) and 0.0 < damping <= 1.0):
            raise ValueError(f"{type(self).__name__}: damping must be in (0, 1], got {damping!r}.")
        if not isinstance(max_backtracks, int) or max_backtracks < 0:
            raise ValueError(f"{type(self).__name__}: max_backtracks must be a non-negative integer, "
                             f"got {max_backtracks!r}.")
        self.damping = float(damping)
        self.max_backtracks = max_backtracks

    def schedule(self, num_clients: int) -> list[np.ndarray]:
        """The groups of client indices of one round, in order."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(damping={self.damping})"


class Sequential(Server):
    """Clients update one after the other, each against the ``q`` its predecessor left (PVI-seq).

    **Example:** ``pvi.PVI(..., server=pvi.Sequential())``
    """

    def schedule(self, num_clients: int) -> list[np.ndarray]:
        return [np.array([m]) for m in range(num_clients)]


class Synchronous(Server):
    """All clients update against the same ``q``; the server adds their damped deltas (PVI-sync).

    With many clients undamped synchronous rounds can overshoot (a factor is counted once by each
    client's cavity): use ``damping`` around ``1 / num_clients`` to ``0.5``.

    **Example:** ``pvi.PVI(..., server=pvi.Synchronous(damping=0.5))``
    """

    def schedule(self, num_clients: int) -> list[np.ndarray]:
        return [np.arange(num_clients)]


class Merged(NamedTuple):
    """Result of :func:`merge`: new ``q`` and ``factors``, the damping used (0 if rejected), whether accepted."""

    q: NatParams
    factors: NatParams
    damping: jax.Array
    valid: jax.Array


def is_valid_state(family: MeanFieldGaussian, q: NatParams, factors: NatParams) -> jax.Array:
    """Whether ``q`` and every cavity ``q - t_m`` (``factors`` stacked ``(M, ...)``) are valid Gaussians."""
    cavities = jax.tree.map(lambda a, f: a[None] - f, q, factors)
    return family.is_valid(q) & jnp.all(jax.vmap(family.is_valid)(cavities))


def backtrack(propose: Callable, damping: float, max_backtracks: int) -> tuple:
    """Find the largest ``rho = damping / 2**k`` (``k <= max_backtracks``) whose proposal is valid.

    :param propose: ``rho -> (new_state, valid)``.
    :return: ``(new_state, rho, valid)``; ``rho`` is 0 when no proposal was valid.
    """

    def cond(carry: tuple) -> jax.Array:
        k, valid = carry
        return (~valid) & (k < max_backtracks)

    def body(carry: tuple) -> tuple:
        k, _ = carry
        return k + 1, propose(damping * 0.5 ** (k + 1))[1]

    k, valid = jax.lax.while_loop(cond, body, (0, propose(damping)[1]))
    rho = damping * 0.5**k
    new_state, _ = propose(rho)
    return new_state, jnp.where(valid, rho, 0.0), valid


def merge(family: MeanFieldGaussian, q: NatParams, factors: NatParams, ids: jax.Array, deltas: NatParams,
          finite: jax.Array, damping: float, max_backtracks: int) -> Merged:
    """Apply ``q += rho * sum(deltas)`` and ``factors[ids] += rho * deltas`` with validity backtracking.

    :param factors: ``(M, ...)`` all client factors; ``ids`` ``(G,)`` the clients that sent ``deltas``.
    :param finite: ``(G,)`` which deltas are finite; the others are dropped.
    """
    deltas = jax.tree.map(lambda d: jnp.where(_expand(finite, d), d, 0.0), deltas)
    total = jax.tree.map(lambda d: jnp.sum(d, axis=0), deltas)

    def propose(rho: jax.Array) -> tuple:
        q_new = q + rho * total
        f_new = jax.tree.map(lambda f, d: f.at[ids].add(rho * d), factors, deltas)
        return (q_new, f_new), is_valid_state(family, q_new, f_new)

    (q_new, f_new), rho, valid = backtrack(propose, damping, max_backtracks)
    keep = lambda new, old: jnp.where(valid, new, old)  # noqa: E731
    return Merged(jax.tree.map(keep, q_new, q), jax.tree.map(keep, f_new, factors), rho, valid)


def _expand(mask: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.reshape(mask, mask.shape + (1,) * (x.ndim - mask.ndim))
