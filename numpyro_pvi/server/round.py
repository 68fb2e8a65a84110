"""One round as a server sees it: the contract between servers, the compiled steps and the backends.

A server's ``run_round(state, round, num_clients)`` schedules clients through a :class:`Round`:

* ``round(state, ids, pulled=None, salt=0, allow=True) -> (state, accepted)`` runs the group of
  clients ``ids`` against ``pulled`` (default: the current ``q``) and merges their deltas into the
  current ``q``;
* when the backend's runner is a :class:`~numpyro_pvi.backends.ConcurrentRunner` (Ray),
  ``round.concurrent`` is true and ``start`` / ``wait`` / ``finish`` run single clients in the
  background and merge each as it arrives. Work still in flight at the end of a round is kept in
  ``round.in_flight``, which belongs to the *run* (:meth:`PVI.run` hands the same dict to all its
  rounds and cancels what is left when it ends), never to the server: nothing leaks from one run
  into another.

The round records what every client did (:class:`~numpyro_pvi.RoundInfo`'s per-client fields), or,
where the server drew the round's clients (:meth:`Round.sample`), what each of those did: a sampled
round's bookkeeping costs ``O(K)``, not ``O(M)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.backends.base import ConcurrentRunner, take
from numpyro_pvi.families import NatParams
from numpyro_pvi.local_updates.base import Client
from numpyro_pvi.model.clients import Bucket, SlotIndex, slot_index
from numpyro_pvi.server.steps import Group, Steps
from numpyro_pvi.state import CLIENT_FIELDS, ClientOutcome, PVIState, Rejection


class Pending(NamedTuple):
    """A client update running in the background: the backend's ``handle`` and what it started
    from."""

    handle: Any
    cavity: NatParams
    state: Any
    hyper: Any


class InFlightUpdate(NamedTuple):
    """An update in flight across rounds, and the server's merge count when its client pulled
    ``q``."""

    pending: Pending
    pulled_at: int


class InFlight(dict):
    """Client updates running in the background across rounds of one run: ``client ->
    InFlightUpdate``."""


class OwnedFactors:
    """The factors a run's last compiled step produced, while no one else holds them: the next
    step may consume them (their memory holds the merged factors: no copy of all ``M`` rows).

    :meth:`PVI.run <numpyro_pvi.PVI.run>` keeps one for all its rounds and releases it where the
    factors are kept elsewhere (iterate averaging, a damping that reads the round's starting
    factors); a step handed factors not marked here (the caller's state, a checkpoint, the prior
    factor's step) works on a copy of them.

    **Example:** ``owned = OwnedFactors(); owned.mark(state.factors); owned.holds(state.factors)``
    is ``True``.
    """

    def __init__(self) -> None:
        self.leaves: tuple = ()

    def holds(self, factors: NatParams) -> bool:
        """Whether ``factors`` are the arrays marked last (the same objects, not equal values)."""
        leaves = jax.tree.leaves(factors)
        return len(leaves) == len(self.leaves) and all(a is b for a, b in zip(leaves, self.leaves))

    def mark(self, factors: NatParams) -> None:
        self.leaves = tuple(jax.tree.leaves(factors))

    def release(self) -> None:
        """Someone else keeps the marked factors: the next step copies them."""
        self.leaves = ()

    def take(self, factors: NatParams) -> NatParams:
        """``factors`` to consume: themselves if marked, else a copy (the caller's stay intact)."""
        if self.holds(factors):
            return factors
        return jax.tree.map(lambda f: jax.device_put(f, may_alias=False), factors)


class Round:
    """What a server calls to run clients in one round, recording what each client did.

    :param steps: the problem's compiled steps.
    :param clients: the problem's client data: its buckets (``problem.buckets``), one stacked
        :class:`~numpyro_pvi.local_updates.Client` of every client slot, or ``None`` where the
        clients hold their own data and the runner reaches them (Flower:
        :class:`~numpyro_pvi.flower.round.FlowerRound`).
    :param round_key: the round's random key (client ``m`` of a group gets ``fold_in(key, m)``).
    :param num_clients: the number of (real) clients; ``capacity`` the client slots of the state.
    :param in_flight: the run's background updates (a fresh one if ``None``: nothing carries over).
    :param sample_key: the key a server draws the round's clients from (``clients_per_round``).
    :param index: where each client slot's data are (``problem.slot_index``, worked out once per
        problem; default: from ``clients``, which takes time in the number of clients).
    :param owned: the run's :class:`OwnedFactors` (a fresh one if ``None``: the round's first step
        copies the factors it is handed).
    """

    def __init__(
        self,
        steps: Steps,
        clients: Client | tuple | None,
        round_key: jax.Array,
        num_clients: int,
        capacity: int,
        in_flight: InFlight | None = None,
        sample_key: jax.Array | None = None,
        index: SlotIndex | None = None,
        owned: OwnedFactors | None = None,
    ) -> None:
        if isinstance(clients, Client):
            clients = (Bucket(clients, np.arange(capacity)),)
        # None: the clients hold their own data (Flower sites), the runner reaches them
        self.buckets = () if clients is None else tuple(clients)
        # all client slots when there is one bucket (concurrent runners)
        self.clients = self.buckets[0].clients if self.buckets else None
        # the bucket of each client slot, its row there, each bucket's padding order
        self.index = slot_index(self.buckets, capacity) if index is None else index
        self.steps, self.round_key = steps, round_key
        self.sample_key = (
            jax.random.fold_in(round_key, 2**31 - 1) if sample_key is None else sample_key
        )
        self.num_clients, self.capacity = num_clients, capacity
        self.concurrent = isinstance(steps.runner, ConcurrentRunner)
        self.in_flight = InFlight() if in_flight is None else in_flight
        self.owned = OwnedFactors() if owned is None else owned
        # how stale each update the server rejected as stale was (in merges)
        self.staleness: list[int] = []
        self.hyper_grad: dict = {}  # client -> its last accepted hyperparameter gradient this round
        self.prior_term = np.nan  # the prior's terms of the round's ELBO (see elbo_terms)
        # the clients the round records (None: all of them) and where each is in the record
        self.sampled: np.ndarray | None = None
        self.entry: dict[int, int] = {}
        # RoundInfo's per-client fields by name, one entry per recorded client (None: not started)
        self.log: dict[str, np.ndarray] | None = None

    def sample(self, clients: Any) -> None:
        """The server drew this round's clients (client sampling): the round records theirs only
        (``RoundInfo.clients``), at a cost in their number, not in ``M``.

        **Example:** ``round.sample(ids)`` in a server's ``run_round``, before it runs ``ids``.
        """
        self.sampled = np.asarray(clients, int)
        self.entry = {m: i for i, m in enumerate(self.sampled.tolist())}
        self._start_record(self.sampled.size)

    def _start_record(self, size: int) -> None:
        """The per-client record, one entry per recorded client (what a client that does not run
        holds)."""
        # (inflation: each client's last ClientResult.inflation)
        self.log = {name: np.full(size, fill) for name, fill in CLIENT_FIELDS.items()}
        # each client's term of the ELBO of the q it was sent this round (NaN where not reported:
        # see numpyro_pvi.server.elbo)
        self.elbo_terms, self.reported = np.full(size, np.nan), np.zeros(size, bool)

    def _ensure_record(self) -> None:
        """Start the record of every client, unless the round was sampled (or started it)."""
        if self.log is None:
            self._start_record(self.num_clients)

    def _entries(self, ids: list) -> Any:
        """Where the clients ``ids`` are in the record (every client's, unless sampled)."""
        self._ensure_record()
        return ids if self.sampled is None else [self.entry[int(m)] for m in ids]

    def record(self) -> dict:
        """The per-client fields of :class:`~numpyro_pvi.RoundInfo`, and ``clients``, by name."""
        self._ensure_record()
        return dict(self.log, clients=self.sampled)

    def reported_elbo(self) -> bool:
        """Whether every client reported its term of the ELBO of the ``q`` the round started from
        (a round of :class:`~numpyro_pvi.Synchronous` without ``clients_per_round``): the round's
        ELBO is then their sum and the prior's terms
        (:func:`~numpyro_pvi.server.elbo.round_elbo`)."""
        self._ensure_record()
        return bool(self.sampled is None and self.num_clients > 0 and np.all(self.reported))

    def backtracked(self, rho: float) -> bool:
        """Whether a merge of this round had to backtrack: an update rejected as ``INVALID``, or one
        merged with a damping below ``rho`` (the damping the round started from)."""
        self._ensure_record()
        below = (self.log["accepted"] > 0) & (self.log["damping"] < rho * (1 - 1e-6))
        return bool(np.any(self.log["rejection"] == Rejection.INVALID) or np.any(below))

    def every_client_merged(self) -> bool:
        """Whether every client ran and was merged in this round (a round
        :class:`~numpyro_pvi.HeavyBall` can use)."""
        self._ensure_record()
        return bool(self.sampled is None and np.all(self.log["accepted"] > 0))

    def note_stale(self, staleness: int) -> None:
        """The server rejects an update computed against a ``q`` ``staleness`` merges old."""
        self.staleness.append(int(staleness))

    def key(self, salt: int) -> jax.Array:
        """The round key for the ``salt``-th group of the round (salt 0: the round key itself)."""
        return self.round_key if salt == 0 else jax.random.fold_in(self.round_key, salt)

    def _count(self, ids: list, q: NatParams, hyper: Any, out: ClientOutcome) -> None:
        """The messages of one update of each client ``ids``: ``q`` and the cavity down, the delta
        up."""
        down, up = (
            2 * nbytes(q) + nbytes(hyper),
            nbytes(q) + jnp.dtype(out.free_energy.dtype).itemsize,
        )
        up += nbytes(hyper) if out.hyper_grad else 0
        up += 0 if out.elbo_term is None else jnp.dtype(out.elbo_term.dtype).itemsize
        entries = self._entries(ids)
        self.log["bytes_received"][entries] += down
        self.log["bytes_sent"][entries] += up

    def _note(self, ids: list, out: ClientOutcome) -> np.ndarray:
        n = len(ids)  # the group may be padded with unused slots (not allowed, not recorded)
        entries = self._entries(ids)
        accepted = np.asarray(out.accepted)[:n]
        self.log["free_energy"][entries], self.log["damping"][entries] = (
            np.asarray(out.free_energy)[:n],
            np.asarray(out.damping)[:n],
        )
        self.log["attempts"][entries] += 1
        self.log["accepted"][entries] += accepted
        self.log["clamped"][entries] += np.asarray(out.clamped)[:n]
        self.log["rejection"][entries], self.log["moved"][entries] = (
            np.asarray(out.rejection)[:n],
            np.asarray(out.moved)[:n],
        )
        self.log["inflation"][entries] = np.asarray(out.inflation)[:n]
        if out.elbo_term is not None:
            self.elbo_terms[entries] = np.asarray(out.elbo_term)[:n]
            self.reported[entries] = True
            self.prior_term = float(np.asarray(out.prior_term)[0])
        if out.hyper_grad:
            for i, m in enumerate(ids):
                if accepted[i]:
                    self.hyper_grad[int(m)] = take(out.hyper_grad, i)
        return accepted

    def _groups(self, ids: list, allow: bool) -> tuple[tuple[Group, ...], list]:
        """One :class:`~numpyro_pvi.server.steps.Group` per bucket holding some of ``ids``, and
        ``ids`` in group order.

        Each bucket's clients are padded with its other rows (its other clients first, then
        placeholders, which stand in for their bucket's first client; none may merge) to a power of
        two (at most the bucket's size): groups come in a few sizes only, so sampling clients
        recompiles rarely.
        """
        groups, order, ids = [], [], np.asarray(ids, int)
        for b, bucket in enumerate(self.buckets):
            mine = ids[self.index.bucket_of[ids] == b]
            if not mine.size:
                continue
            size, slots = len(mine), len(bucket.ids)
            target = min(slots, 1 << (size - 1).bit_length()) if size < slots else size
            # the first `target` rows of the padding order hold at least `target - size` others
            first = self.index.padding_order[b][:target]
            spare = first[~np.isin(bucket.ids[first], mine)][: target - size]
            mine = mine.tolist()
            allowed = np.concatenate([np.full(size, allow, bool), np.zeros(len(spare), bool)])
            rows = np.concatenate([self.index.row_of[mine], np.asarray(spare, int)])
            members = np.concatenate(
                [mine, np.where(bucket.ids[spare] >= 0, bucket.ids[spare], bucket.ids[0])]
            )
            real = np.arange(len(rows)) < size
            # device_put, not jnp.asarray: the latter compiles a copy for every new shape
            groups.append(Group(bucket.clients, *jax.device_put((rows, members, allowed, real))))
            order += mine + [-1] * len(spare)
        return tuple(groups), order

    def __call__(
        self,
        state: PVIState,
        ids: list,
        pulled: NatParams | None = None,
        salt: int = 0,
        allow: bool = True,
    ) -> tuple[PVIState, np.ndarray]:
        pulled = state.q if pulled is None else pulled
        groups, order = self._groups([int(m) for m in ids], allow)
        state = state._replace(factors=self.owned.take(state.factors))
        state, out = self.steps.group_step(state, groups, self.key(salt), pulled)
        self.owned.mark(state.factors)
        real = np.flatnonzero(np.asarray(order) >= 0)
        out = jax.tree.map(lambda x: np.asarray(x)[real], out)
        accepted = self._note([order[i] for i in real], out)
        self._count([order[i] for i in real], pulled, state.hyper, out)
        position = {m: i for i, m in enumerate(order[i] for i in real)}
        return state, accepted[[position[int(m)] for m in ids]]

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

    def finish(
        self, state: PVIState, m: int, pending: Pending, allow: bool = True
    ) -> tuple[PVIState, np.ndarray]:
        """Collect client ``m``'s update and merge it into the current q."""
        out = self.steps.runner.result(
            m, pending.handle, pending.cavity, pending.state, pending.hyper
        )
        result = jax.tree.map(lambda x: jnp.asarray(x)[None], out)
        state, out = self.steps.apply(state, jnp.asarray([m]), result, jnp.asarray([allow]))
        self._count([m], state.q, pending.hyper, out)
        return state, self._note([m], out)


def nbytes(tree: Any) -> int:
    """Bytes of the arrays of ``tree`` (what sending it costs)."""
    return int(
        sum(np.size(x) * jnp.dtype(jnp.result_type(x)).itemsize for x in jax.tree.leaves(tree))
    )


def cancel_in_flight(runner: Any, in_flight: InFlight) -> None:
    """Abandon a run's background updates when it ends: they will never be merged."""
    if in_flight and isinstance(runner, ConcurrentRunner):
        runner.cancel({m: update.pending.handle for m, update in in_flight.items()})
    in_flight.clear()
