"""The PVI server as a Flower ``Strategy``: the library's servers, run over sites that hold their
own data.

A run starts with one query to every site (its client index, the model's prior, from which ``q``
starts, and its hyperparameters' initial values; every site must agree). Each round is the
in-process round (:func:`~numpyro_pvi.server.play.play_round`): the server's own ``run_round``
schedules the sites through a :class:`~numpyro_pvi.flower.round.FlowerRound`, which sends site ``m``
its cavity ``q - t_m``, ``q``, the hyperparameters and the key ``fold_in(round_key, m)`` -- the key
the in-process run hands client ``m`` -- and merges the replies with the library's merge (damped,
validity-backtracked: a non-finite delta, a failed or silent site is rejected). Damping, the
hyperparameters' step, the monitor's warnings and convergence (``tol``) are the in-process run's
code. The server never sees a site's data.

A site that connects after the run started joins at the next round as
:meth:`PVI.add_client <numpyro_pvi.PVI.add_client>` adds a client (its factor starts flat;
:class:`~numpyro_pvi.Continual` then visits only it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any

import jax
import numpy as np
import optax
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

from numpyro_pvi.families import FactorFamily
from numpyro_pvi.flower import wire
from numpyro_pvi.flower.grid import PollingGrid
from numpyro_pvi.flower.round import FlowerRound, FlowerRunner, hyper_like, result_like
from numpyro_pvi.flower.site_factors import (
    SiteFactorsRound,
    SiteFactorsRunner,
    check_factors,
)
from numpyro_pvi.flower.wire import adopt_layout, tree_from_record, tree_to_record
from numpyro_pvi.hyper_optim import rprop
from numpyro_pvi.local_updates.gradient import GradientUpdate
from numpyro_pvi.model.problem import Problem
from numpyro_pvi.privacy.accounting import privacy_spent
from numpyro_pvi.pvi import PVI
from numpyro_pvi.results.checkpoint import save
from numpyro_pvi.server.damping import AdaptiveDamping
from numpyro_pvi.server.elbo import prior_elbo_term
from numpyro_pvi.server.monitor import RunMonitor
from numpyro_pvi.server.play import play_round
from numpyro_pvi.server.round import InFlight, cancel_in_flight
from numpyro_pvi.server.servers import Server, Synchronous
from numpyro_pvi.server.steps import Steps, make_apply, make_hyper_step, make_prior_logdensity
from numpyro_pvi.state import CLIENT_FIELDS, PVIState, RoundInfo, broadcast_slots, grow_slots

CONNECT_POLL = 1.0  # seconds between checks for connected sites


class PVIStrategy(Strategy):
    """PVI over Flower: any of the library's servers (:class:`~numpyro_pvi.Synchronous` with any
    damping and client sampling, :class:`~numpyro_pvi.Sequential`,
    :class:`~numpyro_pvi.Asynchronous`, :class:`~numpyro_pvi.Continual`) schedules sites that hold
    their own data.

    :param family: the family of ``q`` (the sites' must be the same).
    :param num_clients: the number of sites the run waits for before its first round; each answers
        with a distinct client index ``0 .. M-1``. A site that connects later joins as
        :meth:`PVI.add_client <numpyro_pvi.PVI.add_client>` adds one (with the next index).
    :param rng_key: the run's random key: with the same key, data split, local update and server,
        the rounds give the ``q`` of ``PVI(..., server=server).run(rng_key, ...)`` in process.
    :param server: as :class:`~numpyro_pvi.PVI`'s (default ``Synchronous()``, heavy-ball damping).
        ``Asynchronous`` runs truly asynchronously (as on Ray): a site is sent its next cavity as
        soon as its reply is merged, and a round is ``num_clients`` merges.
    :param hyper_optimizer: the hyperparameters' optax optimiser, as :class:`~numpyro_pvi.PVI`'s
        (default :func:`~numpyro_pvi.rprop` ``(0.1)``), stepped from the sites' gradients.
    :param model: the sites' model, needed where a global site's prior is not Gaussian in
        unconstrained space (e.g. ``sigma ~ HalfNormal(1)`` with a Gaussian ``q``): the server then
        refits its prior factor ``t_0`` before each round with the in-process round's own prior step
        (without it such a model is refused at the start of the run, naming its sites). The prior
        needs no data, but the model needs arguments to run: ``model_args`` / ``model_kwargs``, a
        stand-in for one site's data with the sites' shapes and dtypes (e.g.
        ``(np.zeros((1, 3), np.float32),)`` and ``{"y": np.zeros(1, np.float32)}``: include the
        observations, or they are read as latent). Only their shapes matter: a prior computed from
        the data's values is not supported, and a model whose prior differs from the sites' is
        refused. Example: ``PVIStrategy(pvi.MeanFieldGaussian(), 4, random.PRNGKey(0),
        model=model, model_args=(np.zeros((1, 3), np.float32),), model_kwargs={"y": np.zeros(1,
        np.float32)})``.
    :param int num_elbo_particles: draws of the round's ELBO, as :class:`~numpyro_pvi.PVI`'s.
    :param str factors: where the sites' factors ``t_m`` live. ``"server"`` (default): the server
        holds them and sends each site its cavity. ``"sites"``: each site keeps its own (and forms
        its cavity from ``q``), the server holds ``q`` only (``strategy.state.factors`` is
        ``None``); a merge asks the sites to check their new cavities and then to commit
        (:mod:`~numpyro_pvi.flower.site_factors`), and ``q`` equals the ``"server"`` run's.
        It runs :class:`~numpyro_pvi.Synchronous` with a float or
        :class:`~numpyro_pvi.AdaptiveDamping` (with or without ``clients_per_round``) and
        :class:`~numpyro_pvi.Sequential` and :class:`~numpyro_pvi.Continual`; ``HeavyBall``
        damping (which moves every factor) and :class:`~numpyro_pvi.Asynchronous` are refused by
        name. See the cross-device page of the docs.

    After (or during) a run, ``strategy.state`` is a :class:`~numpyro_pvi.PVIState` (``q``, the
    factors, the hyperparameters; the sites' local states stay at the sites), ``strategy.history``
    the rounds' :class:`~numpyro_pvi.RoundInfo`, ``strategy.converged`` /
    ``strategy.stopped_because`` what :class:`~numpyro_pvi.PVIRunResult` says of an in-process run,
    and ``strategy.traffic`` each round's ``(bytes sent to the sites, bytes received)`` as Flower
    counts its records. ``RoundInfo.elbo`` is, as in process, the ELBO of the ``q`` a round
    started from, summed from the sites' reported terms under that ``q`` and the server's prior
    terms (:mod:`~numpyro_pvi.server.elbo`, the same draws as in process): with the same seeds it
    equals the in-process run's. Rounds whose sites are sent different ``q`` (sequential,
    asynchronous, continual, sampled) have no such sum, and there it is NaN (in process a pooled
    pass over the data, which the server does not have); :class:`~numpyro_pvi.AdaptiveDamping`,
    which follows it, then warns.

    Sites that run a DP local update (:class:`~numpyro_pvi.DPGradientUpdate`,
    :class:`~numpyro_pvi.DPLocalAveraging`) report their release count and rows with each reply
    (``strategy.releases``, ``{client: (releases, rows)}``), and :meth:`privacy_spent` gives each
    site's epsilon, the in-process :meth:`PVIRunResult.privacy_spent
    <numpyro_pvi.PVIRunResult.privacy_spent>`'s for the same run.

    **Example:** ``strategy = PVIStrategy(pvi.MeanFieldGaussian(), 4, random.PRNGKey(0),
    pvi.Synchronous())``; ``ServerApp`` from :func:`server_app`; with the factors at the sites,
    ``PVIStrategy(pvi.MeanFieldGaussian(), 4, random.PRNGKey(0), pvi.Synchronous(0.5),
    factors="sites")``.
    """

    def __init__(
        self,
        family: FactorFamily,
        num_clients: int,
        rng_key: jax.Array,
        server: Server | None = None,
        *,
        hyper_optimizer: optax.GradientTransformation | None = None,
        model: Callable | None = None,
        model_args: tuple = (),
        model_kwargs: dict | None = None,
        num_elbo_particles: int = 64,
        factors: str = "server",
    ) -> None:
        server = Synchronous() if server is None else server
        if (
            not isinstance(num_elbo_particles, int)
            or isinstance(num_elbo_particles, bool)
            or num_elbo_particles < 1
        ):
            raise ValueError(
                f"num_elbo_particles must be a positive integer, got {num_elbo_particles!r}."
            )
        if not isinstance(family, FactorFamily):
            raise TypeError(
                "family must be a pvi family such as pvi.MeanFieldGaussian(), "
                f"pvi.SiteFamilies({{...}}) or pvi.Gamma(), got {family!r}."
            )
        if not isinstance(num_clients, int) or isinstance(num_clients, bool) or num_clients < 1:
            raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}.")
        if not isinstance(server, Server):
            raise TypeError(
                f"server must be a pvi server such as pvi.Synchronous(), got {server!r}."
            )
        if hyper_optimizer is not None and not isinstance(
            hyper_optimizer, optax.GradientTransformation
        ):
            raise TypeError(
                f"hyper_optimizer must be an optax.GradientTransformation, got {hyper_optimizer!r}."
            )
        server.check_clients(num_clients)
        check_factors(factors, server)
        if factors == "sites" and model is not None:
            raise ValueError(
                'factors="sites" cannot refit a non-Gaussian prior\'s factor t_0 (model=): '
                "changing t_0 moves q and every site's cavity, which the server checks with every "
                't_m. Keep the factors at the server (factors="server") for such a model.'
            )
        self.factors = factors
        self.family, self.num_clients, self.rng_key, self.server = (
            family,
            num_clients,
            rng_key,
            server,
        )
        self.hyper_optimizer = rprop(0.1) if hyper_optimizer is None else hyper_optimizer
        self.num_elbo_particles = num_elbo_particles
        self.state: PVIState | None = None
        self.nodes: dict[int, int] = {}  # Flower node id -> client index
        self.infos: list[RoundInfo] = []
        # per round: (bytes sent to the sites, bytes received)
        self.traffic: list[tuple[int, int]] = []
        self.converged: bool | None = None
        self.stopped_because = ""
        self._hyper_shapes: dict = {}
        # the model's prior at the server (t_0's steps), built from model_args / model_kwargs
        self._prior_problem = prior_problem(
            model, family, server, model_args, model_kwargs, num_elbo_particles
        )
        # client index -> (releases, rows) a DP site reported with its last reply
        self.releases: dict[int, tuple[int, int]] = {}

    @property
    def history(self) -> RoundInfo:
        """The rounds' :class:`~numpyro_pvi.RoundInfo`, every field with a leading round axis (the
        per-site fields of rounds before a site joined hold what a site that did not run holds)."""
        if not self.infos:
            raise RuntimeError("No round has run yet.")
        infos, sampled = self.infos, [info.clients is not None for info in self.infos]
        if all(sampled):  # sampled rounds' records: (K,), as in process
            return RoundInfo.stacked(infos)
        if any(sampled):  # sites joined past clients_per_round: every round dense
            infos = [info.dense(self.num_clients) for info in infos]
        sites = max(np.size(info.attempts) for info in infos)

        def padded(name: str, x: Any) -> np.ndarray:
            x = np.asarray(x)
            if x.ndim == 0 or x.shape[0] == sites:
                return x
            fill = np.full(sites - x.shape[0], CLIENT_FIELDS.get(name, 0), x.dtype)
            return np.concatenate([x, fill])

        return RoundInfo.stacked(
            [
                RoundInfo(
                    *(None if x is None else padded(name, x) for name, x in zip(info._fields, info))
                )
                for info in infos
            ]
        )

    # ------------------------------------------------------------------ the run

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Any = None,
        *,
        tol: float | None = None,
    ) -> Result:
        """Query the sites, start ``q`` from the prior, and run up to ``num_rounds`` rounds of the
        server (fewer if the run converges, ``tol`` as in :meth:`PVI.run <numpyro_pvi.PVI.run>`).

        ``initial_arrays`` must be ``None``: ``q`` starts from the model's prior, which the sites
        report. ``timeout``: seconds to wait for the sites to connect and for each reply (a silent
        site is rejected, ``Rejection.TIMEOUT``).
        """
        if initial_arrays is not None:
            raise ValueError(
                "PVIStrategy starts q from the model's prior (reported by the sites): pass no "
                "initial_arrays."
            )
        if not isinstance(num_rounds, int) or isinstance(num_rounds, bool) or num_rounds < 1:
            raise ValueError(f"num_rounds must be a positive integer, got {num_rounds!r}.")
        if tol is not None and not (isinstance(tol, (int, float)) and tol > 0):
            raise ValueError(f"tol must be a positive number or None, got {tol!r}.")
        self.connect(grid, timeout)
        like = result_like(self.state.q, self.state.hyper)
        at_sites = self.factors == "sites"
        runner = (SiteFactorsRunner if at_sites else FlowerRunner)(
            grid,
            {m: node for node, m in self.nodes.items()},
            like,
            timeout,
            ConfigRecord({**dict(train_config or {}), "elbo-particles": self._elbo_particles()}),
        )
        runner.prior_term = self._prior_term()
        self.releases = runner.releases
        steps = Steps(
            None,
            jax.jit(make_apply(self.family, self.server, None)),
            runner,
            None,
            None,
            None,
            make_hyper_step(self.hyper_optimizer) if self.state.hyper else None,
        )
        in_flight, monitor, result = InFlight(), RunMonitor(self.server, tol), Result()

        def make_round(round_key: jax.Array, sample_key: jax.Array) -> FlowerRound:
            if at_sites:
                return SiteFactorsRound(
                    steps,
                    self.family,
                    self.server,
                    round_key,
                    self.num_clients,
                    self.num_clients,
                    in_flight,
                    sample_key,
                )
            return FlowerRound(
                steps,
                self.family,
                round_key,
                self.num_clients,
                self.num_clients,
                in_flight,
                sample_key,
            )

        try:
            for server_round in range(1, num_rounds + 1):
                self._admit(grid, timeout, runner)
                runner.down = runner.up = 0
                self.state, info = play_round(
                    self.server,
                    self.family,
                    self.state,
                    steps,
                    make_round,
                    self.num_clients,
                    monitor,
                    _no_pooled_elbo,
                    self._prior_round(),
                )
                if not np.isfinite(info.elbo) and isinstance(self.server.damping, AdaptiveDamping):
                    monitor.warn(
                        "flower elbo",
                        "AdaptiveDamping follows the round's ELBO, which the sites do not report "
                        "in this run (RoundInfo.elbo is NaN): it shrinks the damping every round. "
                        "Use a fixed damping (a float) or HeavyBall.",
                    )
                self.infos.append(info)
                self.traffic.append((int(runner.down), int(runner.up)))
                result.arrays = tree_to_record(self.state.q)
                result.train_metrics_clientapp[server_round] = MetricRecord(
                    {
                        "accepted": int(np.sum(info.accepted)),
                        "change": float(info.change),
                        "bytes-down": int(runner.down),
                        "bytes-up": int(runner.up),
                    }
                )
                log(
                    INFO,
                    "[ROUND %s/%s] %s",
                    server_round,
                    num_rounds,
                    result.train_metrics_clientapp[server_round],
                )
                if monitor.settled:
                    break
        finally:
            cancel_in_flight(runner, in_flight)
        self.converged, self.stopped_because = monitor.at_end()
        return result

    def connect(self, grid: Grid, timeout: float) -> None:
        """Wait for the sites, learn their client indices, the prior and the hyperparameters, and
        set up :attr:`state`."""
        deadline = time.time() + timeout
        while len(node_ids := list(grid.get_node_ids())) < self.num_clients:
            if time.time() > deadline:
                raise TimeoutError(
                    f"Only {len(node_ids)} of {self.num_clients} sites connected in {timeout} s."
                )
            time.sleep(CONNECT_POLL)
        self.nodes = {}
        # a new run starts afresh; the sites after the first num_clients join at the first round
        info, priors, hypers = self._query(grid, node_ids, timeout)
        first = sorted(info, key=lambda node: int(info[node]["client"]))[: self.num_clients]
        self.nodes = {node: int(info[node]["client"]) for node in first}
        if sorted(self.nodes.values()) != list(range(self.num_clients)):
            raise ValueError(
                f"The sites' client indices {sorted(self.nodes.values())} are not 0 .. "
                f"{self.num_clients - 1}: give each site a distinct partition-id."
            )
        layouts = {str(c["layout"]) for c in info.values()}
        if len(layouts) != 1:
            raise ValueError(
                "The sites report different global sites or family layouts: do they run the same "
                "model and family?"
            )
        # a SiteFamilies (a Dirichlet) is laid out as the sites' own
        self._layout = layouts.pop()
        self.family = adopt_layout(self.family, self._layout)
        c = next(iter(info.values()))
        self._dim, self._hyper_shapes = int(c["dim"]), json.loads(str(c["hyper"]))
        like = self.family.zeros(self._dim)
        q0s = [tree_from_record(priors[n], like, "prior") for n in node_ids]
        hs = [hyper_like(hypers[n], self._hyper_shapes) for n in node_ids]
        if not all(_close(q0s[0], p) and _close(hs[0], h) for p, h in zip(q0s, hs)):
            raise ValueError(
                "The sites report different priors or hyperparameters: do they run the same model "
                "and family?"
            )
        q, hyper = q0s[0], hs[0] or ()
        self._prior = q  # q starts at the prior (with t_0: _start_prior_factor)
        capacity = self.num_clients
        # factors="sites": each site holds its own t_m, the server none
        factors = None if self.factors == "sites" else broadcast_slots(like, capacity, zero=True)
        self.state = PVIState(
            q,
            factors,
            like,
            (),
            self.server.init(q, capacity),
            self.rng_key,
            hyper,
            self.hyper_optimizer.init(hyper) if hyper else (),
            broadcast_slots(hyper, capacity, zero=True),
            self.server.damping.init(q, factors, self.family),
        )
        self.infos, self.traffic = [], []
        self._pending = {n: int(info[n]["client"]) for n in info if n not in self.nodes}
        self._start_prior_factor(str(c.get("fitted-prior-sites", "")))

    def _query(self, grid: Grid, node_ids: list, timeout: float) -> tuple[dict, dict, dict]:
        """Ask the sites ``node_ids`` who they are: ``(config, prior record, hyperparameters
        record)`` by node."""
        messages = [
            Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids
        ]
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        failed = [r for r in replies if r.has_error()]
        if failed:
            raise RuntimeError(f"{len(failed)} site(s) failed to start: {failed[0].error.reason}")
        if len(replies) < len(node_ids):
            raise TimeoutError(
                f"{len(node_ids) - len(replies)} site(s) did not answer the first query in "
                f"{timeout} s."
            )
        info = {r.metadata.src_node_id: r.content.config_records["pvi"] for r in replies}
        for c in info.values():
            if "fitted-prior-sites" in c and self._prior_problem is None:
                raise ValueError(
                    f"This model's global sites [{c['fitted-prior-sites']}] have priors that are "
                    "not Gaussian in unconstrained space: the server refits their prior factor t_0 "
                    "from the model every round, and the sites do not send it. Pass the model: "
                    "PVIStrategy(..., model=model, model_args=..., model_kwargs=...), called on a "
                    "stand-in for one site's data (e.g. a row of zeros with the sites' shapes and "
                    "dtypes, observations included)."
                )
        return (
            info,
            {r.metadata.src_node_id: r.content.array_records["q0"] for r in replies},
            {r.metadata.src_node_id: r.content.array_records["hyper"] for r in replies},
        )

    def _admit(self, grid: Grid, timeout: float, runner: FlowerRunner) -> None:
        """Sites that connected since the last round join, in client-index order, as
        :meth:`PVI.add_client <numpyro_pvi.PVI.add_client>` adds clients."""
        new = [n for n in grid.get_node_ids() if n not in self.nodes and n not in self._pending]
        if new:
            info, _, _ = self._query(grid, new, timeout)
            if {str(c["layout"]) for c in info.values()} != {self._layout}:
                raise ValueError(
                    "A site that joined reports other global sites or another family layout: "
                    "does it run the same model and family?"
                )
            self._pending.update({n: int(info[n]["client"]) for n in info})
        for node, m in sorted(self._pending.items(), key=lambda item: item[1]):
            if m != self.num_clients:
                raise ValueError(
                    f"A site joined with client index {m}; the next free index is "
                    f"{self.num_clients}: give the sites consecutive partition-ids."
                )
            self._add_site(node, m)
            runner.node_of[m] = node
        self._pending = {}

    def _add_site(self, node: int, m: int) -> None:
        """Client slot ``m`` for the site on ``node``: a flat factor, the server's and the damping's
        bookkeeping grown as in :meth:`PVI.add_client <numpyro_pvi.PVI.add_client>`."""
        state, capacity = self.state, m + 1
        server_state = grow_slots(state.server_state, self.server.init(state.q, capacity))
        state = state._replace(
            factors=None
            if state.factors is None
            else grow_slots(
                state.factors, broadcast_slots(self.family.zeros(self._dim), capacity, True)
            ),
            hyper_grads=grow_slots(
                state.hyper_grads, broadcast_slots(state.hyper, capacity, zero=True)
            ),
            server_state=self.server.add_client(server_state, state.q, m),
        )
        self.state = state._replace(
            damping=self.server.damping.after_new_client(state.damping, state.q, state.factors)
        )
        self.nodes[node], self.num_clients = m, capacity

    # ------------------------------------------------------------------ Flower's Strategy interface

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Not used: :meth:`start` runs the server's own rounds (a server's schedule may send
        several messages to a site in one round, or merge replies as they arrive), so Flower's
        one-exchange-per-round loop never calls this."""
        raise NotImplementedError(
            "PVIStrategy runs its rounds in start(): call strategy.start(grid, ...)."
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord, MetricRecord]:
        """Not used (see :meth:`configure_train`)."""
        raise NotImplementedError(
            "PVIStrategy runs its rounds in start(): call strategy.start(grid, ...)."
        )

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

    def _elbo_particles(self) -> int:
        """The draws each site's ELBO term takes; 0 (no term) where the sites of a round are not
        all sent the same ``q``."""
        return self.num_elbo_particles if self.server.synchronous_rounds else 0

    def _prior_term(self) -> Callable | None:
        """``q -> E_q[log p(theta)] + H[q]``, the server's part of the ELBO: from the model's prior
        when the strategy has the model (as in process), else from the prior the sites reported
        (exact in the family: without the model, fitted priors are refused)."""
        if not self.server.synchronous_rounds:
            return None
        family, prior, problem = self.family, self._prior, self._prior_problem
        prior_density = family.to_dist(prior).log_prob
        if problem is not None:
            logdensity = make_prior_logdensity(
                problem.config.model, problem.sites, problem.split.layout
            )
            clients = _clients(problem)
            prior_density = lambda z: logdensity(z, clients)  # noqa: E731
        return jax.jit(lambda q: prior_elbo_term(family, q, prior_density, self.num_elbo_particles))

    def _start_prior_factor(self, fitted: str) -> None:
        """With the model: check that it is the sites' (global sites, family layout, the sites whose
        prior ``t_0`` fits, the prior), and start ``t_0`` as :meth:`PVI.init
        <numpyro_pvi.PVI.init>` does (the sites' ``q`` is the prior with it)."""
        problem = self._prior_problem
        if problem is None:
            return
        if (
            wire.layout_to_text(problem.family, problem.sites) != self._layout
            or ",".join(problem.rest) != fitted
        ):
            raise ValueError(
                "The strategy's model (on model_args / model_kwargs) has other global sites, "
                f"another family layout or other non-Gaussian priors ([{','.join(problem.rest)}]) "
                f"than the sites report ([{fitted}]): pass the sites' model, called on a stand-in "
                "for one site's data of the same shapes."
            )
        steps, zeros = problem.steps, problem.family.zeros(problem.sites.dim)
        t0 = (
            zeros
            if steps.prior_init is None
            else steps.prior_init(problem.prior, _clients(problem))
        )
        q = jax.tree.map(lambda a, b: np.asarray(a) + np.asarray(b), problem.prior, t0)
        if not _close(q, self.state.q):
            raise ValueError(
                "The strategy's model gives another prior than the sites report: do they run the "
                "same model, and does its prior depend on the data's values (model_args)?"
            )
        self.state = self.state._replace(prior_factor=t0)

    def _prior_round(self) -> Callable | None:
        """``state -> state``: the prior factor's step that begins each round in process
        (``Steps.prior_step``, the same compiled function), or ``None`` (the prior is exact in the
        family)."""
        problem = self._prior_problem
        if problem is None or problem.steps.prior_step is None:
            return None
        step, clients = problem.steps.prior_step, _clients(problem)
        return lambda state: step(state, clients)

    def privacy_spent(
        self,
        local_update: Any,
        delta: float,
        client_sampling: str = "known",
        client_rates: Any = None,
    ) -> np.ndarray:
        """``(M,)`` each site's ``epsilon`` at ``delta`` over the updates it released in the run,
        as :meth:`PVIRunResult.privacy_spent <numpyro_pvi.PVIRunResult.privacy_spent>` says in
        process (:func:`~numpyro_pvi.privacy.accounting.privacy_spent`, the same numbers for the
        same run): from the release and row counts each DP site reports with its replies (the
        count its budget gate reads, rejected updates included) and the strategy's history.

        :param local_update: the sites' DP local update (e.g. the ``pvi.DPGradientUpdate`` of the
            app's shared code): the strategy does not otherwise know its noise.

        **Example:** ``strategy.privacy_spent(update, 1e-5)`` is e.g. ``array([0.98, 0.98])``.
        """
        sites = range(self.num_clients)
        history = self.history if self.infos else None
        tried = (
            np.zeros(self.num_clients)
            if history is None
            else np.sum(history.dense(self.num_clients).attempts, 0)
        )
        unknown = [m for m in sites if tried[m] > 0 and m not in self.releases]
        if unknown:
            raise ValueError(
                f"Sites {unknown} were sent updates but reported no release counts: do they run a "
                "DP local update (pvi.DPGradientUpdate, pvi.DPLocalAveraging)? (A site none of "
                "whose replies arrived cannot be accounted for here.)"
            )
        counts = [self.releases.get(m, (0, 1)) for m in sites]
        return privacy_spent(
            local_update,
            self.server,
            self.state,
            history,
            [rows for _, rows in counts],
            delta,
            client_sampling=client_sampling,
            client_rates=client_rates,
            released=[released for released, _ in counts],
        )


def prior_problem(
    model: Callable | None,
    family: FactorFamily,
    server: Server,
    model_args: tuple,
    model_kwargs: dict | None,
    num_elbo_particles: int,
) -> Problem | None:
    """The model's :class:`~numpyro_pvi.model.problem.Problem` on a stand-in for one site's data
    (``model(*model_args, **model_kwargs)``), whose prior steps the strategy runs; ``None`` without
    a model. The prior must not depend on the data's values: only its shapes reach the server.

    **Example:** ``prior_problem(model, pvi.MeanFieldGaussian(), pvi.Synchronous(), (np.zeros((1,
    2)),), {"y": np.zeros(1)}, 64)``
    """
    if model is None:
        if model_args != () or model_kwargs is not None:
            raise ValueError("model_args and model_kwargs are the model's: pass model= too.")
        return None
    if not callable(model):
        raise TypeError(f"model must be a NumPyro model (a callable), got {model!r}.")
    if not isinstance(model_args, tuple):
        raise TypeError(f"model_args must be a tuple, got {type(model_args).__name__}.")
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise TypeError(f"model_kwargs must be a dict or None, got {type(model_kwargs).__name__}.")
    # the prior's steps use no local update (PVI needs one); the strategy's server damps t_0
    stand_in = GradientUpdate(optax.sgd(0.0), num_steps=1)
    inference = PVI(model, family, None, stand_in, server, num_elbo_particles=num_elbo_particles)
    return inference.build(*model_args, **(model_kwargs or {}))


def _clients(problem: Problem) -> tuple:
    """The problem's data as its compiled steps take them (one stacked client per bucket)."""
    return tuple(bucket.clients for bucket in problem.buckets)


def _no_pooled_elbo(start: PVIState) -> float:
    """The round's ELBO where the sites did not all report their terms of it: unknown (NaN), the
    server has no data for a pooled pass."""
    return float("nan")


def _close(a: Any, b: Any) -> bool:
    """Whether the pytrees ``a`` and ``b`` hold the same values (to float rounding)."""
    return all(np.allclose(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


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
