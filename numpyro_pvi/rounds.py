"""One round as a server sees it: the contract between servers, the compiled steps and the backends.

A server's ``run_round(state, round, num_clients)`` schedules clients through a :class:`Round`:

* ``round(state, ids, pulled=None, salt=0, allow=True) -> (state, accepted)`` runs the group of clients
  ``ids`` against ``pulled`` (default: the current ``q``) and merges their deltas into the current ``q``;
* when the backend's runner is a :class:`~numpyro_pvi.backends.ConcurrentRunner` (Ray),
  ``round.concurrent`` is true and ``start`` / ``wait`` / ``finish`` run single clients in the background
  and merge each as it arrives. Work still in flight at the end of a round is kept in ``round.in_flight``,
  which belongs to the *run* (:meth:`PVI.run` hands the same dict to all its rounds and cancels what is
  left when it ends), never to the server: nothing leaks from one run into another.

The round records what every client did (:class:`~numpyro_pvi.RoundInfo`'s per-client fields).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.backends import ConcurrentRunner, take
from numpyro_pvi.families import NatParams
from numpyro_pvi.local_updates.base import Client
from numpyro_pvi.state import ClientOutcome, PVIState
from numpyro_pvi.steps import Steps


class Pending(NamedTuple):
    """A client update running in the background: the backend's ``handle`` and what it started from."""

    handle: Any
    cavity: NatParams
    state: Any
    hyper: Any


class InFlightUpdate(NamedTuple):
    """An update in flight across rounds, and the server's merge count when its client pulled ``q``."""

    pending: Pending
    pulled_at: int


class InFlight(dict):
    """Client updates running in the background across rounds of one run: ``client -> InFlightUpdate``."""


class Round:
    """What a server calls to run clients in one round, recording what each client did.

    :param steps: the problem's compiled steps.
    :param clients: the problem's stacked client data.
    :param round_key: the round's random key (client ``m`` of a group gets ``fold_in(key, m)``).
    :param num_clients: the number of (real) clients; ``capacity`` the client slots of the state.
    :param in_flight: the run's background updates (a fresh one if ``None``: nothing carries over).
    :param sample_key: the key a server draws the round's clients from (``clients_per_round``).
    """

    def __init__(self, steps: Steps, clients: Client, round_key: jax.Array, num_clients: int, capacity: int,
                 in_flight: InFlight | None = None, sample_key: jax.Array | None = None) -> None:
        self.steps, self.clients, self.round_key = steps, clients, round_key
        self.sample_key = jax.random.fold_in(round_key, 2**31 - 1) if sample_key is None else sample_key
        self.num_clients, self.capacity = num_clients, capacity
        self.concurrent = isinstance(steps.runner, ConcurrentRunner)
        self.in_flight = InFlight() if in_flight is None else in_flight
        self.free_energy, self.damping = np.full(num_clients, np.nan), np.zeros(num_clients)
        self.attempts, self.accepted, self.clamped = (np.zeros(num_clients, int) for _ in range(3))
        self.rejection, self.moved = np.zeros(num_clients, int), np.zeros(num_clients, bool)
        self.staleness: list[int] = []  # how stale each update the server rejected as stale was (in merges)
        self.hyper_grad: dict = {}  # client -> its last accepted hyperparameter gradient this round

    def record(self) -> tuple:
        """``(free_energy, attempts, accepted, damping, clamped)`` for :class:`~numpyro_pvi.RoundInfo`."""
        return self.free_energy, self.attempts, self.accepted, self.damping, self.clamped

    def note_stale(self, staleness: int) -> None:
        """The server rejects an update computed against a ``q`` ``staleness`` merges old."""
        self.staleness.append(int(staleness))

    def key(self, salt: int) -> jax.Array:
        """The round key for the ``salt``-th group of the round (salt 0: the round key itself)."""
        return self.round_key if salt == 0 else jax.random.fold_in(self.round_key, salt)

    def _note(self, ids: list, out: ClientOutcome) -> np.ndarray:
        n = len(ids)  # the group may be padded with unused slots (not allowed, not recorded)
        accepted = np.asarray(out.accepted)[:n]
        self.free_energy[ids], self.damping[ids] = np.asarray(out.free_energy)[:n], np.asarray(out.damping)[:n]
        self.attempts[ids] += 1
        self.accepted[ids] += accepted
        self.clamped[ids] += np.asarray(out.clamped)[:n]
        self.rejection[ids], self.moved[ids] = np.asarray(out.rejection)[:n], np.asarray(out.moved)[:n]
        if out.hyper_grad:
            for i, m in enumerate(ids):
                if accepted[i]:
                    self.hyper_grad[int(m)] = take(out.hyper_grad, i)
        return accepted

    def _padded(self, ids: list, allow: bool) -> tuple[jax.Array, jax.Array]:
        """``ids`` padded with unused client slots to a power of two (at most the capacity), and ``allow``.

        Groups then come in a few sizes only, so adding clients or sampling them recompiles rarely.
        """
        size = len(ids)
        target = min(self.capacity, 1 << (size - 1).bit_length()) if size < self.capacity else size
        taken = set(ids)
        spare = [m for m in range(self.capacity) if m not in taken][:target - size]
        allowed = np.concatenate([np.full(size, allow, bool), np.zeros(len(spare), bool)])
        return jnp.asarray(list(ids) + spare), jnp.asarray(allowed)

    def __call__(self, state: PVIState, ids: list, pulled: NatParams | None = None, salt: int = 0,
                 allow: bool = True) -> tuple[PVIState, np.ndarray]:
        pulled = state.q if pulled is None else pulled
        group, allowed = self._padded([int(m) for m in ids], allow)
        state, out = self.steps.group_step(state, group, self.key(salt), self.clients, pulled, allowed)
        return state, self._note(list(ids), out)

    def start(self, state: PVIState, m: int, salt: int) -> Pending:
        """Start client ``m`` against the current q in the background, for :meth:`finish`."""
        key = jax.random.fold_in(self.key(salt), m)
        cavity = jax.tree.map(lambda a, f: a - f[m], state.q, state.factors)
        local = take(state.client_states, m)
        handle = self.steps.runner.submit(m, key, cavity, state.q, local, state.hyper, self.clients)
        return Pending(handle, cavity, local, state.hyper)

    def wait(self, pending: dict) -> int:
        """The client (a key of ``{client: Pending}``) that finishes first."""
        return self.steps.runner.wait_any({m: p.handle for m, p in pending.items()})

    def finish(self, state: PVIState, m: int, pending: Pending, allow: bool = True) -> tuple[PVIState, np.ndarray]:
        """Collect client ``m``'s update and merge it into the current q."""
        out = self.steps.runner.result(m, pending.handle, pending.cavity, pending.state, pending.hyper)
        result = jax.tree.map(lambda x: jnp.asarray(x)[None], out)
        state, out = self.steps.apply(state, jnp.asarray([m]), result, jnp.asarray([allow]))
        return state, self._note([m], out)


def cancel_in_flight(runner: Any, in_flight: InFlight) -> None:
    """Abandon a run's background updates when it ends: they will never be merged."""
    if in_flight and isinstance(runner, ConcurrentRunner):
        runner.cancel({m: update.pending.handle for m, update in in_flight.items()})
    in_flight.clear()
