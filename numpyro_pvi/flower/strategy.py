"""The PVI server as a Flower ``Strategy``: it holds ``q`` and the factors and merges the sites'
deltas.

A run starts with one query to every site (its client index and the model's prior, from which ``q``
starts; every site must agree). Each round then sends site ``m`` its cavity ``q - t_m``, ``q`` and
the random key ``fold_in(round_key, m)`` -- the key the in-process run hands client ``m`` -- and
merges the replies with
:func:`~numpyro_pvi.server.merge.merge`, the library's damped merge with validity backtracking: a
non-finite delta, a failed or silent site is rejected, and a merge that would leave ``q`` or a
cavity invalid is retried with the damping halved and, failing that, dropped. The server never sees
a site's data.

With client sampling (``Synchronous(damping, clients_per_round=K, client_weights=...)``) a round
draws its ``K`` sites from the state's key exactly as the in-process server does
(:mod:`numpyro_pvi.server.sampling`): only they receive a message, the others keep their factors,
and the run still equals the in-process one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from numpyro_pvi.backends.base import stack
from numpyro_pvi.families import FactorFamily, NatParams
from numpyro_pvi.flower.grid import PollingGrid
from numpyro_pvi.flower.wire import (
    adopt_layout,
    content_bytes,
    key_to_record,
    tree_from_record,
    tree_to_record,
)
from numpyro_pvi.results.checkpoint import save
from numpyro_pvi.server.damping import Fixed
from numpyro_pvi.server.merge import merge, rejection_codes, screen
from numpyro_pvi.server.monitor import RunMonitor, q_change
from numpyro_pvi.server.servers import Sequential, Synchronous
from numpyro_pvi.state import PVIState, Rejection, RoundInfo

CONNECT_POLL = 1.0  # seconds between checks for connected sites


class PVIStrategy(Strategy):
    """PVI over Flower: synchronous rounds (every site against the same ``q``, PVI-sync) or
    sequential ones (site after site, each against the ``q`` its predecessor left, PVI-seq).

    :param family: the family of ``q`` (the sites' must be the same).
    :param num_clients: the number of sites; each answers with a distinct client index ``0 .. M-1``.
    :param rng_key: the run's random key: with the same key, data split, local update and server,
        the rounds give the ``q`` of ``PVI(..., server=server).run(rng_key, ...)`` in process.
    :param server: ``pvi.Synchronous(damping)`` with a fixed damping (an adaptive damping needs the
        global ELBO, which needs all the data; default ``Synchronous(1.0)``), optionally sampling
        ``clients_per_round`` sites per round (with ``client_weights``), or ``pvi.Sequential()``.

    After (or during) a run, ``strategy.state`` is a :class:`~numpyro_pvi.PVIState` (``q``, the
    factors; the sites' local states stay at the sites), ``strategy.history`` the rounds'
    :class:`~numpyro_pvi.RoundInfo` (``elbo`` is NaN: the server cannot evaluate it without data)
    and ``strategy.traffic`` each round's ``(bytes sent to the sites, bytes received)`` as Flower
    counts its records.

    **Example:** ``strategy = PVIStrategy(pvi.MeanFieldGaussian(), 4, random.PRNGKey(0),
    pvi.Synchronous(0.5))``; ``ServerApp`` from :func:`server_app`.
    """

    def __init__(
        self,
        family: FactorFamily,
        num_clients: int,
        rng_key: jax.Array,
        server: Synchronous | Sequential | None = None,
    ) -> None:
        server = Synchronous(1.0) if server is None else server
        if not isinstance(family, FactorFamily):
            raise TypeError(
                "family must be a pvi family such as pvi.MeanFieldGaussian(), "
                f"pvi.SiteFamilies({{...}}) or pvi.Gamma(), got {family!r}."
            )
        if not isinstance(num_clients, int) or isinstance(num_clients, bool) or num_clients < 1:
            raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}.")
        if type(server) not in (Synchronous, Sequential):
            raise NotImplementedError(
                f"PVIStrategy runs pvi.Synchronous or pvi.Sequential rounds; got {server!r}."
            )
        server.sampling.check(num_clients)
        if not isinstance(server.damping, Fixed):
            raise ValueError(
                "PVIStrategy needs a fixed damping, e.g. pvi.Synchronous(0.5), got "
                f"{server.damping!r}: AdaptiveDamping follows the global ELBO, which needs every "
                "site's data, and pvi.HeavyBall (the default of pvi.Synchronous()) is not wired "
                "through Flower yet."
            )
        self.family, self.num_clients, self.rng_key, self.server = (
            family,
            num_clients,
            rng_key,
            server,
        )
        self.state: PVIState | None = None
        self.nodes: dict[int, int] = {}  # Flower node id -> client index
        self.infos: list[RoundInfo] = []
        # per round: (bytes sent to the sites, bytes received)
        self.traffic: list[tuple[int, int]] = []
        # self.family when first traced: the family as start() laid it out from the sites' layout
        self._merge = jax.jit(
            lambda q, factors, ids, deltas, ok: merge(
                self.family,
                q,
                factors,
                ids,
                deltas,
                ok,
                server.damping.rho(()),
                server.max_backtracks,
            )
        )
        self._accepted, self._monitor = np.zeros(num_clients, bool), RunMonitor(server)
        self._round: dict = {}

    @property
    def history(self) -> RoundInfo:
        """The rounds' :class:`~numpyro_pvi.RoundInfo`, every field with a leading round axis."""
        if not self.infos:
            raise RuntimeError("No round has run yet.")
        return RoundInfo(*(np.stack([np.asarray(x) for x in field]) for field in zip(*self.infos)))

    # ------------------------------------------------------------------ the run

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable | None = None,
    ) -> Result:
        """Query the sites, start ``q`` from the prior, and run ``num_rounds`` rounds (Flower's
        loop).

        ``initial_arrays`` must be ``None``: ``q`` starts from the model's prior, which the sites
        report.
        """
        if initial_arrays is not None:
            raise ValueError(
                "PVIStrategy starts q from the model's prior (reported by the sites): pass no "
                "initial_arrays."
            )
        if not isinstance(num_rounds, int) or isinstance(num_rounds, bool) or num_rounds < 1:
            raise ValueError(f"num_rounds must be a positive integer, got {num_rounds!r}.")
        self.connect(grid, timeout)
        if isinstance(self.server, Sequential):
            return self._run_sequential(
                grid, num_rounds, timeout, ConfigRecord() if train_config is None else train_config
            )
        return super().start(
            grid,
            tree_to_record(self.state.q),
            num_rounds,
            timeout,
            train_config,
            evaluate_config,
            evaluate_fn,
        )

    def connect(self, grid: Grid, timeout: float) -> None:
        """Wait for the sites, learn their client indices and the prior, and set up
        :attr:`state`."""
        deadline = time.time() + timeout
        while len(node_ids := list(grid.get_node_ids())) < self.num_clients:
            if time.time() > deadline:
                raise TimeoutError(
                    f"Only {len(node_ids)} of {self.num_clients} sites connected in {timeout} s."
                )
            time.sleep(CONNECT_POLL)
        messages = [
            Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids
        ]
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        failed = [r for r in replies if r.has_error()]
        if failed:
            raise RuntimeError(f"{len(failed)} site(s) failed to start: {failed[0].error.reason}")
        info = {r.metadata.src_node_id: r.content.config_records["pvi"] for r in replies}
        self.nodes = {node: int(c["client"]) for node, c in info.items()}
        if sorted(self.nodes.values()) != list(range(self.num_clients)):
            raise ValueError(
                f"The sites' client indices {sorted(self.nodes.values())} are not 0 .. "
                f"{self.num_clients - 1}: give each site a distinct partition-id."
            )
        for c in info.values():
            if "fitted-prior-sites" in c or "hyper-sites" in c:
                raise NotImplementedError(
                    "PVIStrategy handles global sites with a Gaussian prior in unconstrained "
                    "space and no hyperparameters; this model has prior-fitted sites "
                    f"[{c.get('fitted-prior-sites', '')}] and hyperparameters "
                    f"[{c.get('hyper-sites', '')}]. Run it in process (pvi.PVI) instead."
                )
        layouts = {str(c["layout"]) for c in info.values()}
        if len(layouts) != 1:
            raise ValueError(
                "The sites report different global sites or family layouts: do they run the same "
                "model and family?"
            )
        # a SiteFamilies (a Dirichlet) is laid out as the sites' own
        self.family = adopt_layout(self.family, layouts.pop())
        like = self.family.zeros(int(next(iter(info.values()))["dim"]))
        priors = [tree_from_record(r.content.array_records["q0"], like, "prior") for r in replies]
        if not all(
            all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(priors[0]), jax.tree.leaves(p)))
            for p in priors
        ):
            raise ValueError(
                "The sites report different priors: do they run the same model and family?"
            )
        factors = jax.tree.map(lambda x: jnp.zeros((self.num_clients,) + x.shape, x.dtype), like)
        # a new run starts afresh
        self.state = PVIState(priors[0], factors, like, (), None, self.rng_key)
        self.infos, self._accepted, self._monitor = (
            [],
            np.zeros(self.num_clients, bool),
            RunMonitor(self.server),
        )
        self.traffic = []

    # ------------------------------------------------------------------ one round

    def begin_round(self) -> None:
        """Split the state's key as :meth:`PVI.update <numpyro_pvi.PVI.update>` does, draw the
        round's sites (all of them without client sampling) and open the round's record."""
        round_key, sample_key, next_key = jax.random.split(self.state.rng_key, 3)
        m_total, sampling = self.num_clients, self.server.sampling
        ids = (
            [int(m) for m in sampling.draw(sample_key, m_total)]
            if sampling.active(m_total)
            else list(range(m_total))
        )
        self._round = {
            "start": time.perf_counter(),
            "key": round_key,
            "next_key": next_key,
            "old_q": self.state.q,
            "ids": ids,
            "down": 0,
            "up": 0,
            "free_energy": np.full(m_total, np.nan),
            "clamped": np.zeros(m_total, int),
            "accepted": np.zeros(m_total, int),
            "damping": np.zeros(m_total),
            "rejection": np.zeros(m_total, int),
            "moved": np.zeros(m_total, bool),
        }

    def messages(self, ids: list, server_round: int, config: ConfigRecord) -> list[Message]:
        """Site ``m`` of ``ids`` gets its cavity ``q - t_m``, ``q``, its key and whether its last
        update was merged."""
        state, round_key = self.state, self._round["key"]
        node_of = {m: node for node, m in self.nodes.items()}
        q_record, out = tree_to_record(state.q), []
        for m in ids:
            cavity = jax.tree.map(lambda a, f, m=m: a - f[m], state.q, state.factors)
            # as the compiled group step does
            key, impl = key_to_record(jax.random.fold_in(round_key, m))
            settings = ConfigRecord(
                {
                    **dict(config),
                    "server-round": server_round,
                    "client": m,
                    "key-impl": impl,
                    "accepted": int(self._accepted[m]),
                }
            )
            content = RecordDict(
                {"cavity": tree_to_record(cavity), "q": q_record, "key": key, "pvi": settings}
            )
            self._round["down"] += content_bytes(content)
            out.append(Message(content, dst_node_id=node_of[m], message_type=MessageType.TRAIN))
        return out

    def merge_replies(self, ids: list, replies: Iterable[Message]) -> None:
        """Merge the replies of the sites ``ids`` (damped, validity-backtracked; failed or silent
        sites rejected)."""
        like = jax.tree.map(lambda f: f[0], self.state.factors)
        n, rec = len(ids), self._round
        deltas = [jax.tree.map(lambda x: jnp.full(x.shape, jnp.nan, x.dtype), like)] * n
        # silent: timed out
        free_energy, failure = np.full(n, np.nan), np.full(n, int(Rejection.TIMEOUT))
        position = {m: i for i, m in enumerate(ids)}
        for reply in replies:
            m = self.nodes[reply.metadata.src_node_id]
            i = position[m]
            if reply.has_error():
                failure[i] = Rejection.RAISED
                continue
            metrics = reply.content.metric_records["pvi"]
            deltas[i] = tree_from_record(
                reply.content.array_records["delta"], like, f"delta of client {m}"
            )
            free_energy[i], failure[i] = metrics["free-energy"], metrics["failure"]
            rec["clamped"][m] += int(metrics["clamped"])
            rec["up"] += content_bytes(reply.content)
        outcome = self._apply(ids, stack(deltas), free_energy, failure)
        rec["free_energy"][ids] = free_energy
        for name in ("accepted", "damping", "rejection", "moved"):
            rec[name][ids] = outcome[name]

    def end_round(self) -> tuple[ArrayRecord, MetricRecord]:
        """Record the round (:attr:`history`), warn as :meth:`PVI.run <numpyro_pvi.PVI.run>` does,
        move the key on."""
        rec, m_total = self._round, self.num_clients
        attempts = np.zeros(m_total, int)
        attempts[rec["ids"]] = 1
        info = RoundInfo(
            np.nan,
            rec["free_energy"],
            attempts,
            rec["accepted"],
            rec["damping"],
            rec["clamped"],
            time.perf_counter() - rec["start"],
            rec["rejection"],
            rec["moved"],
            q_change(self.family, rec["old_q"], self.state.q),
        )
        self.infos.append(info)
        self.traffic.append((int(rec["down"]), int(rec["up"])))
        self._monitor.after_round(info, [])
        self.state = self.state._replace(rng_key=rec["next_key"])
        metrics = MetricRecord(
            {
                "accepted": int(info.accepted.sum()),
                "change": float(info.change),
                "bytes-down": int(rec["down"]),
                "bytes-up": int(rec["up"]),
            }
        )
        return tree_to_record(self.state.q), metrics

    def _apply(
        self, ids: list, deltas: NatParams, free_energy: np.ndarray, failure: np.ndarray
    ) -> dict:
        """Merge ``deltas`` (stacked over ``ids``) into the state; per client: accepted, damping,
        rejection, moved."""
        finite, moved = (np.asarray(x) for x in screen(deltas, jnp.asarray(free_energy)))
        finite = finite & (failure == 0)
        state = self.state
        merged = self._merge(state.q, state.factors, jnp.asarray(ids), deltas, jnp.asarray(finite))
        self.state = state._replace(q=merged.q, factors=merged.factors)
        accepted = finite & bool(merged.valid)
        rejection = np.asarray(
            rejection_codes(jnp.asarray(failure), jnp.asarray(finite), merged.valid)
        )
        self._accepted[ids] = accepted
        return {
            "accepted": accepted.astype(int),
            "damping": float(merged.damping) * accepted,
            "rejection": rejection,
            "moved": moved & accepted,
        }

    def _run_sequential(
        self, grid: Grid, num_rounds: int, timeout: float, config: ConfigRecord
    ) -> Result:
        """Sequential rounds: site after site, each against the ``q`` its predecessor left
        (PVI-seq)."""
        result = Result()
        for server_round in range(1, num_rounds + 1):
            self.begin_round()
            for m in range(self.num_clients):
                self.merge_replies(
                    [m],
                    grid.send_and_receive(
                        self.messages([m], server_round, config), timeout=timeout
                    ),
                )
            result.arrays, result.train_metrics_clientapp[server_round] = self.end_round()
            log(
                INFO,
                "[ROUND %s/%s] %s",
                server_round,
                num_rounds,
                result.train_metrics_clientapp[server_round],
            )
        return result

    # ------------------------------------------------------------------ Flower's Strategy interface

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """A synchronous round: every site drawn this round (all, without sampling) gets its cavity
        against the same ``q``; the others get no message."""
        self.begin_round()
        return self.messages(self._round["ids"], server_round, config)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord, MetricRecord]:
        """Merge the round's sites' deltas at once (see :meth:`merge_replies`)."""
        self.merge_replies(self._round["ids"], replies)
        return self.end_round()

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No federated evaluation round (the sites' free energies come with their updates)."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Nothing to aggregate (see :meth:`configure_evaluate`)."""
        return None

    def summary(self) -> None:
        """Log the configuration (Flower calls this when the run starts)."""
        log(
            INFO,
            "\t└──> PVIStrategy: %s, %d sites, %r",
            type(self.family).__name__,
            self.num_clients,
            self.server,
        )


def server_app(
    strategy: PVIStrategy,
    num_rounds: int | None = None,
    timeout: float = 3600,
    checkpoint: str | None = None,
) -> ServerApp:
    """A Flower ``ServerApp`` that runs ``strategy`` for ``num_rounds`` rounds (default: the run
    config's ``num-server-rounds``, as in Flower's app templates).

    :param timeout: seconds to wait for the sites to connect and, each round, for their replies (a
        site that has not answered by then is rejected for the round, ``Rejection.TIMEOUT``).
    :param checkpoint: write the final :class:`~numpyro_pvi.PVIState` there
        (:func:`~numpyro_pvi.save`): in a deployment the ``ServerApp`` runs in its own process, so
        this is how ``q`` leaves it.

    **Example:** ``app = server_app(PVIStrategy(pvi.MeanFieldGaussian(), 4, random.PRNGKey(0)),
    num_rounds=10)``
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        rounds = int(context.run_config["num-server-rounds"]) if num_rounds is None else num_rounds
        strategy.start(PollingGrid(grid), num_rounds=rounds, timeout=timeout)
        if checkpoint is not None:
            save(strategy.state, checkpoint)

    return app
