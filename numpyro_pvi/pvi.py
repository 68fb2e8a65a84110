"""The ``PVI`` inference object: ``init`` / ``update`` / ``run`` / ``evaluate``, like ``numpyro.infer.SVI``.

``q(zeta) ∝ p(zeta) t_0(zeta) prod_m t_m(zeta)`` over the flat unconstrained vector of the model's
global sites; ``t_0`` stands for the non-Gaussian part of the prior (:mod:`numpyro_pvi.prior`), ``t_m``
for client ``m``'s data. One round visits every client once, in the server's schedule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from numpyro.infer import Trace_ELBO, TraceEnum_ELBO
from tqdm.auto import trange

from numpyro_pvi.backends import get_backend
from numpyro_pvi.families import MeanFieldGaussian, NatParams
from numpyro_pvi.local_latents import expected_local_elbo, local_distribution, own_rows, sample_local
from numpyro_pvi.local_updates import Client, ClientProblem, ClientResult
from numpyro_pvi.partition import ClientData, pad_clients, pooled_to_client_data
from numpyro_pvi.prior import PriorFactor, exact_prior
from numpyro_pvi.servers import Server, Synchronous, backtrack, is_valid_state, merge
from numpyro_pvi.sites import ModelSites, local_model, log_likelihood, log_prior, read_model


class PVIState(NamedTuple):
    """The server's state (a pytree).

    :ivar q: natural parameters of the global approximation ``q`` (``(D,)`` leaves).
    :ivar factors: client factors ``t_m`` stacked ``(M, ...)``.
    :ivar prior_factor: ``t_0`` for the non-Gaussian prior sites (zeros if the prior is Gaussian).
    :ivar client_states: each client's persistent local-update state, stacked ``(M, ...)``; never merged.
    :ivar server_state: the server's own bookkeeping (e.g. ``Asynchronous``'s stale copies of q).
    :ivar rng_key: the random key of the next round.
    :ivar hyper: the hyperparameters (``numpyro.param`` sites) in unconstrained space, ``()`` if none.
    :ivar hyper_state: the state of the server's ``hyper_optimizer``.
    :ivar hyper_grads: each client's latest accepted gradient of its local free energy with respect to
        ``hyper``, stacked ``(M, ...)``; the server steps along their sum, so a client that did not
        report this round (asynchronous servers) still counts with its latest gradient.

    **Example:** ``state = inference.init(key, X, y=y)``, ``state, info = inference.update(state, X, y=y)``;
    ``inference.get_posterior(state)`` is ``q``, ``pvi.save(state, "run.npz")`` a checkpoint.
    """

    q: NatParams
    factors: NatParams
    prior_factor: NatParams
    client_states: Any
    server_state: Any
    rng_key: jax.Array
    hyper: Any = ()
    hyper_state: Any = ()
    hyper_grads: Any = ()


class RoundInfo(NamedTuple):
    """What happened in a round (in ``history`` every field gains a leading round axis).

    :ivar elbo: global ELBO estimate of ``q`` after the round.
    :ivar free_energy: ``(M,)`` each client's local free energy at the end of its last update (NaN if none).
    :ivar attempts: ``(M,)`` updates each client sent (1 per round except under ``Asynchronous``/``Continual``).
    :ivar accepted: ``(M,)`` how many of them were merged (finite, valid, not too stale).
    :ivar damping: ``(M,)`` the damping applied to each client's last update (0 if rejected).
    :ivar clamped: ``(M,)`` corrections each client's local update made to stay valid.
    :ivar time: wall-clock seconds of the round.

    **Example:** ``state, info = inference.update(state, X, y=y)``; ``info.elbo``, ``info.num_rejected``;
    over a run, ``result.history.free_energy`` is ``(rounds, M)``.
    """

    elbo: Any
    free_energy: Any
    attempts: Any
    accepted: Any
    damping: Any
    clamped: Any
    time: Any

    @property
    def num_rejected(self) -> Any:
        """Number of rejected client updates (per round in ``history``)."""
        return np.sum(np.asarray(self.attempts) - np.asarray(self.accepted), axis=-1)


@dataclass(frozen=True)
class _Setup:
    """Everything built once per data set: the model's sites, padded client data, compiled steps."""

    sites: ModelSites
    data: tuple  # (arrays, mask, sizes) of PaddedClients
    problem: ClientProblem
    prior: NatParams
    prior_factor: PriorFactor | None
    group_step: Callable
    apply: Callable
    prior_step: Callable | None
    elbo: Callable
    hyper_step: Callable | None = None


class PVI:
    """Partitioned variational inference (Bui et al. 2018; Ashman et al. 2022) for a NumPyro model.

    The model marks its data plate with :func:`~numpyro_pvi.partition_plate`. Its global latent
    sites get a Gaussian ``q`` in unconstrained space built from one factor per client; each client
    improves its factor against its cavity with ``local_update``; ``server`` schedules the clients
    and merges their damped updates. With one partition this is global VI (``SVI`` with
    ``AutoDiagonalNormal`` / ``AutoMultivariateNormal``).

    :param model: a NumPyro model with one ``partition_plate`` holding its observations.
    :param family: ``MeanFieldGaussian()`` or ``FullRankGaussian()``.
    :param partitions: index arrays into the partition plate of the pooled data passed to
        ``init``/``run`` (e.g. from :func:`~numpyro_pvi.split_iid`), ``ClientData`` for federated
        clients that never pool data, or ``None`` for one partition (global VI).
    :param local_update: how a client improves its factor, e.g. ``GradientUpdate(...)``.
    :param server: ``Synchronous(damping)`` (default) or ``Sequential()``.
    :param backend: ``"vmap"`` (default: a round's clients in one compiled, vmapped call) or ``"loop"``.
    :param int num_elbo_particles: samples of the global ELBO estimate recorded every round.
    :param hyper_optimizer: optax optimiser of the model's hyperparameters (``numpyro.param`` sites
        outside the partition plate, in unconstrained space); default ``optax.adam(1e-2)``. After
        every round it takes one step along the sum of the clients' gradients of their local free
        energies (Bui et al. 2018, eq. 5).

    Local latent sites (unobserved, inside the partition plate) get client-private guides kept in
    the clients' states, and discrete ones marked for enumeration are summed out: see
    :mod:`numpyro_pvi.local_latents` and ``GradientUpdate``.

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
        >>> inference = pvi.PVI(model, pvi.MeanFieldGaussian(),
        ...                     partitions=pvi.split_iid(random.PRNGKey(1), 40, num_clients=4),
        ...                     local_update=pvi.GradientUpdate(optax.adam(0.05), num_steps=200),
        ...                     server=pvi.Sequential())
        >>> result = inference.run(random.PRNGKey(2), 3, x, y=y, progress_bar=False)
        >>> samples = result.sample_posterior(random.PRNGKey(3), 100)
        >>> samples["mu"].shape
        (100,)
    """

    def __init__(self, model: Callable, family: MeanFieldGaussian, partitions: Any = None, local_update: Any = None,
                 server: Server | None = None, backend: Any = "vmap", num_elbo_particles: int = 64,
                 hyper_optimizer: Any = None) -> None:
        if not isinstance(family, MeanFieldGaussian):
            raise TypeError(f"family must be pvi.MeanFieldGaussian() or pvi.FullRankGaussian(), got {family!r}.")
        if local_update is None or not hasattr(local_update, "bind"):
            raise TypeError(f"local_update must be a local update such as pvi.GradientUpdate(...), "
                            f"got {local_update!r}.")
        server = Synchronous() if server is None else server
        if not isinstance(server, Server):
            raise TypeError(f"server must be a pvi server such as pvi.Synchronous(), got {server!r}.")
        self.model = model
        self.family = family
        self.partitions = partitions
        self.local_update = local_update
        self.server = server
        self.backend = get_backend(backend)
        self.num_elbo_particles = num_elbo_particles
        self.hyper_optimizer = optax.adam(1e-2) if hyper_optimizer is None else hyper_optimizer
        self._cache: tuple | None = None

    # ------------------------------------------------------------------ set-up (once per data set)

    def _setup(self, args: tuple, kwargs: dict) -> _Setup:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        key = (treedef, tuple(id(x) for x in leaves))
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        setup = self._build(args, kwargs)
        self._cache = (key, setup)
        return setup

    def _build(self, args: tuple, kwargs: dict) -> _Setup:
        read_key = jax.random.PRNGKey(0)
        clients, expected = self._client_data(args, kwargs, read_key)
        sites, sizes = None, []
        for m, (c_args, c_kwargs) in enumerate(clients):
            client_sites = read_model(self.model, c_args, c_kwargs, read_key, relations=m == 0,
                                      who=f"Client {m}'s data")
            if expected is not None and client_sites.plate_size != expected[m]:
                raise ValueError(
                    f"partition_plate '{client_sites.plate}' has size {client_sites.plate_size} in client {m}'s model "
                    f"call, but the client holds {expected[m]} rows: size the plate from the data (e.g. X.shape[0]).")
            if sites is not None and [(s.name, s.shape) for s in client_sites.globals] != \
                    [(s.name, s.shape) for s in sites.globals]:
                raise ValueError(f"Client {m}'s data gives the model different global sites than client 0's: "
                                 f"{[(s.name, s.shape) for s in client_sites.globals]}.")
            sites = client_sites if sites is None else sites
            sizes.append(client_sites.plate_size)
        padded = pad_clients(clients, sizes, sites.plate)
        data = (padded.arrays, padded.mask, padded.sizes)
        # The closures hold the model and the argument layout only, never data: a remote client gets its own rows.
        model, layout = self.model, padded.layout
        if sites.has_local:  # the local sites' shapes as a padded client's model call sees them
            first_args, first_kwargs = layout.build([a[0] for a in padded.arrays])
            local = read_model(model, first_args, first_kwargs, read_key, relations=False, who="Client 0's padded data")
            sites = ModelSites(sites.plate, sites.plate_size, sites.globals, sites.likelihoods, sites.gaussian_prior,
                               local.locals, local.enumerated, sites.hyper)
        self._check_support(sites)

        def client_loglik(zeta: jax.Array, client: Client, hyper: Any = ()) -> jax.Array:
            c_args, c_kwargs = layout.build(client.arrays)
            return log_likelihood(model, sites, zeta, c_args, c_kwargs, client.mask, hyper)

        def client_local_model(zeta: jax.Array, client: Client, hyper: Any = ()) -> None:
            c_args, c_kwargs = layout.build(client.arrays)
            local_model(model, sites, zeta, c_args, c_kwargs, client.mask, hyper)

        def prior_logdensity(zeta: jax.Array, arrays: list, names: Any = None) -> jax.Array:
            c_args, c_kwargs = layout.build(arrays)
            return log_prior(model, sites, zeta, c_args, c_kwargs, names=names)

        problem = ClientProblem(self.family, sites.dim, client_loglik, padded.is_row, sites,
                                client_local_model if sites.has_local else None)
        prior, rest = exact_prior(self.family, sites)
        prior_factor = None
        if rest:
            first = [a[0] for a in padded.arrays]
            rest_mask = np.zeros(sites.dim, bool)
            for name in rest:
                rest_mask[sites.slices()[name]] = True
            prior_factor = PriorFactor(self.family, lambda z: prior_logdensity(z, first, rest), rest_mask)
        group_step, apply = self._group_step(problem, data)
        return _Setup(sites, data, problem, prior, prior_factor, group_step, apply,
                      self._prior_step(prior_factor), self._elbo(problem, prior_logdensity), self._hyper_step(sites))

    def _check_support(self, sites: ModelSites) -> None:
        """Refuse a model whose local latents or hyperparameters the local update cannot handle."""
        name = type(self.local_update).__name__
        if sites.has_local and not getattr(self.local_update, "supports_local_latents", False):
            names = [s.name for s in sites.locals] + list(sites.enumerated)
            raise NotImplementedError(f"{name} does not support local latent variables (sites {names} inside "
                                      f"partition plate '{sites.plate}'); use pvi.GradientUpdate.")
        if sites.hyper and not getattr(self.local_update, "supports_hyperparameters", False):
            raise NotImplementedError(f"{name} does not support hyperparameters (numpyro.param sites "
                                      f"{[h.name for h in sites.hyper]}); use pvi.GradientUpdate.")

    def _hyper_step(self, sites: ModelSites) -> Callable | None:
        """One step of ``hyper_optimizer`` up the summed clients' gradients (it minimises, so their negative)."""
        if not sites.hyper:
            return None
        optimizer = self.hyper_optimizer

        def hyper_step(state: PVIState, grad: Any) -> PVIState:
            updates, opt_state = optimizer.update(jax.tree.map(jnp.negative, grad), state.hyper_state, state.hyper)
            return state._replace(hyper=optax.apply_updates(state.hyper, updates), hyper_state=opt_state)

        return jax.jit(hyper_step)

    def _client_data(self, args: tuple, kwargs: dict, read_key: jax.Array) -> tuple[ClientData, list | None]:
        if isinstance(self.partitions, ClientData):
            if args or kwargs:
                raise TypeError("partitions=ClientData: each client holds its own data, so pass no data arguments "
                                "to init/update/run.")
            return self.partitions, None
        if not args and not kwargs:
            raise TypeError("Pass the pooled data to init/update/run (or give partitions=pvi.ClientData(...)).")
        pooled = read_model(self.model, args, kwargs, read_key, relations=False, who="The pooled data")
        partitions = [np.arange(pooled.plate_size)] if self.partitions is None else list(self.partitions)
        clients = pooled_to_client_data(args, kwargs, partitions, pooled.plate_size, pooled.plate)
        return clients, [len(p) for p in partitions]

    def _group_step(self, problem: ClientProblem, data: tuple) -> tuple[Callable, Callable]:
        """``group_step(state, ids, key, data, pulled, allow)`` runs clients ``ids`` and merges; ``apply`` merges.

        Both return ``(state, (free_energy, accepted, damping, clamped, hyper_grad))``.
        """
        run_clients = self.backend.prepare(self.local_update, problem, data)
        family, server = self.family, self.server

        def apply(state: PVIState, ids: jax.Array, result: ClientResult, allow: jax.Array) -> tuple:
            """Merge the clients' ``result`` (stacked over ``ids``) into the state."""
            finite = jnp.isfinite(result.free_energy) & allow
            for leaf in jax.tree.leaves(result.delta):
                finite &= jnp.all(jnp.isfinite(leaf.reshape(leaf.shape[0], -1)), axis=1)
            merged = merge(family, state.q, state.factors, ids, result.delta, finite, server.damping,
                           server.max_backtracks)
            accepted = finite & merged.valid
            client_states = jax.tree.map(
                lambda s, new: s.at[ids].set(jnp.where(accepted.reshape((-1,) + (1,) * (new.ndim - 1)), new, s[ids])),
                state.client_states, result.state)
            state = state._replace(q=merged.q, factors=merged.factors, client_states=client_states)
            damping = jnp.broadcast_to(merged.damping, ids.shape) * accepted
            clamped = jnp.broadcast_to(result.clamped, ids.shape)
            return state, (result.free_energy, accepted, damping, clamped, result.hyper_grad)

        apply = jax.jit(apply)

        def group_step(state: PVIState, ids: jax.Array, key: jax.Array, data: tuple, pulled: NatParams,
                       allow: jax.Array) -> tuple:
            """Clients ``ids`` update against ``pulled`` (their copy of q); the deltas merge into ``state.q``."""
            keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)
            cavities = jax.tree.map(lambda a, f: a[None] - f[ids], pulled, state.factors)
            local = jax.tree.map(lambda s: s[ids], state.client_states)
            return apply(state, ids, run_clients(ids, keys, cavities, pulled, local, data, state.hyper), allow)

        return (jax.jit(group_step) if self.backend.jit_group else group_step), apply

    def _prior_step(self, prior_factor: PriorFactor | None) -> Callable | None:
        """Damped natural-gradient step of ``t_0`` toward ``grad_mu E_q[log p_rest]``."""
        if prior_factor is None:
            return None
        family, server = self.family, self.server

        def prior_step(state: PVIState) -> PVIState:
            delta = prior_factor.target(state.q) - state.prior_factor

            def propose(rho: jax.Array) -> tuple:
                q_new = state.q + rho * delta
                return (q_new, state.prior_factor + rho * delta), is_valid_state(family, q_new, state.factors)

            (q, t0), _, valid = backtrack(propose, server.damping, server.max_backtracks)
            keep = lambda new, old: jnp.where(valid, new, old)  # noqa: E731
            return state._replace(q=jax.tree.map(keep, q, state.q),
                                  prior_factor=jax.tree.map(keep, t0, state.prior_factor))

        return jax.jit(prior_step)

    def _elbo(self, problem: ClientProblem, prior_logdensity: Callable) -> Callable:
        family, sites = self.family, problem.sites
        local_elbos = {}  # num_particles -> E_q[ELBO_m(theta)] of a client with local latents

        def local_elbo(num_particles: int) -> Callable:
            if num_particles not in local_elbos:
                elbo = TraceEnum_ELBO(num_particles) if sites.enumerated else Trace_ELBO(num_particles)
                local_elbos[num_particles] = expected_local_elbo(elbo, family, problem.local_model, sites)
            return local_elbos[num_particles]

        def elbo(q: NatParams, rng_key: jax.Array, data: tuple, num_particles: int, client_states: Any = (),
                 hyper: Any = ()) -> jax.Array:
            arrays, mask, sizes = data
            q_dist = family.to_dist(q)
            zeta_key, local_key = jax.random.split(rng_key)
            zeta = q_dist.sample(zeta_key, (num_particles,))
            first = [a[0] for a in arrays]
            logprior = jax.vmap(lambda z: prior_logdensity(z, first))(zeta)
            if problem.has_local:  # E_q[log p(y_m, z_m | theta) - log q_m(z_m)] with each client's local guides
                expected = local_elbo(num_particles)
                keys = jax.random.split(local_key, mask.shape[0])
                terms = jax.vmap(lambda k, a, m, s, st: expected(k, Client(a, m, s), q, st, hyper))(
                    keys, arrays, mask, sizes, client_states)
                return jnp.sum(terms) + jnp.mean(logprior) + q_dist.entropy()

            def client_loglik(arrays: list, mask: jax.Array, size: jax.Array) -> jax.Array:
                return jax.vmap(lambda z: problem.log_likelihood(z, Client(arrays, mask, size), hyper))(zeta)

            loglik = jnp.sum(jax.vmap(client_loglik)(arrays, mask, sizes), axis=0)
            return jnp.mean(loglik + logprior) + q_dist.entropy()

        return jax.jit(elbo, static_argnums=3)

    # ------------------------------------------------------------------ the SVI-like interface

    def init(self, rng_key: jax.Array, *args: Any, **kwargs: Any) -> PVIState:
        """Read the model, split the data over clients, and return the state with ``q`` = prior.

        :param rng_key: random key of the run.
        :param args, kwargs: the model's pooled data (none with ``partitions=ClientData``).
        """
        setup = self._setup(args, kwargs)
        num_clients = int(setup.data[1].shape[0])
        zeros = self.family.zeros(setup.sites.dim)
        factors = jax.tree.map(lambda z: jnp.zeros((num_clients,) + z.shape, z.dtype), zeros)
        t0 = zeros if setup.prior_factor is None else setup.prior_factor.initial(setup.prior)
        q = setup.prior + t0
        if not bool(self.family.is_valid(q)):
            raise ValueError("The prior of the global sites could not be approximated by a proper Gaussian in "
                             f"unconstrained space (sites: {[s.name for s in setup.sites.globals]}); PVI needs "
                             "proper priors.")
        local = self.local_update.init_state(setup.problem)
        client_states = jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients,) + jnp.shape(x)), local)
        # not weak-typed, so that the optimiser's first step does not change the state's types (a recompilation)
        hyper = {h.name: jnp.asarray(h.init, jnp.result_type(float)) for h in setup.sites.hyper} if setup.sites.hyper \
            else ()
        hyper_state = self.hyper_optimizer.init(hyper) if setup.sites.hyper else ()
        hyper_grads = jax.tree.map(lambda h: jnp.zeros((num_clients,) + h.shape, h.dtype), hyper)
        return PVIState(q, factors, t0, client_states, self.server.init(q, num_clients), rng_key, hyper, hyper_state,
                        hyper_grads)

    def update(self, state: PVIState, *args: Any, **kwargs: Any) -> tuple[PVIState, RoundInfo]:
        """One round: the prior factor's step (if any), then every client once in the server's schedule.

        :return: the new state and the round's :class:`RoundInfo`.
        """
        setup = self._setup(args, kwargs)
        start = time.perf_counter()
        round_key, elbo_key, next_key = jax.random.split(state.rng_key, 3)
        if setup.prior_step is not None:
            state = setup.prior_step(state)
        num_clients = int(setup.data[1].shape[0])
        if int(state.factors.eta1.shape[0]) != num_clients:
            raise ValueError(f"The state has {state.factors.eta1.shape[0]} clients but the data {num_clients}.")
        step = _RoundSteps(setup, self.backend, round_key, num_clients)
        state = self.server.run_round(state, step, num_clients)
        if setup.hyper_step is not None and step.hyper_grad:
            grads = state.hyper_grads
            for m, grad in step.hyper_grad.items():
                grads = jax.tree.map(lambda stack, g, m=m: stack.at[m].set(g), grads, grad)
            state = setup.hyper_step(state._replace(hyper_grads=grads), jax.tree.map(lambda g: g.sum(0), grads))
        elbo = float(setup.elbo(state.q, elbo_key, setup.data, self.num_elbo_particles, state.client_states,
                                state.hyper))
        info = RoundInfo(elbo, *step.record, time.perf_counter() - start)
        return state._replace(rng_key=next_key), info

    def run(self, rng_key: jax.Array, num_rounds: int, *args: Any, progress_bar: bool = True,
            init_state: PVIState | None = None, **kwargs: Any) -> PVIRunResult:
        """Run ``num_rounds`` rounds from ``init(rng_key, ...)`` (or ``init_state``) with a tqdm bar.

        :return: :class:`PVIRunResult` with the final state and the stacked per-round history.
        """
        state = self.init(rng_key, *args, **kwargs) if init_state is None else init_state
        infos = []
        with trange(num_rounds, disable=not progress_bar, desc="PVI") as rounds:
            for _ in rounds:
                state, info = self.update(state, *args, **kwargs)
                infos.append(info)
                rounds.set_postfix(elbo=f"{info.elbo:.4g}", rejected=int(info.num_rejected))
        history = RoundInfo(*(np.stack([np.asarray(x) for x in field]) for field in zip(*infos))) if infos else None
        return PVIRunResult(state, history, self)

    def add_client(self, state: PVIState, *args: Any, **kwargs: Any) -> PVIState:
        """Append a client that holds ``model(*args, **kwargs)``'s data to a running federated inference.

        Its factor starts at 1 (``q`` is unchanged); with :class:`~numpyro_pvi.Continual` the next
        round visits only it (continual learning: a new task or batch of data arrives).
        Only for ``partitions=ClientData``. The next round recompiles if the new client is larger.

        :return: the state extended by one client.
        """
        if not isinstance(self.partitions, ClientData):
            raise TypeError("add_client needs partitions=pvi.ClientData(...): with pooled data, pass the new rows "
                            "in the pooled arrays and new index partitions to a new PVI instead.")
        previous, self.partitions, self._cache = self.partitions, ClientData([*self.partitions, (args, kwargs)]), None
        try:
            setup = self._setup((), {})
        except Exception:
            self.partitions, self._cache = previous, None
            raise
        zeros = self.family.zeros(setup.sites.dim)
        local = self.local_update.init_state(setup.problem)
        if jax.tree.map(jnp.shape, local) != jax.tree.map(lambda x: jnp.shape(x)[1:], state.client_states):
            self.partitions, self._cache = previous, None
            raise NotImplementedError("add_client: the new client holds more local-latent rows than any client so "
                                      "far, which would change every client's local guide shapes; not supported.")
        append = lambda stack, new: jnp.concatenate([stack, jnp.asarray(new)[None]])  # noqa: E731
        return state._replace(factors=jax.tree.map(append, state.factors, zeros),
                              client_states=jax.tree.map(append, state.client_states, local),
                              hyper_grads=jax.tree.map(lambda g: append(g, jnp.zeros_like(g[0])), state.hyper_grads),
                              server_state=self.server.add_client(state.server_state, state.q))

    def evaluate(self, state: PVIState, *args: Any, num_particles: int | None = None, **kwargs: Any) -> jax.Array:
        """Monte Carlo estimate of the global ELBO ``E_q[log p(y, theta)] + H[q]`` (all clients' data)."""
        setup = self._setup(args, kwargs)
        return setup.elbo(state.q, state.rng_key, setup.data, num_particles or self.num_elbo_particles,
                          state.client_states, state.hyper)

    # ------------------------------------------------------------------ the posterior

    def sites(self, *args: Any, **kwargs: Any) -> ModelSites:
        """The model's sites as PVI reads them (global sites, flat layout)."""
        return self._setup(args, kwargs).sites

    def get_posterior(self, state: PVIState) -> dist.Distribution:
        """``q`` as a NumPyro distribution over the flat unconstrained vector ``zeta``."""
        return self.family.to_dist(state.q)

    def sample_posterior(self, rng_key: jax.Array, state: PVIState, num_samples: int,
                         client: int | None = None) -> dict:
        """Draw ``num_samples`` from ``q``: a dict site -> constrained samples ``(num_samples, *shape)``.

        :param client: also draw client ``client``'s local latent sites from its private guide (its
            own rows only); the hyperparameters are in :meth:`hyperparameters`.
        """
        sites = self._current_sites()
        zeta_key, local_key = jax.random.split(rng_key) if client is not None else (rng_key, None)
        zeta = self.get_posterior(state).sample(zeta_key, (num_samples,))
        samples = jax.vmap(sites.unflatten)(zeta)
        if client is not None:
            local, rows = self._client_local(state, client)
            samples.update(sample_local(sites, local_key, local, num_samples, rows))
        return samples

    def _client_local(self, state: PVIState, client: int) -> tuple[Any, int]:
        """Client ``client``'s local-update state and its number of real rows."""
        return jax.tree.map(lambda s: s[client], state.client_states), int(self._cache[1].data[2][client])

    def hyperparameters(self, state: PVIState) -> dict:
        """The learned hyperparameters (``numpyro.param`` sites), constrained: site -> value."""
        return dict(self._current_sites().hyper_values(state.hyper)) if state.hyper else {}

    def guide(self, state: PVIState, client: int | None = None) -> Callable:
        """A NumPyro guide drawing the global sites from ``q``, for ``Predictive(model, guide=...)``.

        Pass the learned hyperparameters to the model with ``Predictive(..., params=hyperparameters)``.
        With ``client``, the guide also draws that client's local latent sites from its private guide:
        call ``Predictive`` with the client's own data (its rows in the order it holds them).
        """
        sites, q_dist = self._current_sites(), self.get_posterior(state)
        local, rows = self._client_local(state, client) if client is not None and sites.locals else (None, None)

        def guide(*args: Any, **kwargs: Any) -> None:
            zeta = numpyro.sample("_pvi_latent", q_dist, infer={"is_auxiliary": True})
            for name, value in sites.unflatten(zeta).items():
                numpyro.sample(name, dist.Delta(value, event_dim=jnp.ndim(value)))
            for site in sites.locals if local is not None else ():
                numpyro.sample(site.name, local_distribution(site, *own_rows(site, local, rows)))

        return guide

    def _current_sites(self) -> ModelSites:
        if self._cache is None:
            raise RuntimeError("Call init/run first: PVI reads the model's sites from the data.")
        return self._cache[1].sites


class _RoundSteps:
    """What a server calls to run clients in one round, recording what each client did.

    ``step(state, ids, pulled=None, salt=0, allow=True) -> (state, accepted)`` runs clients ``ids``
    against ``pulled`` (default: the current q) and merges them. With a backend that runs clients
    concurrently (Ray), ``concurrent`` is true and ``start`` / ``wait`` / ``finish`` run one client
    in the background and merge it when it arrives.
    """

    def __init__(self, setup: _Setup, backend: Any, round_key: jax.Array, num_clients: int) -> None:
        self.setup, self.backend, self.round_key = setup, backend, round_key
        self.concurrent = hasattr(backend, "submit")
        self.free_energy, self.damping = np.full(num_clients, np.nan), np.zeros(num_clients)
        self.attempts, self.accepted, self.clamped = (np.zeros(num_clients, int) for _ in range(3))
        self.hyper_grad: dict = {}  # client -> its last accepted hyperparameter gradient this round

    @property
    def record(self) -> tuple:
        """``(free_energy, attempts, accepted, damping, clamped)`` for :class:`RoundInfo`."""
        return self.free_energy, self.attempts, self.accepted, self.damping, self.clamped

    def _key(self, salt: int) -> jax.Array:
        return self.round_key if salt == 0 else jax.random.fold_in(self.round_key, salt)

    def _note(self, ids: list, out: tuple) -> np.ndarray:
        f, a, d, c = (np.asarray(x) for x in out[:4])
        self.free_energy[ids], self.damping[ids] = f, d
        self.attempts[ids] += 1
        self.accepted[ids] += a
        self.clamped[ids] += c
        if out[4]:
            for i, m in enumerate(ids):
                if a[i]:
                    self.hyper_grad[int(m)] = jax.tree.map(lambda g, i=i: g[i], out[4])
        return a

    def __call__(self, state: PVIState, ids: list, pulled: NatParams | None = None, salt: int = 0,
                 allow: bool = True) -> tuple[PVIState, np.ndarray]:
        pulled = state.q if pulled is None else pulled
        state, out = self.setup.group_step(state, jnp.asarray(ids), self._key(salt), self.setup.data, pulled,
                                           jnp.asarray(allow))
        return state, self._note(ids, out)

    def start(self, state: PVIState, m: int, salt: int) -> tuple:
        """Start client ``m`` against the current q; returns a handle for :meth:`finish`."""
        key = jax.random.fold_in(self._key(salt), m)
        cavity = jax.tree.map(lambda a, f: a - f[m], state.q, state.factors)
        local = jax.tree.map(lambda s: s[m], state.client_states)
        return self.backend.submit(m, key, cavity, state.q, local, state.hyper), cavity, local, state.hyper

    def wait(self, handles: dict) -> int:
        """The client (a key of ``{client: handle}``) that finishes first."""
        return self.backend.wait_any({m: h[0] for m, h in handles.items()})

    def finish(self, state: PVIState, m: int, handle: tuple, allow: bool = True) -> tuple[PVIState, np.ndarray]:
        """Collect client ``m``'s update and merge it into the current q."""
        future, cavity, local, hyper = handle
        result = jax.tree.map(lambda x: jnp.asarray(x)[None], self.backend.result(m, future, cavity, local, hyper))
        state, out = self.setup.apply(state, jnp.asarray([m]), result, jnp.asarray(allow))
        return state, self._note([m], out)


class PVIRunResult(NamedTuple):
    """The result of :meth:`PVI.run`: final ``state``, per-round ``history`` (:class:`RoundInfo`) and ``inference``.

    **Example:** ``result = inference.run(key, 20, X, y=y)``; then ``result.sample_posterior(key, 1000)``,
    ``Predictive(model, guide=result.guide(), num_samples=500)``, ``result.to_arviz()``,
    ``result.history.elbo``.
    """

    state: PVIState
    history: RoundInfo | None
    inference: PVI

    def sample_posterior(self, rng_key: jax.Array, num_samples: int, client: int | None = None) -> dict:
        """Constrained samples of every global site from ``q``: site -> ``(num_samples, *shape)``.

        With ``client``, also that client's local latent sites (its rows only).
        """
        return self.inference.sample_posterior(rng_key, self.state, num_samples, client)

    def guide(self, client: int | None = None) -> Callable:
        """A guide for ``numpyro.infer.Predictive(model, guide=result.guide(), num_samples=...)``.

        With ``client``, it also draws that client's local latents (call ``Predictive`` with its data).
        """
        return self.inference.guide(self.state, client)

    @property
    def hyperparameters(self) -> dict:
        """The learned hyperparameters (``numpyro.param`` sites), constrained: site -> value."""
        return self.inference.hyperparameters(self.state)

    def get_posterior(self) -> dist.Distribution:
        """``q`` over the flat unconstrained vector."""
        return self.inference.get_posterior(self.state)

    def to_arviz(self, num_samples: int = 1000, rng_key: jax.Array | None = None, **kwargs: Any) -> Any:
        """The run as an ``arviz.InferenceData``: draws from ``q`` and the per-round history.

        See :func:`~numpyro_pvi.diagnostics.to_arviz` (``kwargs``: ``num_chains``, ``coords``, ``dims``).

        **Example:**

        .. doctest::

            >>> import optax, numpyro, numpyro.distributions as dist
            >>> from jax import random
            >>> import numpyro_pvi as pvi
            >>> def model(y=None):
            ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
            ...     with pvi.partition_plate("data", y.shape[0]):
            ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
            >>> y = 1.0 + random.normal(random.PRNGKey(0), (40,))
            >>> inference = pvi.PVI(model, pvi.MeanFieldGaussian(),
            ...                     partitions=pvi.split_iid(random.PRNGKey(1), 40, num_clients=4),
            ...                     local_update=pvi.GradientUpdate(optax.adam(0.05), num_steps=200),
            ...                     server=pvi.Sequential())
            >>> result = inference.run(random.PRNGKey(2), 2, y=y, progress_bar=False)
            >>> idata = result.to_arviz(num_samples=400)
            >>> idata.posterior["mu"].shape, idata.sample_stats["free_energy"].dims
            ((4, 100), ('round', 'client'))
        """
        from numpyro_pvi.diagnostics import to_arviz

        return to_arviz(self, num_samples, rng_key, **kwargs)
