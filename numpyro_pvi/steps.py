"""The compiled steps of a round: run a group of clients and merge, merge, the prior factor, the ELBO.

:func:`compile_steps` builds them from the configuration of :class:`~numpyro_pvi.PVI` and the data's
*structure* (the model's sites and the arguments' layout); the clients' data are arguments, never closed
over, so one set of steps serves every data set of the same shapes and dtypes without recompiling.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from numpyro.infer import Trace_ELBO, TraceEnum_ELBO

from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.damping import current as current_damping
from numpyro_pvi.densities import log_prior
from numpyro_pvi.families import NatParams
from numpyro_pvi.local_latents import expected_local_elbo
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult, CountsRejectedUpdates
from numpyro_pvi.merge import is_valid_state, merge
from numpyro_pvi.partition import ArgsLayout
from numpyro_pvi.prior import PriorFactor
from numpyro_pvi.state import ClientOutcome, PVIState, Rejection


class Steps(NamedTuple):
    """The jitted functions of a problem (see the module docstring).

    :ivar group_step: ``(state, ids, key, clients, pulled, allow) -> (state, ClientOutcome)``: clients ``ids``
        update against ``pulled`` (their copy of ``q``) and their deltas merge into ``state.q``.
    :ivar apply: ``(state, ids, result, allow) -> (state, ClientOutcome)``: merge the clients' results.
    :ivar runner: the backend's ``run(ids, keys, cavities, q, states, clients, hyper) -> ClientResult``.
    :ivar prior_init: ``(prior, clients) -> t_0`` fitted to the prior alone, or ``None`` (Gaussian prior).
    :ivar prior_step: ``(state, clients) -> state``, the damped step of ``t_0``, or ``None``.
    :ivar elbo: ``(q, key, clients, num_particles, client_states, hyper) -> ELBO`` (``num_particles`` static).
    :ivar hyper_step: ``(state, grad) -> state``, one step of the hyperparameters, or ``None``.
    """

    group_step: Callable
    apply: Callable
    runner: Callable
    prior_init: Callable | None
    prior_step: Callable | None
    elbo: Callable
    hyper_step: Callable | None


def compile_steps(inference: Any, problem: ClientProblem, layout: ArgsLayout, rest: tuple) -> Steps:
    """The steps for ``inference``'s configuration on data of this structure.

    :param rest: the global sites whose prior is not Gaussian in unconstrained space (fitted by ``t_0``).
    """
    runner = inference.backend.prepare(inference.local_update, problem)
    apply = jax.jit(_apply_fn(inference.family, inference.server, inference.local_update))

    def group_step(state: PVIState, ids: jax.Array, key: jax.Array, clients: Client, pulled: NatParams,
                   allow: jax.Array) -> tuple[PVIState, ClientOutcome]:
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)
        cavities = jax.tree.map(lambda a, f: a[None] - f[ids], pulled, state.factors)
        local = jax.tree.map(lambda s: s[ids], state.client_states)
        return apply(state, ids, runner(ids, keys, cavities, pulled, local, clients, state.hyper), allow)

    prior_logdensity = _prior_logdensity(inference.model, problem.sites, layout)
    prior_init, prior_step = _prior_steps(inference, problem, prior_logdensity, rest)
    return Steps(jax.jit(group_step) if inference.backend.jit_group else group_step, apply, runner,
                 prior_init, prior_step, _elbo_fn(inference.family, problem, prior_logdensity),
                 _hyper_step(inference.hyper_optimizer) if problem.has_hyper else None)


def _apply_fn(family: Any, server: Any, local_update: Any) -> Callable:
    def apply(state: PVIState, ids: jax.Array, result: ClientResult, allow: jax.Array) -> tuple:
        """Merge the clients' ``result`` (stacked over ``ids``) into the state."""
        finite, moved = jnp.isfinite(result.free_energy), jnp.zeros(ids.shape, bool)
        for leaf in jax.tree.leaves(result.delta):
            finite &= jnp.all(jnp.isfinite(leaf.reshape(leaf.shape[0], -1)), axis=1)
            moved |= jnp.any(leaf.reshape(leaf.shape[0], -1) != 0, axis=1)
        merged = merge(family, state.q, state.factors, ids, result.delta, finite & allow,
                       current_damping(server.damping, state.damping), server.max_backtracks)
        accepted = finite & allow & merged.valid
        failure = jnp.broadcast_to(result.failure, ids.shape)
        # a client that sent nothing (timed out, raised, out of budget) says so before staleness does
        rejection = jnp.select([failure > 0, ~allow, ~finite, ~merged.valid],
                               [failure, Rejection.STALE, Rejection.NON_FINITE, Rejection.INVALID], Rejection.NONE)
        kept = _kept_states(local_update, jax.tree.map(lambda s: s[ids], state.client_states), result.state,
                            accepted, failure == 0)
        client_states = jax.tree.map(lambda s, new: s.at[ids].set(new), state.client_states, kept)
        state = state._replace(q=merged.q, factors=merged.factors, client_states=client_states)
        damping = jnp.broadcast_to(merged.damping, ids.shape) * accepted
        clamped = jnp.broadcast_to(result.clamped, ids.shape)
        return state, ClientOutcome(result.free_energy, accepted, damping, clamped, result.hyper_grad, rejection,
                                    moved & accepted)

    return apply


def _kept_states(local_update: Any, old: Any, new: Any, accepted: jax.Array, sent: jax.Array) -> Any:
    """The clients' states after a merge: the new state if merged, else the old one (or, for an update that
    counts rejected updates, its ``rejected_state`` when the client did send one)."""
    def choose(mask: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)

    if isinstance(local_update, CountsRejectedUpdates):
        rejected = jax.vmap(local_update.rejected_state)(old, new)
        old = jax.tree.map(lambda r, o: choose(sent, r, o), rejected, old)
    return jax.tree.map(lambda n, o: choose(accepted, n, o), new, old)


def _prior_logdensity(model: Callable, sites: Any, layout: ArgsLayout) -> Callable:
    def prior_logdensity(zeta: jax.Array, clients: Client, names: Any = None) -> jax.Array:
        """The prior's log density in ``zeta``, from client 0's model call (the prior is the same in every call)."""
        c_args, c_kwargs = layout.build([a[0] for a in clients.arrays])
        return log_prior(model, sites, zeta, c_args, c_kwargs, names=names)

    return prior_logdensity


def _prior_steps(inference: Any, problem: ClientProblem, prior_logdensity: Callable, rest: tuple) -> tuple:
    """``(prior_init, prior_step)`` for the prior factor ``t_0`` of the sites ``rest``, or ``(None, None)``."""
    if not rest:
        return None, None
    family, server, slices = inference.family, inference.server, problem.sites.slices()
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
            return (q_new, state.prior_factor + rho * delta), is_valid_state(family, q_new, state.factors)

        out = backtrack(propose, current_damping(server.damping, state.damping), server.max_backtracks)
        keep = lambda new, old: jnp.where(out.valid, new, old)  # noqa: E731
        q, t0 = out.value
        return state._replace(q=jax.tree.map(keep, q, state.q), prior_factor=jax.tree.map(keep, t0, state.prior_factor))

    return jax.jit(prior_init), jax.jit(prior_step)


def _elbo_fn(family: Any, problem: ClientProblem, prior_logdensity: Callable) -> Callable:
    sites = problem.sites

    def elbo(q: NatParams, rng_key: jax.Array, clients: Client, num_particles: int, client_states: Any = (),
             hyper: Any = ()) -> jax.Array:
        """``E_q[log p(y, theta)] + H[q]`` over every client's data (empty client slots count 0)."""
        q_dist = family.to_dist(q)
        zeta_key, local_key = jax.random.split(rng_key)
        zeta = q_dist.sample(zeta_key, (num_particles,))
        logprior = jax.vmap(lambda z: prior_logdensity(z, clients))(zeta)
        if problem.has_local:  # E_q[log p(y_m, z_m | theta) - log q_m(z_m)] with each client's local guides
            ensemble = TraceEnum_ELBO(num_particles) if sites.enumerated else Trace_ELBO(num_particles)
            expected = expected_local_elbo(ensemble, family, problem.local_model, sites)
            keys = jax.random.split(local_key, clients.mask.shape[0])
            terms = jax.vmap(lambda k, c, st: expected(k, c, q, st, hyper))(keys, clients, client_states)
            return jnp.sum(terms) + jnp.mean(logprior) + q_dist.entropy()

        def client_loglik(client: Client) -> jax.Array:
            return jax.vmap(lambda z: problem.log_likelihood(z, client, hyper))(zeta)

        loglik = jnp.sum(jax.vmap(client_loglik)(clients), axis=0)
        return jnp.mean(loglik + logprior) + q_dist.entropy()

    return jax.jit(elbo, static_argnums=3)


def _hyper_step(optimizer: Any) -> Callable:
    def hyper_step(state: PVIState, grad: Any) -> PVIState:
        """One step of ``hyper_optimizer`` up the summed clients' gradients (it minimises, so their negative)."""
        updates, opt_state = optimizer.update(jax.tree.map(jnp.negative, grad), state.hyper_state, state.hyper)
        return state._replace(hyper=optax.apply_updates(state.hyper, updates), hyper_state=opt_state)

    return jax.jit(hyper_step)
