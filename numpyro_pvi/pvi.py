"""The ``PVI`` inference object: ``init`` / ``update`` / ``run`` / ``evaluate``, like
``numpyro.infer.SVI``.

``q(zeta) ∝ p(zeta) t_0(zeta) prod_m t_m(zeta)`` over the flat unconstrained vector of the model's
global sites; ``t_0`` stands for the non-Gaussian part of the prior
(:mod:`numpyro_pvi.model.prior`),
``t_m`` for client ``m``'s data. One round visits the clients in the server's schedule
(:mod:`numpyro_pvi.server.round`). ``PVI`` holds configuration; the data's
:class:`~numpyro_pvi.model.problem.Problem`
and the :class:`~numpyro_pvi.PVIState` are values passed in and out.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import optax
from tqdm.auto import trange

from numpyro_pvi.backends import get_backend
from numpyro_pvi.config import PVIConfig
from numpyro_pvi.families import FactorFamily, NatParams
from numpyro_pvi.hyper_optim import rprop
from numpyro_pvi.local_updates.base import LocalUpdate
from numpyro_pvi.model import problem as problems
from numpyro_pvi.model.partition import ClientData, is_array, same_static
from numpyro_pvi.model.problem import Problem, build_problem
from numpyro_pvi.model.sites import ModelSites
from numpyro_pvi.model.start import chosen_start
from numpyro_pvi.results.result import PVIRunResult, average_states
from numpyro_pvi.server.elbo import ELBO_KEY
from numpyro_pvi.server.monitor import RunMonitor
from numpyro_pvi.server.play import play_round
from numpyro_pvi.server.round import InFlight, OwnedFactors, Round, cancel_in_flight
from numpyro_pvi.server.servers import Server, Synchronous
from numpyro_pvi.state import MadeFor, PVIState, RoundInfo, broadcast_slots, grow_slots

MEMO_SIZE = 4  # problems remembered by the identity of their data


class PVI:
    """Partitioned variational inference (Bui et al. 2018; Ashman et al. 2022) for a NumPyro model.

    The model marks its data plate with :func:`~numpyro_pvi.partition_plate`. Its global latent
    sites get an approximation ``q`` (of the ``family``) built from one factor per client; each
    client improves its factor against its cavity with ``local_update``; ``server`` schedules the
    clients and merges their damped updates. With one partition this is global VI (``SVI`` with
    ``AutoDiagonalNormal`` / ``AutoMultivariateNormal``).

    :param model: a NumPyro model with one ``partition_plate`` holding its observations.
    :param family: the family of ``q`` and of the factors: :class:`~numpyro_pvi.MeanFieldGaussian`
        or
        :class:`~numpyro_pvi.FullRankGaussian` (Gaussian in the unconstrained space of every global
            site);
        :class:`~numpyro_pvi.Gamma`, :class:`~numpyro_pvi.Beta` or :class:`~numpyro_pvi.Dirichlet`
        (in a site's own space: conjugate to Poisson, Bernoulli, categorical likelihoods); or
        :class:`~numpyro_pvi.SiteFamilies` ``({"w": FullRankGaussian(), "tau": Gamma()})``, a family
        per site (block-diagonal ``q``). See ``docs/families.md``.
    :param partitions: index arrays into the partition plate of the pooled data passed to
        ``init``/``run`` (e.g. from :func:`~numpyro_pvi.split_iid` or
        :func:`~numpyro_pvi.split_by_label`),
        :class:`~numpyro_pvi.ClientData` for federated clients that never pool data, or ``None`` for
        one partition (global VI).
    :param local_update: how a client improves its factor: :class:`~numpyro_pvi.GradientUpdate` (an
        optax optimiser on the local free energy; local latents and hyperparameters),
        :class:`~numpyro_pvi.NaturalGradientUpdate` (CVI),
            :class:`~numpyro_pvi.MomentMatchingUpdate` (EP),
        :class:`~numpyro_pvi.SNEPUpdate` (stochastic natural-gradient EP), and the differentially
            private
        :class:`~numpyro_pvi.DPGradientUpdate` and :class:`~numpyro_pvi.DPLocalAveraging`; or any
        :class:`~numpyro_pvi.local_updates.LocalUpdate`.
    :param server: how rounds run and merge: :class:`~numpyro_pvi.Synchronous` (default
        ``Synchronous()``: every client from the same ``q``, merged with
        :class:`~numpyro_pvi.HeavyBall` damping; a float (:class:`~numpyro_pvi.Fixed`) or
        :class:`~numpyro_pvi.AdaptiveDamping` instead; ``clients_per_round=K`` samples clients),
        :class:`~numpyro_pvi.Sequential` (clients in turn, each from the last one's ``q``),
        :class:`~numpyro_pvi.Asynchronous` (merged as they arrive, stale updates handled) or
        :class:`~numpyro_pvi.Continual` (each client once, as it joins with :meth:`add_client`).
    :param backend: where clients run: ``"vmap"`` (default: a round's clients in one compiled,
        vmapped call), ``"loop"`` (one at a time), ``"ray"`` /
        :class:`~numpyro_pvi.backends.ray.RayBackend` (a
        Ray actor per client), or any :class:`~numpyro_pvi.backends.Backend`. Sites that hold their
        own data run under Flower (:mod:`numpyro_pvi.flower`).
    :param int num_elbo_particles: samples of the global ELBO estimate recorded every round
        (``RoundInfo.elbo``, the ELBO of the ``q`` the round started from; in synchronous rounds
        summed from the clients' reports, :mod:`numpyro_pvi.server.elbo`).
    :param hyper_optimizer: optax optimiser of the model's hyperparameters (``numpyro.param`` sites
        outside the partition plate, in unconstrained space); default :func:`~numpyro_pvi.rprop`
        ``(0.1)``. After every round it takes one step along the sum of the clients' gradients of
        their local free energies (Bui et al. 2018, eq. 5), each a Monte Carlo estimate from the
        local update's ``num_hyper_particles`` draws. Rprop's steps grow while the gradient keeps
        its sign and halve when it flips, which suits one noisy gradient per round; ``pvi.rprop``
        steps on the round's own gradient (``optax.rprop`` on the previous one's, which rings). On
        the 40-row, 8-weight model of ``tests/test_hyperparameters.py`` (4 clients,
        ``Synchronous(0.5)``) a noise scale is within 1 % of its type-II maximum-likelihood value
        after 40 rounds.
    :param init_loc_fn: start ``q`` at the global sites' values this NumPyro init strategy gives
        (e.g. ``numpyro.infer.init_to_median``), split evenly over the clients' factors
        (:mod:`numpyro_pvi.model.start`); default ``None``: ``q`` starts at the prior. Every family
        (each block of a ``SiteFamilies``) builds its own start (``family.initial_q``).
    :param init_scale: the chosen start's spread (default 0.1 when ``init_loc_fn`` is given; alone,
        it starts at ``init_to_median``): the sd in every unconstrained coordinate for the Gaussian
        families, the coefficient of variation for ``Gamma``, the sd relative to ``sqrt(m (1 - m))``
        for ``Beta`` and ``Dirichlet`` (:mod:`numpyro_pvi.model.start`).
    :param num_elbo_clients: where a round's clients do not all report their terms of the ELBO
        (``clients_per_round``, asynchronous servers), the round's ELBO is a pass over the clients'
        data, which takes time in the number of rows; with ``num_elbo_clients=S`` it passes over a
        fixed uniform sample of ``S`` clients (drawn once per problem, the same every round) and
        scales their sum by ``M / S`` (an unbiased estimate; rounds stay comparable, as the sample
        and the draws are fixed). Default ``None``: every client. Not for models with local latent
        sites. A million clients of 1 to 50 rows: ``PVI(..., num_elbo_clients=10_000)``
        (``benchmarks/scale.py --million``, ``docs/servers/scale.md``).

    The options after ``server`` are keyword-only. ``inference.config`` is the configuration as a
    value (:class:`~numpyro_pvi.config.PVIConfig`, what problems and results hold).

    ``PVI`` holds configuration only, like ``numpyro.infer.SVI``. What it builds from the data (the
    sites, the clients' stacked data, the compiled steps) is an immutable
    :class:`~numpyro_pvi.model.problem.Problem` (:meth:`build`);
        ``init``/``update``/``run``/``evaluate`` take the
    data, or a problem in their place. Building is cached, invisibly to results: the same arrays
    give back the same problem, and new arrays of the same shapes and dtypes reuse its compiled
    steps (no recompilation).

    Local latent sites (unobserved, inside the partition plate) get client-private guides kept in
    the clients' states, and discrete ones marked for enumeration are summed out: see
    :mod:`numpyro_pvi.model.local_latents` and ``GradientUpdate``.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp, optax, numpyro, numpyro.distributions as dist
        >>> from jax import random
        >>> import numpyro_pvi as pvi
        >>> def model(x, y=None):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pvi.partition_plate("data", x.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> x, y = jnp.zeros(40), 1.0 + random.normal(random.PRNGKey(0), (40,))
        >>> inference = pvi.PVI(
        ...     model,
        ...     pvi.MeanFieldGaussian(),
        ...     partitions=pvi.split_iid(random.PRNGKey(1), 40, num_clients=4),
        ...     local_update=pvi.GradientUpdate(optax.adam(0.05), num_steps=200),
        ...     server=pvi.Sequential(),
        ... )
        >>> result = inference.run(random.PRNGKey(2), 3, x, y=y, progress_bar=False)
        >>> samples = result.sample_posterior(random.PRNGKey(3), 100)
        >>> samples["mu"].shape
        (100,)
    """

    def __init__(
        self,
        model: Callable,
        family: FactorFamily,
        partitions: Any = None,
        local_update: Any = None,
        server: Server | None = None,
        *,
        backend: Any = "vmap",
        num_elbo_particles: int = 64,
        hyper_optimizer: Any = None,
        init_loc_fn: Callable | None = None,
        init_scale: float | None = None,
        num_elbo_clients: int | None = None,
    ) -> None:
        if not isinstance(family, FactorFamily):
            raise TypeError(
                "family must be a pvi family such as pvi.MeanFieldGaussian() or "
                f"pvi.FullRankGaussian(), got {family!r}."
            )
        if not isinstance(local_update, LocalUpdate):
            raise TypeError(
                "local_update must be a local update such as pvi.GradientUpdate(...), got "
                f"{local_update!r}."
            )
        if hyper_optimizer is not None and not isinstance(
            hyper_optimizer, optax.GradientTransformation
        ):
            raise TypeError(
                f"hyper_optimizer must be an optax.GradientTransformation, got {hyper_optimizer!r}."
            )
        if (
            not isinstance(num_elbo_particles, int)
            or isinstance(num_elbo_particles, bool)
            or num_elbo_particles < 1
        ):
            raise ValueError(
                f"num_elbo_particles must be a positive integer, got {num_elbo_particles!r}."
            )
        if num_elbo_clients is not None and (
            not isinstance(num_elbo_clients, int)
            or isinstance(num_elbo_clients, bool)
            or num_elbo_clients < 1
        ):
            raise ValueError(
                f"num_elbo_clients must be a positive integer or None, got {num_elbo_clients!r}."
            )
        server = Synchronous() if server is None else server
        if not isinstance(server, Server):
            raise TypeError(
                f"server must be a pvi server such as pvi.Synchronous(), got {server!r}."
            )
        if init_scale is not None and not (isinstance(init_scale, (int, float)) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive number or None, got {init_scale!r}.")
        if init_loc_fn is not None and not callable(init_loc_fn):
            raise TypeError(
                "init_loc_fn must be a NumPyro init strategy such as init_to_median, got "
                f"{init_loc_fn!r}."
            )
        self.config = PVIConfig(
            model=model,
            family=family,
            partitions=partitions,
            local_update=local_update,
            server=server,
            backend=get_backend(backend),
            num_elbo_particles=num_elbo_particles,
            hyper_optimizer=rprop(0.1) if hyper_optimizer is None else hyper_optimizer,
            init_loc_fn=init_loc_fn,
            init_scale=init_scale,
            num_elbo_clients=num_elbo_clients,
        )
        self._memo: list[Problem] = []  # a cache (never state): recent problems, newest last
        # the model's param sites (their constraints), read with the first problem, as SVI.init
        # reads its constrain_fn: they are the model's, whatever the data
        self._hyper_sites: tuple | None = None

    # the configuration's parts, read-only (``config`` is the value problems and results hold)
    model = property(lambda self: self.config.model, doc="The NumPyro model.")
    family = property(
        lambda self: self.config.family,
        doc="The family of ``q`` as configured (never laid out: see ``problem.family``).",
    )
    partitions = property(lambda self: self.config.partitions, doc="The clients' partitions.")
    local_update = property(lambda self: self.config.local_update, doc="The local update.")
    server = property(lambda self: self.config.server, doc="The server.")
    backend = property(lambda self: self.config.backend, doc="The backend.")
    num_elbo_particles = property(
        lambda self: self.config.num_elbo_particles, doc="Draws of the round's ELBO."
    )
    hyper_optimizer = property(
        lambda self: self.config.hyper_optimizer, doc="The hyperparameters' optimiser."
    )

    # ------------------------------------------------------------------ the problem

    def build(self, *args: Any, **kwargs: Any) -> Problem:
        """The :class:`~numpyro_pvi.model.problem.Problem` of the model on these data (cached by the
        data's identity).

        **Example:** ``problem = inference.build(X, y=y)``; ``state = inference.init(key,
        problem)``.
        """
        return self._problem(args, kwargs)

    def _problem(self, args: tuple, kwargs: dict) -> Problem:
        if len(args) == 1 and not kwargs and isinstance(args[0], Problem):
            mismatch = args[0].config.mismatch(self.config)
            if mismatch:
                raise ValueError(
                    f"This problem was built by another PVI: its {', '.join(mismatch)} are not "
                    "this PVI's; its compiled steps would use theirs: build it with this PVI's "
                    "build(...)."
                )
            self._hyper_sites = args[0].sites.hyper
            return args[0]
        for problem in reversed(self._memo):
            if _same_data(problem.source, (args, kwargs)):
                return problem
        problem = build_problem(self.config, args, kwargs, reuse=self._compatible(args, kwargs))
        self._memo = [*self._memo[-(MEMO_SIZE - 1) :], problem]
        self._hyper_sites = problem.sites.hyper
        return problem

    def _compatible(self, args: tuple, kwargs: dict) -> Problem | None:
        """The newest cached problem whose data have the same tree structure (its steps may be
        reused)."""
        treedef = jax.tree_util.tree_structure((args, kwargs))
        return next(
            (p for p in reversed(self._memo) if jax.tree_util.tree_structure(p.source) == treedef),
            None,
        )

    # ------------------------------------------------------------------ the SVI-like interface

    def init(self, rng_key: jax.Array, *args: Any, **kwargs: Any) -> PVIState:
        """The initial state: ``q`` = prior, every factor flat.

        :param rng_key: random key of the run.
        :param args, kwargs: the model's pooled data (none with ``partitions=ClientData``), or a
            ``Problem``.
        """
        problem = self._problem(args, kwargs)
        steps, capacity, family = problem.steps, problem.capacity, problem.family
        zeros = jax.device_put(_flat_factor(family, problem.sites.dim))
        factors = broadcast_slots(zeros, capacity, zero=True)
        t0 = zeros if steps.prior_init is None else steps.prior_init(problem.prior, _data(problem))
        # added in NumPy (the same float sums): an eager add compiles in a fresh process
        q = jax.device_put(
            jax.tree.map(lambda a, b: np.asarray(a) + np.asarray(b), problem.prior, t0)
        )
        # a chosen start, split over the factors
        config = self.config
        if config.init_loc_fn is not None or config.init_scale is not None:
            q, factors = chosen_start(
                family,
                config.model,
                problem,
                q,
                rng_key,
                config.init_loc_fn,
                config.init_scale,
            )
        if not bool(_is_valid(family, q)):
            raise ValueError(
                "The prior of the global sites could not be approximated by a proper member of "
                f"the family (sites: {[s.name for s in problem.sites.globals]}); PVI needs proper "
                "priors."
            )
        client_states = broadcast_slots(
            self.local_update.init_state(problem.client_problem), capacity
        )
        hyper = {h.name: jnp.asarray(h.init, jnp.result_type(float)) for h in problem.sites.hyper}
        # not weak-typed: the optimiser's first step must not change types (a recompilation)
        hyper = hyper or ()
        hyper_state = self.hyper_optimizer.init(hyper) if hyper else ()
        return PVIState(
            q,
            factors,
            t0,
            client_states,
            self.server.init(q, capacity),
            rng_key,
            hyper,
            hyper_state,
            broadcast_slots(hyper, capacity, zero=True),
            self.server.damping.init(q, factors, family),
            MadeFor.of(self.config, problem),
        )

    def update(self, state: PVIState, *args: Any, **kwargs: Any) -> tuple[PVIState, RoundInfo]:
        """One round: the prior factor's step (if any), then the clients in the server's schedule.

        :return: the new state and the round's :class:`RoundInfo`.
        """
        problem, in_flight = self._problem(args, kwargs), InFlight()
        try:
            return self._round(state, problem, in_flight, RunMonitor(self.server))
        finally:
            cancel_in_flight(problem.steps.runner, in_flight)

    def _check_state(self, state: PVIState, problem: Problem) -> None:
        if not isinstance(state, PVIState):
            raise TypeError(
                f"state must be a PVIState (from init, or pvi.load), got {type(state).__name__}."
            )
        differences = (
            state.made_for.differences(MadeFor.of(self.config, problem))
            if state.made_for.known
            else []
        )
        if differences:
            raise ValueError(
                "The state was made for another set-up: " + "; ".join(differences) + ". Resume it "
                "with the "
                "PVI (model, "
                "family, "
                "server) and "
                "the data it "
                "was made "
                "for."
            )
        # q's shapes are the prior's (q starts as the prior plus t_0): no trace every round
        expected = jax.tree.map(jnp.shape, problem.prior)
        if jax.tree.map(jnp.shape, state.q) != expected:
            raise ValueError(
                f"The state's q has shapes {jax.tree.map(jnp.shape, state.q)}, but this model's "
                f"global sites {[s.name for s in problem.sites.globals]} with "
                f"{type(problem.family).__name__} need {expected}: was it made for another model "
                "or family?"
            )
        if int(state.factors.eta1.shape[0]) != problem.capacity:
            raise ValueError(
                f"The state has {state.factors.eta1.shape[0]} client slots but the problem "
                f"{problem.capacity} ({problem.num_clients} clients): was it made for other data?"
            )

    def _round(
        self,
        state: PVIState,
        problem: Problem,
        in_flight: InFlight,
        monitor: RunMonitor,
        owned: OwnedFactors | None = None,
    ) -> tuple[PVIState, RoundInfo]:
        self._check_state(state, problem)
        steps, data = problem.steps, _data(problem)

        def make_round(round_key: jax.Array, sample_key: jax.Array) -> Round:
            return Round(
                steps,
                problem.buckets,
                round_key,
                problem.num_clients,
                problem.capacity,
                in_flight,
                sample_key,
                problem.slot_index,
                owned,
            )

        def pooled_elbo(start: PVIState) -> float:
            return self._pooled_elbo(start, problem)

        prior_step = (
            None if steps.prior_step is None else lambda state: steps.prior_step(state, data)
        )
        return play_round(
            self.server,
            problem.family,
            state,
            steps,
            make_round,
            problem.num_clients,
            monitor,
            pooled_elbo,
            prior_step,
        )

    def _pooled_elbo(self, start: PVIState, problem: Problem) -> float:
        """The ELBO of the ``q`` a round started from (``start``) by a pass over every client's
        data, with the same draws every round (common random numbers: rounds' ELBOs compare
        without most of the sampling noise): for rounds whose clients were sent different ``q`` and
        so reported no terms of it (:func:`~numpyro_pvi.server.play.play_round`)."""
        clients, scale = problem.elbo_sample(self.config.num_elbo_clients)
        return float(
            problem.steps.elbo(
                start.q,
                ELBO_KEY,
                clients,
                self.num_elbo_particles,
                start.client_states,
                start.hyper,
                scale,
            )
        )

    def run(
        self,
        rng_key: jax.Array,
        num_rounds: int,
        *args: Any,
        progress_bar: bool = True,
        init_state: PVIState | PVIRunResult | None = None,
        tol: float | None = None,
        init_history: RoundInfo | None = None,
        average_rounds: int | None = None,
        **kwargs: Any,
    ) -> PVIRunResult:
        """Run ``num_rounds`` rounds from ``init(rng_key, ...)`` (or ``init_state``) with a tqdm
        bar.

        Like ``SVI.run(..., init_state=...)``, ``init_state`` continues a run (``rng_key`` is then
        unused: the state carries its key). Given a previous :class:`PVIRunResult`, the run also
        continues its history: ``result.history`` holds the old rounds, then the new ones. From a
        bare state (e.g.
        :func:`~numpyro_pvi.load`), pass the old rounds as ``init_history``; a run resumed from a
        checkpoint then has the uninterrupted run's history (up to the rounds' ``time``), and knows
        which clients were merged before (without it, a sampled client counts as merged only once
        this run merges it).

        Background work of a concurrent backend carries over between the run's rounds and is
        cancelled when the run ends: a later run never merges it. A :class:`~numpyro_pvi.PVIWarning`
        says when the run cannot do what was asked (every update rejected or clamped, a client
        failing every round, a stall, a falling ELBO, no convergence), and
        ``result.stopped_because`` names the same reason.

        :param tol: stop once the run has converged: a round moved ``q`` by at most ``tol``
            posterior sds (``RoundInfo.change``: the largest change of a marginal mean in sds, or of
            a marginal log sd), every update of that round was merged (none rejected, none clamped),
            every client has been merged at least once (client sampling), the ELBO is not falling,
            ``q`` is not drifting one way with more than ``tol`` still to go, and ``q`` is not a
            factorised EP / SNEP fixed point over correlated clients (such a run stops once ``q``
            settles, ``stopped_because == "factorised_correlation"``); ``result.converged`` says
            whether it did. Pick it above the Monte Carlo noise of the local updates (e.g. 0.05 for
            ``GradientUpdate`` with a few particles, far less for exact or natural-gradient
            updates); a run whose ``q`` jitters at that noise floor says so (``stopped_because ==
            "noise_floor"``).
        :param average_rounds: keep the average of the natural parameters of ``q`` (and of the
            factors) over the last ``average_rounds`` rounds: ``result.averaged()`` (an iterate
            average that cuts the jitter of stochastic local updates; it holds ``average_rounds``
            copies of the factors).
        :return: :class:`PVIRunResult` with the final state, the stacked per-round history and the
            problem.

        **Example:** ``result = inference.run(key, 50, X, y=y, tol=0.05, average_rounds=10)``;
        ``result.converged``, ``result.stopped_because``, ``result.averaged().sample_posterior(key,
        1000)``.
        """
        if tol is not None and not (isinstance(tol, (int, float)) and tol > 0):
            raise ValueError(f"tol must be a positive number or None, got {tol!r}.")
        if (
            not isinstance(num_rounds, (int, np.integer))
            or isinstance(num_rounds, bool)
            or num_rounds < 1
        ):
            raise ValueError(f"num_rounds must be a positive integer, got {num_rounds!r}.")
        if average_rounds is not None and (
            not isinstance(average_rounds, (int, np.integer))
            or isinstance(average_rounds, bool)
            or average_rounds < 1
        ):
            raise ValueError(
                f"average_rounds must be a positive integer or None, got {average_rounds!r}."
            )
        problem = self._problem(args, kwargs)
        if isinstance(init_state, PVIRunResult):
            init_state, init_history = (
                init_state.state,
                init_state.history if init_history is None else init_history,
            )
        if init_history is not None and not isinstance(init_history, RoundInfo):
            raise TypeError(
                "init_history must be a RoundInfo (a result's history), got "
                f"{type(init_history).__name__}."
            )
        state = self.init(rng_key, problem) if init_state is None else init_state
        infos, in_flight, monitor = [], InFlight(), RunMonitor(self.server, tol, init_history)
        # the factors each round's steps produce are the next round's to consume (no copy of all
        # M of them a round), unless they are kept for the average
        owned = OwnedFactors()
        # the last rounds' (q, factors, prior factor)
        last: deque = deque(maxlen=average_rounds or 1)
        try:
            with trange(num_rounds, disable=not progress_bar, desc="PVI") as rounds:
                for _ in rounds:
                    state, info = self._round(state, problem, in_flight, monitor, owned)
                    infos.append(info)
                    last.append((state.q, state.factors, state.prior_factor))
                    if average_rounds is not None:
                        owned.release()
                    rounds.set_postfix(
                        elbo=f"{info.elbo:.4g}",
                        rejected=int(info.num_rejected),
                        clamped=int(np.sum(info.clamped)),
                        change=f"{info.change:.2g}",
                    )
                    if monitor.settled:
                        break
        finally:
            cancel_in_flight(problem.steps.runner, in_flight)
        history = RoundInfo.stacked(infos)
        if init_history is not None:
            history = _joined(init_history, history, problem.num_clients)
        converged, stopped_because = monitor.at_end()
        averaged = None if average_rounds is None else average_states(problem.family, state, last)
        return PVIRunResult(
            state, history, self.config, problem, converged, stopped_because, averaged
        )

    def add_client(
        self, state: PVIState, problem: Problem, *args: Any, **kwargs: Any
    ) -> tuple[PVIState, Problem]:
        """A client that holds ``model(*args, **kwargs)``'s data joins a running federated
        inference.

        Nothing is mutated: the state and the problem with one more client are returned. Its factor
        starts flat (``q`` is unchanged); with :class:`~numpyro_pvi.Continual` the next round visits
        only it (continual learning). Client slots and padded rows grow geometrically, so adding
        clients one by one recompiles only when they grow. Only for ``partitions=ClientData``.

        **Example:** ``state, problem = inference.add_client(state, problem, X_new, y=y_new)``, then
        ``state, info = inference.update(state, problem)``.

        :return: ``(state, problem)`` extended by one client.
        """
        if not isinstance(self.partitions, ClientData):
            raise TypeError(
                "add_client needs partitions=pvi.ClientData(...): with pooled data, pass the new "
                "rows in the pooled arrays and new index partitions to a new PVI instead."
            )
        self._check_state(state, problem)
        new = problems.add_client(self.config, problem, args, kwargs)
        local = self.local_update.init_state(new.client_problem)
        if jax.tree.map(jnp.shape, local) != jax.tree.map(
            lambda x: jnp.shape(x)[1:], state.client_states
        ):
            raise NotImplementedError(
                "add_client: the new client holds more local-latent rows than the clients' padded "
                "rows so far, which would change every client's local guide shapes; not supported."
            )
        m, capacity = problem.num_clients, new.capacity
        server_state = grow_slots(state.server_state, self.server.init(state.q, capacity))
        state = state._replace(
            factors=grow_slots(
                state.factors, broadcast_slots(new.family.zeros(new.sites.dim), capacity, zero=True)
            ),
            client_states=grow_slots(state.client_states, broadcast_slots(local, capacity)),
            hyper_grads=grow_slots(
                state.hyper_grads, broadcast_slots(state.hyper, capacity, zero=True)
            ),
            server_state=self.server.add_client(server_state, state.q, m),
        )
        state = state._replace(
            damping=self.server.damping.after_new_client(state.damping, state.q, state.factors),
            made_for=MadeFor.of(self.config, new),
        )
        return state, new

    def evaluate(
        self, state: PVIState, *args: Any, num_particles: int | None = None, **kwargs: Any
    ) -> jax.Array:
        """Monte Carlo estimate of the global ELBO ``E_q[log p(y, theta)] + H[q]`` (all clients'
        data), with the state's key.

        ``RoundInfo.elbo`` is the ELBO of the ``q`` each round started from; the last ``q``'s, on
        the rounds' draws, is ``evaluate(state._replace(rng_key=pvi.server.elbo.ELBO_KEY), ...)``
        (the same number, to float rounding, as the clients' reported terms would sum to).

        **Example:** ``inference.evaluate(result.state, X, y=y, num_particles=4000)``.
        """
        problem = self._problem(args, kwargs)
        return problem.steps.elbo(
            state.q,
            state.rng_key,
            _data(problem),
            num_particles or self.num_elbo_particles,
            state.client_states,
            state.hyper,
        )

    # ------------------------------------------------------------------ the posterior

    def sites(self, *args: Any, **kwargs: Any) -> ModelSites:
        """The model's sites as PVI reads them (global sites, flat layout), from the data or a
        problem."""
        return self._problem(args, kwargs).sites

    def get_posterior(self, state: PVIState, problem: Problem | None = None) -> dist.Distribution:
        """``q`` as a NumPyro distribution over the flat vector ``zeta``.

        :param problem: the problem the state was made on, whose laid-out family
            (``problem.family``) is used. Without it the family is laid out from the global sites'
            shapes the state records (``state.made_for``): all a Gaussian or an exponential family
            needs; a :class:`~numpyro_pvi.SiteFamilies` needs the problem (``ValueError``).

        **Example:** ``inference.get_posterior(state).mean``;
        ``inference.get_posterior(state, problem)`` with ``SiteFamilies``.
        """
        if problem is not None:
            family = problem.family
        elif state.made_for.known:
            family = self.family.with_layout(None, dict(state.made_for.sites))
        else:  # a state built by hand records no sites
            family = self.family
        return family.to_dist(state.q)

    def get_params(self, state: PVIState) -> dict:
        """The model's ``numpyro.param`` values, constrained, like ``SVI.get_params`` (``{}`` if it
        has none): the learned hyperparameters.

        PVI's posterior is not in params (as ``SVI``'s guide parameters are): it is
        :meth:`get_posterior`; draws from it, and a guide for ``Predictive``, need the data's sites:
        ``result.sample_posterior``, ``result.guide`` (or :func:`~numpyro_pvi.results.result.
        sample_posterior` with a problem).

        **Example:** ``Predictive(model, guide=result.guide(),
        params=inference.get_params(result.state))``.
        """
        if not state.hyper:
            return {}
        if self._hyper_sites is None:
            raise RuntimeError(
                "get_params: the constraints of the model's param sites are read from the model "
                "when the first problem is built: call build/init/run first, or read "
                "result.hyperparameters."
            )
        return {site.name: site.transform(state.hyper[site.name]) for site in self._hyper_sites}


# one compiled program per family (eager, its few operations compile one each in a fresh process)
_is_valid = jax.jit(lambda family, q: family.is_valid(q), static_argnums=0)


def _flat_factor(family: FactorFamily, dim: int) -> NatParams:
    """``family.zeros(dim)`` (the flat factor: every natural parameter 0) in NumPy, from its shapes
    alone (eagerly, ``zeros`` compiles in a fresh process)."""
    shapes = jax.eval_shape(lambda: family.zeros(dim))
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def _same_data(source: tuple, data: tuple) -> bool:
    """Whether ``data`` are the very objects ``source`` holds (identity; ``source`` keeps them
    alive)."""
    a, b = jax.tree_util.tree_flatten(source), jax.tree_util.tree_flatten(data)
    return a[1] == b[1] and all(
        x is y if is_array(x) or is_array(y) else same_static(x, y) for x, y in zip(a[0], b[0])
    )


def _data(problem: Problem) -> tuple:
    """The clients' data as the compiled steps take them: one stacked ``Client`` per bucket."""
    return tuple(bucket.clients for bucket in problem.buckets)


def _joined(old: RoundInfo, new: RoundInfo, num_clients: int) -> RoundInfo:
    """A run's earlier rounds (``init_history``) and its new ones, one history: both dense over
    ``num_clients`` clients where one of them is (a sampled history is ``(rounds, K)``)."""
    if (old.clients is None) != (new.clients is None):
        old, new = old.dense(num_clients), new.dense(num_clients)
    return RoundInfo(
        *(
            None if a is None and b is None else np.concatenate([np.asarray(a), np.asarray(b)])
            for a, b in zip(old, new)
        )
    )
