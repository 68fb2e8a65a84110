"""Servers: which clients update against which ``q``, and how their deltas are merged.

A server is a *schedule* (which clients update against which ``q``, in what order) plus a damping
policy. Every server merges with :func:`merge`, which never corrupts the state: a non-finite
client delta is dropped, and a damped sum that would leave ``q`` or any cavity invalid is retried
with the damping halved, up to ``max_backtracks`` times, then rejected as a whole.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.families import NatParams
from numpyro_pvi.server.damping import AdaptiveDamping, Damping, Fixed, resolve_damping
from numpyro_pvi.server.heavy_ball import HeavyBall
from numpyro_pvi.server.round import InFlightUpdate, Round
from numpyro_pvi.server.sampling import ClientSampling


class Server:
    """Base class: damping ``rho`` in ``(0, 1]`` with backtracking, and the schedule of a round.

    A server drives a round through ``run_round(state, round, num_clients)``, where ``round(state,
    ids, pulled=None, salt=0, allow=True) -> (state, accepted)`` lets the clients ``ids`` update
    against ``pulled`` (default: the current ``q``) and merges their deltas into the current ``q``
    (see :class:`~numpyro_pvi.server.round.Round`, which also runs single clients in the background
    when the backend is concurrent). Its own bookkeeping lives in ``PVIState.server_state``
    (:meth:`init`), never on the server object, which holds configuration only.

    **Example:** a server that visits the clients in reverse order, one at a time::

        class Reversed(pvi.server.servers.Server):
            def run_round(self, state, round, num_clients):
                for m in reversed(range(num_clients)):
                    state, _ = round(state, [m])
                return state
    """

    synchronous_rounds = False  # every client of a round against the same q (HeavyBall needs it)

    def __init__(self, damping: Damping | float | None = None, *, max_backtracks: int = 5) -> None:
        if not isinstance(max_backtracks, int) or max_backtracks < 0:
            raise ValueError(
                f"{type(self).__name__}: max_backtracks must be a non-negative integer, got "
                f"{max_backtracks!r}."
            )
        self.damping: Damping = resolve_damping(
            damping, type(self).__name__, self.default_damping(), self.synchronous_rounds
        )
        self.max_backtracks = max_backtracks
        self.sampling = ClientSampling(None, owner=type(self).__name__)

    def default_damping(self) -> Damping:
        """What ``damping=None`` means for this server (``Fixed(1.0)`` here)."""
        return Fixed(1.0)

    def check_clients(self, num_clients: int) -> None:
        """Refuse a configuration that does not fit ``num_clients`` clients (called when a problem
        is built)."""
        self.sampling.check(num_clients)

    def sampling_rates(self, num_clients: int) -> np.ndarray | None:
        """``(M,)`` each client's probability of taking part in a round, when every round draws its
        clients afresh, independently of the others (what client-sampled privacy accounting
        credits); ``None`` for a server whose rounds do not (the default)."""
        return None

    def init(self, q: NatParams, num_clients: int) -> Any:
        """The server's own state for ``num_clients`` client slots, kept in
        ``PVIState.server_state`` (none by default); per-client entries have a leading client
        axis."""
        return None

    def add_client(self, server_state: Any, q: NatParams, m: int) -> Any:
        """The server state once client slot ``m`` holds a new client (see
        :meth:`PVI.add_client`)."""
        return server_state

    def run_round(self, state: Any, round: Round, num_clients: int) -> Any:
        """Run one round; return the new state."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(damping={self.damping}{self.sampling.suffix()})"


class Sequential(Server):
    """Clients update one after the other, each against the ``q`` its predecessor left (PVI-seq).

    :param damping: a float in ``(0, 1]`` (:class:`~numpyro_pvi.Fixed`) or a
        :class:`~numpyro_pvi.AdaptiveDamping`; ``None`` (the default) is ``Fixed(1.0)``: each
        client's update is merged whole.
    :param int max_backtracks: halvings of the damping tried before an update that would leave
        ``q`` or a cavity invalid is rejected.

    **Example:** ``pvi.PVI(..., server=pvi.Sequential())``
    """

    def run_round(self, state: Any, round: Round, num_clients: int) -> Any:
        for m in range(num_clients):
            state, _ = round(state, [m])
        return state


class Synchronous(Server):
    """All clients (or ``clients_per_round`` of them) update against the same ``q``; the server adds
    their damped deltas (PVI-sync).

    With many clients undamped synchronous rounds can overshoot (a factor is counted once by each
    client's cavity), and on a correlated posterior a damped round is a slow Jacobi iteration. The
    default damping is :class:`~numpyro_pvi.HeavyBall`: Polyak's heavy-ball damping and momentum,
    set every round from the spectrum of the round estimated from the clients' deltas, restarted
    (and the damping halved) when the global ELBO falls (with ``clients_per_round``, whose rounds
    cannot be compared,
    :class:`~numpyro_pvi.AdaptiveDamping`, which follows the ELBO). A float fixes the damping and
    adds no momentum; no value is safe for every posterior (0.5 cycles on correlated ones with
    mean-field factors, ``1 / num_clients`` never overshoots but is slow), and a run whose rounds
    swing ``q`` back and forth warns that it is oscillating.

    :param damping: a float in ``(0, 1]`` (:class:`~numpyro_pvi.Fixed`), a
        :class:`~numpyro_pvi.AdaptiveDamping` or a :class:`~numpyro_pvi.HeavyBall`; ``None`` (the
        default) is ``HeavyBall()``, or ``AdaptiveDamping()`` with ``clients_per_round``.
    :param int max_backtracks: halvings of the damping tried before a merge that would leave ``q``
        or a cavity invalid is rejected.
    :param clients_per_round: ``K`` clients drawn per round (an int, or a float fraction of the
        clients; ``None``: all), without replacement, from the state's key
        (:mod:`numpyro_pvi.server.sampling`); the others keep their factors. A round's
        ``RoundInfo`` records the drawn clients only (``RoundInfo.clients``).
    :param client_weights: the clients' relative probabilities of being drawn (default uniform).

    **Example:** ``pvi.PVI(..., server=pvi.Synchronous())``, ``pvi.Synchronous(damping=0.5)`` or
    ``pvi.Synchronous(clients_per_round=10)``
    """

    def __init__(
        self,
        damping: Damping | float | None = None,
        *,
        max_backtracks: int = 5,
        clients_per_round: int | float | None = None,
        client_weights: Any = None,
    ) -> None:
        # sampled rounds cannot be compared whole: no heavy ball
        self.synchronous_rounds = clients_per_round is None
        super().__init__(damping, max_backtracks=max_backtracks)
        self.sampling = ClientSampling(clients_per_round, client_weights, "Synchronous")

    def default_damping(self) -> Damping:
        """``HeavyBall()``, or ``AdaptiveDamping()`` when clients are sampled."""
        return HeavyBall() if self.synchronous_rounds else AdaptiveDamping()

    def sampling_rates(self, num_clients: int) -> np.ndarray:
        """``K / M`` for each client (uniform weights; 1 without client sampling)."""
        return np.full(num_clients, self.sampling.num_sampled(num_clients) / num_clients)

    def run_round(self, state: Any, round: Round, num_clients: int) -> Any:
        if self.sampling.active(num_clients):
            ids = [int(m) for m in self.sampling.draw(round.sample_key, num_clients)]
            round.sample(ids)
        else:
            ids = list(range(num_clients))
        state, _ = round(state, ids)
        return state

    def __repr__(self) -> str:
        return f"Synchronous(damping={self.damping}{self.sampling.suffix()})"


class Continual(Server):
    """Each client is visited once, in order, with the current ``q`` as its prior (online VI / VCL).

    A round visits every client that has no accepted update yet, so one round over all clients is
    a streaming pass, and after :meth:`PVI.add_client` the next round visits only the new client.
    Factors of visited clients are never revised. A rejected client is tried again next round.

    It has no ``damping``: each client's update is merged whole (``Fixed(1.0)``).

    **Example:** ``pvi.PVI(..., server=pvi.Continual())``
    """

    def __init__(self, *, max_backtracks: int = 5) -> None:
        super().__init__(1.0, max_backtracks=max_backtracks)

    def init(self, q: NatParams, num_clients: int) -> jax.Array:
        return jnp.zeros(num_clients, bool)  # visited

    def add_client(self, server_state: jax.Array, q: NatParams, m: int) -> jax.Array:
        return server_state.at[m].set(False)

    def run_round(self, state: Any, round: Round, num_clients: int) -> Any:
        visited = np.asarray(state.server_state)[:num_clients]
        for m in np.flatnonzero(~visited):
            state, accepted = round(state, [int(m)])
            state = state._replace(server_state=state.server_state.at[m].set(bool(accepted[0])))
        return state

    def __repr__(self) -> str:
        return "Continual()"


def _is_key(value: Any) -> bool:
    """Whether ``value`` is a JAX random key (raw ``uint32[2]`` or typed)."""
    if not isinstance(value, jax.Array):
        return False
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return value.shape == ()
    return value.dtype == jnp.uint32 and value.shape == (2,)


class AsyncState(NamedTuple):
    """The asynchronous server's bookkeeping: the ``q`` each client pulled, when, and the clock."""

    pulled: NatParams  # (M, ...) the q each client computes against
    pulled_at: jax.Array  # (M,) number of merges when it pulled
    merges: jax.Array  # () merges so far
    round: jax.Array  # () rounds so far (the simulated clock)


class Asynchronous(Server):
    """Lock-free asynchronous PVI, simulated in process with a seeded clock (PVI-async / SNEP's
    server).

    Client ``m`` finishes updates at times ``(phase_m + k) / speeds[m]``, ``k = 0, 1, ...`` (a
    random phase per client drawn from ``rng_key``); round ``r`` processes the updates finished in
    ``[r, r + 1)`` in time order. Each update was computed against the ``q`` the client pulled
    when it finished its previous one (possibly stale); the server adds its damped delta to the
    *current* ``q`` and the client pulls the result. Updates older than ``max_staleness`` merges
    are rejected.

    :param damping: a float in ``(0, 1]`` (:class:`~numpyro_pvi.Fixed`) or a
        :class:`~numpyro_pvi.AdaptiveDamping`; ``None`` (the default) is ``AdaptiveDamping()``
        (stale updates make a fixed damping risky; heavy ball needs synchronous rounds).
    :param int max_staleness: updates older than this many merges are rejected (``None``: none).
    :param speeds: relative speeds of the clients (default all 1: each updates once per round).
    :param rng_key: the key of the clients' random phases (default ``jax.random.PRNGKey(0)``).
    :param int max_backtracks: halvings of the damping tried before a merge that would leave ``q``
        or a cavity invalid is rejected.
    :param clients_per_round: at most ``K`` clients online (in flight) at a time (an int, or a float
        fraction of the clients; ``None``: all). In process, each round draws ``K`` clients from the
        state's key; they pull the current ``q`` as they come online and only their updates finish
        that round (its ``RoundInfo`` records those ``K``, ``RoundInfo.clients``). With a concurrent
        backend (Ray) at most ``K`` updates run at once, each finished one replaced by a client
        drawn from the idle ones, and a round is ``K`` merges (recorded over every client).
    :param client_weights: the clients' relative probabilities of being drawn (default uniform).

    **Example:** ``pvi.PVI(..., server=pvi.Asynchronous(damping=0.5, speeds=[1, 1, 0.2]))``
    """

    def __init__(
        self,
        damping: Damping | float | None = None,
        *,
        max_staleness: int | None = None,
        speeds: Any = None,
        rng_key: jax.Array | None = None,
        max_backtracks: int = 5,
        clients_per_round: int | float | None = None,
        client_weights: Any = None,
    ) -> None:
        super().__init__(damping, max_backtracks=max_backtracks)
        self.sampling = ClientSampling(clients_per_round, client_weights, "Asynchronous")
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(
                "Asynchronous: max_staleness must be a non-negative integer or None, got "
                f"{max_staleness!r}."
            )
        if speeds is not None and not np.all(np.asarray(speeds, float) > 0):
            raise ValueError(f"Asynchronous: speeds must be positive, got {speeds!r}.")
        if rng_key is None:
            rng_key = jax.random.PRNGKey(0)
        if not _is_key(rng_key):
            raise TypeError(
                "Asynchronous: rng_key must be a JAX random key (jax.random.PRNGKey(...)), got "
                f"{rng_key!r}."
            )
        self.max_staleness, self.speeds, self.rng_key = max_staleness, speeds, rng_key

    def default_damping(self) -> Damping:
        """``AdaptiveDamping()``."""
        return AdaptiveDamping()

    def init(self, q: NatParams, num_clients: int) -> AsyncState:
        if self.speeds is not None and len(self.speeds) != num_clients:
            raise ValueError(f"Asynchronous: {len(self.speeds)} speeds for {num_clients} clients.")
        pulled = jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients,) + x.shape), q)
        zero = jnp.zeros((), jnp.int32)
        return AsyncState(pulled, jnp.zeros(num_clients, jnp.int32), zero, zero)

    def add_client(self, server_state: AsyncState, q: NatParams, m: int) -> AsyncState:
        if self.speeds is not None:
            raise ValueError(
                "Asynchronous(speeds=...) has one speed per client: make a new server to add a "
                "client."
            )
        pulled = jax.tree.map(lambda p, x: p.at[m].set(x), server_state.pulled, q)
        return server_state._replace(
            pulled=pulled, pulled_at=server_state.pulled_at.at[m].set(server_state.merges)
        )

    def events(self, round_index: int, num_clients: int) -> list[tuple[float, int]]:
        """``(time, client)`` of the updates finished in round ``round_index``, in time order."""
        speeds = np.ones(num_clients) if self.speeds is None else np.asarray(self.speeds, float)
        phase = np.asarray(jax.random.uniform(self.rng_key, (num_clients,)), np.float64)
        out = []
        for m in range(num_clients):
            first = int(np.ceil(round_index * speeds[m] - phase[m]))
            k = max(first, 0)
            while (phase[m] + k) / speeds[m] < round_index + 1:
                out.append(((phase[m] + k) / speeds[m], m))
                k += 1
        return sorted(out)

    def run_round(self, state: Any, round: Round, num_clients: int) -> Any:
        if round.concurrent:
            return self._run_concurrent(state, round, num_clients)
        server = state.server_state
        events = self.events(int(server.round), num_clients)
        # the drawn clients come online: they pull the current q
        if self.sampling.active(num_clients):
            online = self.sampling.draw(round.sample_key, num_clients)
            round.sample(online)
            chosen = set(online.tolist())
            events = [(t, m) for t, m in events if m in chosen]
            server = server._replace(
                pulled=jax.tree.map(lambda p, q: p.at[online].set(q), server.pulled, state.q),
                pulled_at=server.pulled_at.at[online].set(server.merges),
            )
        for salt, (_, m) in enumerate(events):
            pulled = jax.tree.map(lambda x, m=m: x[m], server.pulled)
            stale = int(server.merges - server.pulled_at[m])
            fresh = self.max_staleness is None or stale <= self.max_staleness
            if not fresh:
                round.note_stale(stale)
            state, accepted = round(state, [m], pulled=pulled, salt=salt, allow=fresh)
            merges = server.merges + 1
            server = AsyncState(
                jax.tree.map(lambda p, q, m=m: p.at[m].set(q), server.pulled, state.q),
                server.pulled_at.at[m].set(merges),
                merges,
                server.round,
            )
        server = server._replace(round=server.round + 1)
        return state._replace(server_state=server)

    def _run_concurrent(self, state: Any, round: Round, num_clients: int) -> Any:
        """Real asynchrony (Ray): every client works all the time; a round is ``num_clients``
        merges.

        Each arriving update is merged at once and its client restarts from the new q, so fast
        clients are never held back by slow ones. Updates still running at the end of a round stay
        in ``round.in_flight``, which belongs to the run: the next round of the same run merges
        them, a new run never sees them.
        """
        server, in_flight = state.server_state, round.in_flight
        limit = self.sampling.num_sampled(num_clients)
        queue = (
            [int(m) for m in self.sampling.order(round.sample_key, num_clients)]
            if self.sampling.active(num_clients)
            else list(range(num_clients))
        )

        def refill(state: Any, server: AsyncState) -> None:
            """Start the next idle clients of the queue until ``limit`` are in flight."""
            while len(in_flight) < limit and queue:
                m = queue.pop(0)
                if m not in in_flight:
                    in_flight[m] = InFlightUpdate(
                        round.start(state, m, salt=int(server.merges) + 1), int(server.merges)
                    )

        refill(state, server)
        for _ in range(limit):
            m = round.wait({k: update.pending for k, update in in_flight.items()})
            update = in_flight.pop(m)
            stale = int(server.merges) - update.pulled_at
            fresh = self.max_staleness is None or stale <= self.max_staleness
            if not fresh:
                round.note_stale(stale)
            state, _ = round.finish(state, m, update.pending, allow=fresh)
            server = server._replace(
                merges=server.merges + 1, pulled_at=server.pulled_at.at[m].set(server.merges + 1)
            )
            if self.sampling.active(num_clients):
                queue.append(m)  # it goes offline: the next idle client of the queue starts
            else:
                queue.insert(0, m)  # every client works all the time: it restarts from the new q
            refill(state, server)
        return state._replace(server_state=server._replace(round=server.round + 1))

    def __repr__(self) -> str:
        return (
            f"Asynchronous(damping={self.damping}, "
            f"max_staleness={self.max_staleness}{self.sampling.suffix()})"
        )
