"""The compiled steps of a round: run a group of clients and merge, merge, the prior factor, the
ELBO.

:func:`compile_steps` builds them from the configuration
(:class:`~numpyro_pvi.config.PVIConfig`) and the data's *structure* (the model's sites and the
arguments' layout); the clients' data are arguments, never closed over, so one set of steps serves
every data set of the same shapes and dtypes without recompiling.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.compilation import several_buckets_compiler_options, unroll_threefry_on_cpu
from numpyro_pvi.config import PVIConfig
from numpyro_pvi.families import NatParams
from numpyro_pvi.local_updates.base import (
    Client,
    ClientProblem,
    ClientResult,
    CountsRejectedUpdates,
)
from numpyro_pvi.model.densities import log_prior
from numpyro_pvi.model.partition import ArgsLayout
from numpyro_pvi.model.prior import PriorFactor
from numpyro_pvi.server.elbo import client_elbo_term, prior_elbo_term
from numpyro_pvi.server.merge import (
    cavities,
    is_valid_state,
    merge,
    rejection_codes,
    screen,
)
from numpyro_pvi.state import ClientOutcome, PVIState


class Group(NamedTuple):
    """Clients of one bucket that run together: ``local`` rows of the bucket's stacked ``clients``,
    whose ids (state slots) are ``ids``; ``allow`` says which may be merged (padding and stale
    updates may not), ``real`` which ran for this round (the others pad the group to a compiled
    size)."""

    clients: Client
    local: jax.Array
    ids: jax.Array
    allow: jax.Array
    real: jax.Array


class Steps(NamedTuple):
    """The jitted functions of a problem (see the module docstring).

    :ivar group_step: ``(state, groups, key, pulled) -> (state, ClientOutcome)``: the clients of
        ``groups`` (one
        :class:`Group` per bucket) update against ``pulled`` (their copy of ``q``) and their deltas
        merge into ``state.q`` together; the outcome is stacked over the groups' clients in order,
        with each client's term of the ELBO of ``pulled`` and the prior's
        (``ClientOutcome.elbo_term``, ``prior_term``) when the server's rounds send every client
        the same ``q`` (``Server.synchronous_rounds``), else ``None``. Compiled, it consumes
        ``state.factors`` (donated: the new factors reuse their memory).
    :ivar apply: ``(state, ids, result, allow) -> (state, ClientOutcome)``: merge the clients'
        results.
    :ivar runner: the backend's ``run(ids, keys, cavities, q, states, clients, hyper) ->
        ClientResult``.
    :ivar prior_init: ``(prior, clients) -> t_0`` fitted to the prior alone, or ``None`` (Gaussian
        prior).
    :ivar prior_step: ``(state, clients) -> state``, the damped step of ``t_0``, or ``None``.
    :ivar elbo: ``(q, key, clients, num_particles, client_states, hyper, scale=1.0) -> ELBO``
        (``num_particles`` static): the pooled pass over every client's data, the sum of the
        terms :mod:`~numpyro_pvi.server.elbo` computes (:meth:`PVI.evaluate
        <numpyro_pvi.PVI.evaluate>`, and rounds whose clients were not all sent the same ``q``).
    :ivar hyper_step: ``(state, grad) -> state``, one step of the hyperparameters, or ``None``.
    """

    group_step: Callable
    apply: Callable
    runner: Callable
    prior_init: Callable | None
    prior_step: Callable | None
    elbo: Callable
    hyper_step: Callable | None


def compile_steps(
    config: PVIConfig, problem: ClientProblem, layout: ArgsLayout, rest: tuple
) -> Steps:
    """The steps for the configuration ``config`` on data of this structure.

    :param rest: the global sites whose prior is not Gaussian in unconstrained space (fitted by
        ``t_0``).
    """
    # XLA compiles JAX's default CPU Threefry (a loop per hash) 2.4x slower, into slower kernels
    unroll_threefry_on_cpu()
    runner = config.backend.prepare(config.local_update, problem)
    # the family laid out for these sites (config.family is the user's, unlaid)
    family = problem.family
    apply = jax.jit(make_apply(family, config.server, config.local_update))
    prior_logdensity = make_prior_logdensity(config.model, problem.sites, layout)
    elbo_terms, prior_term = _elbo_terms_fn(config, problem, prior_logdensity)

    def run_group(state: PVIState, group: Group, key: jax.Array, pulled: NatParams) -> tuple:
        """One bucket's clients in one vmapped call, whether each one's cavity was valid, and
        their terms of the ELBO of ``pulled`` (``None`` if not recorded)."""
        ids = group.ids
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)
        cavity, cavity_ok = cavities(family, pulled, state.factors, ids)
        local = jax.tree.map(lambda s: s[ids], state.client_states)
        result = runner(group.local, keys, cavity, pulled, local, group.clients, state.hyper)
        if elbo_terms is None:
            return result, cavity_ok, None
        return result, cavity_ok, elbo_terms(pulled, group, local, state.hyper)

    def merge_groups(
        state: PVIState, groups: tuple, outs: list, pulled: NatParams
    ) -> tuple[PVIState, ClientOutcome]:
        joined = lambda *xs: jnp.concatenate(xs) if len(xs) > 1 else xs[0]  # noqa: E731
        ids, allow, real = (
            joined(*(getattr(g, name) for g in groups)) for name in ("ids", "allow", "real")
        )
        results, cavity_ok, terms = zip(*outs)
        # every group was sent the same q: the prior's term once a round, here (not in every
        # bucket's program), on the first group's data
        elbo = None if terms[0] is None else (joined(*terms), prior_term(pulled, groups[0].clients))
        return apply(
            state, ids, jax.tree.map(joined, *results), allow, joined(*cavity_ok), real, elbo
        )

    def group_step(
        state: PVIState, groups: tuple, key: jax.Array, pulled: NatParams
    ) -> tuple[PVIState, ClientOutcome]:
        outs = [run_group(state, g, key, pulled) for g in groups]
        return merge_groups(state, groups, outs, pulled)

    if not config.backend.jit_group:
        return _steps(config, problem, prior_logdensity, rest, group_step, apply, runner)
    return _steps(
        config,
        problem,
        prior_logdensity,
        rest,
        _compiled_group_step(group_step, run_group, merge_groups),
        apply,
        runner,
    )


def _compiled_group_step(
    group_step: Callable, run_group: Callable, merge_groups: Callable
) -> Callable:
    """``group_step`` compiled: one call where the round runs one group, or whole buckets (every
    client slot of each group's bucket: a synchronous round over all clients); for the groups of a
    sampled round, one call per bucket (each bucket compiled once whichever buckets a sampled round
    touches, in a few padded sizes), then the merge of their results, concatenations included
    (eager concatenations compile one small executable per leaf shape).

    A full round over several buckets in one program compiles once instead of one program per
    bucket and the merge's (a Dirichlet(0.3) split of 1,000 clients, two buckets: round 1 ends
    0.3-0.6 s sooner, ``benchmarks/startup.py``), and runs its rounds as fast, with XLA's CPU
    scheduler told to run the buckets' updates one after the other
    (:func:`~numpyro_pvi.compilation.several_buckets_compiler_options`).

    The factors are donated: the merge writes the merged clients' rows into the memory of
    ``state.factors`` instead of a copy of all ``M`` of them (at a million clients the copy was
    most of a round), so the caller's ``state.factors`` is consumed
    (:class:`~numpyro_pvi.server.round.Round` passes factors no one else holds).
    """

    def in_place(step: Callable, **options: Any) -> Callable:
        def on(factors: NatParams, state: PVIState, *args: Any) -> tuple:
            return step(state._replace(factors=factors), *args)

        on.__name__ = step.__name__  # the compilations' names: jit(group_step), jit(merge_groups)
        return jax.jit(on, donate_argnums=0, **options)

    fused, run_one, merge_all = in_place(group_step), jax.jit(run_group), in_place(merge_groups)
    # whole buckets in one program: their updates one after the other, each using every core
    fused_buckets = in_place(group_step, compiler_options=several_buckets_compiler_options())

    def compiled(
        state: PVIState, groups: tuple, key: jax.Array, pulled: NatParams
    ) -> tuple[PVIState, ClientOutcome]:
        rest = state._replace(factors=None)
        if len(groups) == 1:
            return fused(state.factors, rest, groups, key, pulled)
        if all(map(whole_bucket, groups)):
            return fused_buckets(state.factors, rest, groups, key, pulled)
        outs = [run_one(state, g, key, pulled) for g in groups]
        return merge_all(state.factors, rest, groups, outs, pulled)

    return compiled


def whole_bucket(group: Group) -> bool:
    """Whether ``group`` runs every client slot of its bucket (a full round's group), not a sample
    of them padded to a compiled size.

    **Example:** in a synchronous round over all clients, ``whole_bucket(g)`` is true for each of
    the round's groups ``g``.
    """
    return group.local.shape[0] == group.clients.mask.shape[0]


def _steps(
    config: PVIConfig,
    problem: ClientProblem,
    prior_logdensity: Callable,
    rest: tuple,
    group_step: Callable,
    apply: Callable,
    runner: Callable,
) -> Steps:
    """The :class:`Steps` around ``group_step``: the prior factor's steps, the ELBO and the
    hyperparameters' step."""
    prior_init, prior_step = _prior_steps(config, problem, prior_logdensity, rest)
    elbo = _elbo_fn(problem.family, problem, prior_logdensity)
    return Steps(
        group_step,
        apply,
        runner,
        prior_init,
        prior_step,
        elbo,
        make_hyper_step(config.hyper_optimizer) if problem.has_hyper else None,
    )


def make_apply(family: Any, server: Any, local_update: Any) -> Callable:
    def apply(
        state: PVIState,
        ids: jax.Array,
        result: ClientResult,
        allow: jax.Array,
        cavity_ok: jax.Array | None = None,
        real: jax.Array | None = None,
        elbo: tuple | None = None,
    ) -> tuple:
        """Merge the clients' ``result`` (stacked over ``ids``) into the state; ``cavity_ok`` says
        whose cavity was valid when they started (default: all), the others' updates are rejected as
        ``INVALID``; ``real`` which entries ran for this round (default: all; the others pad the
        group and never write); ``elbo`` the clients' terms of the ELBO of the ``q`` they were sent
        and the prior's (default ``None``: not recorded)."""
        cavity_ok = jnp.ones(ids.shape, bool) if cavity_ok is None else cavity_ok
        real = jnp.ones(ids.shape, bool) if real is None else real
        finite, moved = screen(result.delta, result.free_energy)
        merged = merge(
            family,
            state.q,
            state.factors,
            ids,
            result.delta,
            finite & allow & cavity_ok,
            server.damping.rho(state.damping),
            server.max_backtracks,
        )
        accepted = finite & allow & cavity_ok & merged.valid
        failure = jnp.broadcast_to(result.failure, ids.shape)
        rejection = rejection_codes(failure, finite, merged.valid, allow, cavity_ok)
        kept, write = _kept_states(
            local_update,
            jax.tree.map(lambda s: s[ids], state.client_states),
            result.state,
            accepted,
            real & (failure == 0),
        )
        # other entries (and padding) write nowhere
        slots = jnp.where(write, ids, state.factors.eta1.shape[0])
        client_states = jax.tree.map(
            lambda s, new: s.at[slots].set(new, mode="drop"), state.client_states, kept
        )
        state = state._replace(q=merged.q, factors=merged.factors, client_states=client_states)
        damping = jnp.broadcast_to(merged.damping, ids.shape) * accepted
        clamped = jnp.broadcast_to(result.clamped, ids.shape)
        inflation = jnp.broadcast_to(
            jnp.asarray(result.inflation, jnp.result_type(float)), ids.shape
        )
        return state, ClientOutcome(
            result.free_energy,
            accepted,
            damping,
            clamped,
            result.hyper_grad,
            rejection,
            moved & accepted,
            inflation,
            None if elbo is None else elbo[0],
            None if elbo is None else jnp.broadcast_to(elbo[1], ids.shape),
        )

    return apply


def _kept_states(
    local_update: Any, old: Any, new: Any, accepted: jax.Array, sent: jax.Array
) -> tuple[Any, jax.Array]:
    """The clients' states to write after a merge, and which to write: the new state of a merged
    update; for an update that counts rejected updates, its ``rejected_state`` for one the client
    sent but the server rejected."""
    if not isinstance(local_update, CountsRejectedUpdates):
        return new, accepted
    rejected = jax.vmap(local_update.rejected_state)(old, new)
    choose = lambda a, b: jnp.where(accepted.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
    return jax.tree.map(choose, new, rejected), accepted | sent


def make_prior_logdensity(model: Callable, sites: Any, layout: ArgsLayout) -> Callable:
    """``(zeta, clients, names=None) -> log p(theta(zeta))`` (with the Jacobian) from the model's
    call on the first client's data: what the prior factor's steps and the ELBO's prior term read.

    **Example:** ``make_prior_logdensity(model, problem.sites, problem.split.layout)(zeta,
    clients)``
    """

    def prior_logdensity(zeta: jax.Array, clients: Client | tuple, names: Any = None) -> jax.Array:
        """The prior's log density in ``zeta``, from the first client's model call (the prior is the
        same in every call); ``clients`` is a stacked :class:`Client` or a tuple of them (one per
        bucket)."""
        first = clients if isinstance(clients, Client) else clients[0]
        c_args, c_kwargs = layout.build([a[0] for a in first.arrays])
        return log_prior(model, sites, zeta, c_args, c_kwargs, names=names)

    return prior_logdensity


def _prior_steps(
    config: PVIConfig, problem: ClientProblem, prior_logdensity: Callable, rest: tuple
) -> tuple:
    """``(prior_init, prior_step)`` for the prior factor ``t_0`` of the sites ``rest``, or ``(None,
    None)``."""
    if not rest:
        return None, None
    family, server, slices = problem.family, config.server, problem.sites.slices()
    rest_mask = np.zeros(problem.dim, bool)
    for name in rest:
        rest_mask[slices[name]] = True

    def prior_factor(clients: Client) -> PriorFactor:
        return PriorFactor(family, lambda z: prior_logdensity(z, clients, rest), rest_mask)

    def prior_init(prior: NatParams, clients: Client) -> NatParams:
        return prior_factor(clients).initial(prior)

    def prior_step(state: PVIState, clients: Client) -> PVIState:
        """Damped natural-gradient step of ``t_0`` toward ``grad_mu E_q[log p_rest]``."""
        delta = prior_factor(clients).target(state.q) - state.prior_factor

        def propose(rho: jax.Array) -> tuple:
            q_new = state.q + rho * delta
            return (q_new, state.prior_factor + rho * delta), is_valid_state(
                family, q_new, state.factors
            )

        out = backtrack(propose, server.damping.rho(state.damping), server.max_backtracks)
        keep = lambda new, old: jnp.where(out.valid, new, old)  # noqa: E731
        q, t0 = out.value
        return state._replace(
            q=jax.tree.map(keep, q, state.q),
            prior_factor=jax.tree.map(keep, t0, state.prior_factor),
        )

    return jax.jit(prior_init), jax.jit(prior_step)


def _elbo_terms_fn(config: PVIConfig, problem: ClientProblem, prior_logdensity: Callable) -> tuple:
    """``(elbo_terms, prior_term)``: ``(pulled, group, states, hyper) -> terms``, the ELBO terms of
    a group's clients under the ``q`` they were sent (:mod:`~numpyro_pvi.server.elbo`), computed
    with their update, and ``(pulled, clients) -> prior's term``; ``(None, None)`` when the
    server's rounds do not send every client the same ``q`` (the round's ELBO is then a pooled
    pass, and nothing is compiled for it here)."""
    if not config.server.synchronous_rounds:
        return None, None
    family, num_particles = problem.family, config.num_elbo_particles
    term = client_elbo_term(problem, num_particles)

    def elbo_terms(pulled: NatParams, group: Group, states: Any, hyper: Any) -> jax.Array:
        rows = jax.tree.map(lambda a: a[group.local], group.clients)
        return jax.vmap(lambda i, c, s: term(pulled, i, c, s, hyper))(group.ids, rows, states)

    def prior_term(pulled: NatParams, clients: Client) -> jax.Array:
        prior = lambda z: prior_logdensity(z, clients)  # noqa: E731
        return prior_elbo_term(family, pulled, prior, num_particles)

    return jax.jit(elbo_terms), jax.jit(prior_term)


def _elbo_fn(family: Any, problem: ClientProblem, prior_logdensity: Callable) -> Callable:
    def elbo(
        q: NatParams,
        rng_key: jax.Array,
        clients: Client | tuple,
        num_particles: int,
        client_states: Any = (),
        hyper: Any = (),
        scale: float = 1.0,
    ) -> jax.Array:
        """``E_q[log p(y, theta)] + H[q]`` over every client's data (empty client slots count 0):
        the clients' terms and the prior's of :mod:`~numpyro_pvi.server.elbo`, summed (the clients'
        sum times ``scale``: a sample of the clients, :meth:`Problem.elbo_sample`);
        ``clients`` is a stacked :class:`Client` or a tuple of them (one per bucket; local latent
        sites need a single one, whose rows are the client slots)."""
        buckets = (clients,) if isinstance(clients, Client) else tuple(clients)
        term = client_elbo_term(problem, num_particles)
        if problem.has_local:
            ids = jnp.arange(buckets[0].mask.shape[0])
            terms = jax.vmap(lambda i, c, s: term(q, i, c, s, hyper, rng_key))(
                ids, buckets[0], client_states
            )
            total = jnp.sum(terms)
        else:
            total = sum(
                jnp.sum(jax.vmap(lambda c: term(q, 0, c, (), hyper, rng_key))(bucket))
                for bucket in buckets
            )
        prior = lambda z: prior_logdensity(z, clients)  # noqa: E731
        return scale * total + prior_elbo_term(family, q, prior, num_particles, rng_key)

    return jax.jit(elbo, static_argnums=3)


def make_hyper_step(optimizer: Any) -> Callable:
    def hyper_step(state: PVIState, grad: Any) -> PVIState:
        """One step of ``hyper_optimizer`` up the summed clients' gradients (it minimises, so their
        negative)."""
        updates, opt_state = optimizer.update(
            jax.tree.map(jnp.negative, grad), state.hyper_state, state.hyper
        )
        return state._replace(
            hyper=optax.apply_updates(state.hyper, updates), hyper_state=opt_state
        )

    return jax.jit(hyper_step)
