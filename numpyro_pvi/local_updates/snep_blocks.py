"""SNEP in the mean parameters of an exponential family: :class:`~numpyro_pvi.SNEPUpdate`'s path for
the families that are not one Gaussian (:class:`~numpyro_pvi.SiteFamilies`, ``Gamma``, ``Beta``,
``Dirichlet``).

The same double loop as the Gaussian path (:mod:`numpyro_pvi.local_updates.snep_inner`), written
with the family's sufficient statistics ``T`` and mean parameters ``m = E_q[T]``
(:class:`~numpyro_pvi.families.MeanParamFamily`), block by block. Each inner step moves
``num_chains`` persistent NUTS chains by one transition that leaves the tilted distribution

``p_m(theta) ∝ exp(tau . T(theta)) p(y_m | theta)^alpha``,  ``tau = theta' - alpha (q - cavity)``

invariant, then takes the mirror step ``m <- (1 - eps) m + eps E_hat[T]`` and maps ``m`` back to
natural parameters (:meth:`~numpyro_pvi.families.MeanParamFamily.from_mean_params`: closed form for
a Gaussian block, Newton for an exponential-family block). Every ``refresh_every`` steps
``theta'`` is refreshed to ``q``; the visit returns the Polyak-Ruppert average of ``m`` over its
last ``average_fraction`` of steps. For ``alpha = 1`` the step is zero exactly when the tilted
distribution's ``E[T]`` is ``q``'s: EP's fixed point, block by block.

What differs from the Gaussian path:

* **Control variates**: ``E_hat[T]`` is the chains' average of ``T - C phi(u)``, with Stein's
  zero-mean features ``phi = (g, I + u g^T)`` of the tilted distribution's score ``g`` in chain
  coordinates (NUTS gives it) and ``C`` the regression coefficients of ``T`` on ``phi`` under the
  ``q`` at the start of the visit (:func:`stein_coefficients`, from draws of ``q``). Unbiased for
  any ``C``; exact where ``T`` is in the features' span under ``q`` (a Gaussian block, a Gamma),
  close to it near the fixed point otherwise. Where the estimate leaves the family's mean domain (it
  may, unlike a plain average) the step uses the chains' plain average of ``T``;
  ``control_variates=False`` always does.
* **Chain coordinates**: the chains run in the family's unconstrained, standardised coordinates
  ``u`` (:meth:`~numpyro_pvi.families.MeanParamFamily.from_chain`; a Dirichlet has one coordinate
  fewer per simplex), with the log Jacobian in the potential. ``u`` is standardised by the ``q`` at
  the start of the visit; at its end the chains are re-expressed in the coordinates of the new
  ``q``, which the next visit keeps (the paper's eq. 28: a chain moves with ``q``'s change between
  visits).
* **First visit**: starts after ``num_newton`` natural-gradient (CVI) steps from ``q``
  (:func:`natural_gradient_start`, instead of a Laplace approximation), with chains drawn from
  ``N(0, I)`` in ``u``.

A step whose mean parameters do not map back to a valid ``q`` (:func:`matches`) with either estimate
keeps the previous iterate and is counted in ``RoundInfo.clamped``; a visit whose result is not
valid or not finite keeps the old factor.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from numpyro_pvi.families import MeanParamFamily, NatParams
from numpyro_pvi.families.gaussian import tilted_inflation
from numpyro_pvi.local_updates._numerics import (
    adapted_log_step,
    matches,
    nuts_kernel,
    stein_coefficients,
    stein_features,
    where_tree,
)
from numpyro_pvi.local_updates._snep_settings import SNEPSettings
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult, local_free_energy


class SNEPBlockState(NamedTuple):
    """A client's persistent state on this path: chains ``(C, K)`` in the standardised chain
    coordinates (``K``:
    :meth:`~numpyro_pvi.families.MeanParamFamily.chain_dim`), the sampler's log step size, inner
        steps so far."""

    chains: jax.Array
    log_step_size: jax.Array
    count: jax.Array
    visited: jax.Array


class BlockVisit(NamedTuple):
    """What every inner step of one visit shares: the family, the cavity, the chains' frame (from
    the ``q`` at the start of the visit), ``theta -> log p(y_m | theta)``, the client's inner steps
    before the visit and the control variates' coefficients ``(P, K + K^2)``
    (:func:`stein_coefficients`; zeros without control variates)."""

    family: MeanParamFamily
    cavity: NatParams
    frame: Any
    loglik: Callable
    count: jax.Array
    coef: jax.Array


class BlockCarry(NamedTuple):
    """The inner loop's carry.

    :ivar mean: the local ``q``'s mean parameters ``E_q[T]``.
    :ivar nat: the local ``q`` (natural parameters of ``mean``).
    :ivar theta_aux: the auxiliary ``theta'`` (``q`` when last refreshed).
    :ivar chains: the chains ``(C, K)`` in chain coordinates.
    :ivar log_step: the log of NUTS's step size.
    :ivar weight: how many iterates the Polyak-Ruppert average holds.
    :ivar sum_mean: the sum of their mean parameters.
    :ivar clamped: the steps whose control-variate estimate did not map back to a valid ``q`` (the
        plain average used instead, or the previous iterate kept if it did not either).

    **Example:** at EP's fixed point (``q`` is the tilted distribution, here a Gamma) the control
    variates are nearly exact, so the inner steps leave ``q`` where it is.

    .. doctest::

        >>> import jax, jax.numpy as jnp, numpyro_pvi as pvi
        >>> from numpyro_pvi.local_updates.snep_blocks import (
        ...     SNEPBlockState,
        ...     run_blocks,
        ...     start_visit,
        ... )
        >>> family = pvi.Gamma()
        >>> cavity = family.from_params(jnp.array([2.0]), jnp.array([1.0]))
        >>> loglik = lambda theta: jnp.sum(
        ...     10.0 * jnp.log(theta) - 4.0 * theta
        ... )  # the tilted: Gamma(12, 5)
        >>> q = family.from_params(jnp.array([12.0]), jnp.array([5.0]))
        >>> settings = pvi.SNEPUpdate(num_steps=20, num_chains=4, max_tree_depth=3).settings
        >>> state = SNEPBlockState(
        ...     jnp.zeros((4, 1)), jnp.log(0.5), jnp.zeros((), jnp.int32), jnp.ones((), bool)
        ... )
        >>> q_local, chains, visit = start_visit(
        ...     settings, family, cavity, q, state, loglik, jax.random.PRNGKey(0)
        ... )
        >>> carry = run_blocks(
        ...     settings, visit, q_local, chains, state.log_step_size, jax.random.PRNGKey(1)
        ... )
        >>> (
        ...     [round(float(p[0]), 1) for p in family.to_params(carry.nat)],
        ...     int(carry.weight),
        ...     int(carry.clamped),
        ... )
        ([12.0, 5.0], 10, 0)
    """

    mean: NatParams
    nat: NatParams
    theta_aux: NatParams
    chains: jax.Array
    log_step: jax.Array
    weight: jax.Array
    sum_mean: NatParams
    clamped: jax.Array


def check_block_options(settings: SNEPSettings, family: Any) -> None:
    """Refuse the options that have no meaning on this path, and a family without mean
    parameters."""
    if not isinstance(family, MeanParamFamily):
        raise NotImplementedError(
            "SNEPUpdate needs a family with mean parameters (a Gaussian family, SiteFamilies, "
            f"Gamma, Beta or Dirichlet), not {family!r}."
        )
    if settings.site_variance is not None:
        raise ValueError(
            "SNEPUpdate: site_variance (a clamp of a Gaussian site's covariance) has no meaning "
            f"for {family!r}; leave it None (the mean-parameter steps keep q valid)."
        )


def init_block_state(settings: SNEPSettings, problem: ClientProblem) -> SNEPBlockState:
    """Unvisited: chains at 0 (drawn on the first visit), an initial sampler step size of 0.5."""
    check_block_options(settings, problem.family)
    return SNEPBlockState(
        jnp.zeros((settings.num_chains, problem.family.chain_dim(problem.dim))),
        jnp.log(jnp.asarray(0.5)),
        jnp.zeros((), jnp.int32),
        jnp.zeros((), bool),
    )


def bind_blocks(settings: SNEPSettings, problem: ClientProblem) -> Callable:
    """``client_update`` of :class:`~numpyro_pvi.SNEPUpdate` for a family that is not one Gaussian.

    **Example:** ``pvi.SNEPUpdate()`` with ``pvi.Gamma()`` or ``pvi.SiteFamilies({...})`` binds
    this.
    """
    check_block_options(settings, problem.family)
    return partial(_client_update, settings, problem)


def block_transition(visit: BlockVisit, alpha: float, max_tree_depth: int) -> Callable:
    """One NUTS transition of the tilted ``exp(tau . T(theta)) p(y_m | theta)^alpha`` in chain
    coordinates."""
    family = visit.family

    def potential_gen(tau: NatParams) -> Callable:
        def potential(u: jax.Array) -> jax.Array:
            theta, log_det = family.from_chain(visit.frame, u)
            return -(family.log_factor(tau, theta) + alpha * visit.loglik(theta) + log_det)

        return potential

    return nuts_kernel(potential_gen, max_tree_depth)


def block_step(
    settings: SNEPSettings,
    visit: BlockVisit,
    transition: Callable,
    carry: BlockCarry,
    xs: tuple[jax.Array, jax.Array],
) -> tuple[BlockCarry, None]:
    """One NUTS transition of every chain and the mirror step ``m <- (1 - eps) m + eps E_hat[T]``.

    The ``lax.scan`` body of :func:`run_blocks`; :class:`BlockCarry` has an example."""
    family, (i, key) = visit.family, xs
    tau = carry.theta_aux - settings.alpha * (carry.nat - visit.cavity)
    keys = jax.random.split(key, carry.chains.shape[0])
    u, grad, accept = jax.vmap(transition, in_axes=(0, 0, None, None))(
        keys, carry.chains, tau, jnp.exp(carry.log_step)
    )
    eps = settings.step_size_at(visit.count + i)
    plain = family.chain_mean_params(jax.vmap(lambda v: family.from_chain(visit.frame, v)[0])(u))
    flat, unravel = ravel_pytree(plain)
    features = jnp.mean(jax.vmap(stein_features)(u, grad), axis=0)
    mean, nat, ok = _mirror_step(family, carry, unravel(flat - visit.coef @ features), eps)
    plain_mean, plain_nat, plain_ok = _mirror_step(family, carry, plain, eps)
    # a control-variate estimate may leave the mean domain: the plain average, else the old iterate
    fell_back = ~ok
    mean, nat = where_tree(ok, mean, plain_mean), where_tree(ok, nat, plain_nat)
    ok = ok | plain_ok
    mean, nat = where_tree(ok, mean, carry.mean), where_tree(ok, nat, carry.nat)
    theta_aux = where_tree((i + 1) % settings.refresh_every == 0, nat, carry.theta_aux)
    # Polyak-Ruppert: the mean parameters' running sum
    w = (i >= settings.first_averaged).astype(u.dtype)
    return BlockCarry(
        mean,
        nat,
        theta_aux,
        u,
        adapted_log_step(carry.log_step, accept),
        carry.weight + w,
        carry.sum_mean + mean * w,
        carry.clamped + fell_back,
    ), None


def _mirror_step(
    family: MeanParamFamily, carry: BlockCarry, estimate: NatParams, eps: Any
) -> tuple[NatParams, NatParams, jax.Array]:
    """``m <- (1 - eps) m + eps estimate``, its natural parameters and whether they are valid and
    hold ``m``."""
    target = carry.mean * (1.0 - eps) + estimate * eps
    nat = family.from_mean_params(target, carry.nat)
    return target, nat, matches(family, nat, target)


def run_blocks(
    settings: SNEPSettings,
    visit: BlockVisit,
    q: NatParams,
    chains: jax.Array,
    log_step: jax.Array,
    rng_key: jax.Array,
) -> BlockCarry:
    """``settings.num_steps`` inner steps from the local ``q`` and the chains (in chain
    coordinates)."""
    mean = visit.family.mean_params(q)
    carry = BlockCarry(
        mean, q, q, chains, log_step, jnp.zeros(()), mean * 0.0, jnp.zeros((), jnp.int32)
    )
    step = partial(
        block_step,
        settings,
        visit,
        block_transition(visit, settings.alpha, settings.max_tree_depth),
    )
    xs = (jnp.arange(settings.num_steps), jax.random.split(rng_key, settings.num_steps))
    carry, _ = jax.lax.scan(step, carry, xs)
    return carry


def natural_gradient_start(
    family: Any,
    cavity: NatParams,
    q: NatParams,
    loglik: Callable,
    rng_key: jax.Array,
    num_steps: int,
    pairs: int = 64,
) -> NatParams:
    """A first visit's start: ``num_steps`` natural-gradient (CVI) steps ``q <- cavity * site(q)``,
    the client's site :meth:`~numpyro_pvi.families.FactorFamily.site_from_draws` at ``2 pairs``
    draws of ``q`` (one step is exact for a conjugate likelihood); the counterpart of the Gaussian
    path's Laplace start. A step whose ``q`` is not valid is skipped."""

    def step(current: NatParams, key: jax.Array) -> tuple[NatParams, None]:
        zeta = family.draw(current, key, pairs)
        values, grads = jax.vmap(jax.value_and_grad(loglik))(zeta)
        new = cavity + family.site_from_draws(current, zeta, values, grads, None)
        return where_tree(family.is_valid(new), new, current), None

    start, _ = jax.lax.scan(step, q, jax.random.split(rng_key, num_steps))
    return start


def carried_chains(
    family: MeanParamFamily, frame: Any, q_new: NatParams, q_old: NatParams, chains: jax.Array
) -> jax.Array:
    """The chains ``(C, K)`` (coordinates of ``frame``) in the coordinates of ``q_new``'s frame
    (``q_old``'s if ``q_new`` is not valid): the next visit keeps them, so that a chain moves with
    the change of ``q`` between visits (the paper's eq. 28)."""
    new_frame = family.chain_frame(where_tree(family.is_valid(q_new), q_new, q_old))
    return jax.vmap(lambda u: family.to_chain(new_frame, family.from_chain(frame, u)[0]))(chains)


def start_visit(
    settings: SNEPSettings,
    family: MeanParamFamily,
    cavity: NatParams,
    q: NatParams,
    state: SNEPBlockState,
    loglik: Callable,
    rng_key: jax.Array,
) -> tuple[NatParams, jax.Array, BlockVisit]:
    """The visit's local ``q`` (``q``, or the natural-gradient start on a first visit), its chains
    (carried, or drawn from ``N(0, I)``) and the :class:`BlockVisit` (frame and control-variate
    coefficients of that ``q``)."""
    start_key, chain_key = jax.random.split(rng_key)
    q_local = where_tree(
        state.visited,
        q,
        natural_gradient_start(family, cavity, q, loglik, start_key, settings.num_newton),
    )
    chains = jnp.where(
        state.visited, state.chains, jax.random.normal(chain_key, state.chains.shape)
    )
    frame = family.chain_frame(q_local)
    coef = stein_coefficients(family, frame, q_local)
    # no control variates: the plain average
    coef = coef if settings.control_variates else jnp.zeros_like(coef)
    return q_local, chains, BlockVisit(family, cavity, frame, loglik, state.count, coef)


def _client_update(
    settings: SNEPSettings,
    problem: ClientProblem,
    rng_key: jax.Array,
    client: Client,
    cavity: NatParams,
    q: NatParams,
    state: SNEPBlockState,
    hyper: Any = (),
) -> ClientResult:
    """One visit: ``settings.num_steps`` inner steps, then the site of the averaged mean
    parameters."""
    del hyper  # SNEP does not support hyperparameters; the argument is the shared interface's
    start_key, loop_key, fe_key = jax.random.split(rng_key, 3)
    family, t_old = problem.family, q - cavity
    q_local, chains, visit = start_visit(
        settings,
        family,
        cavity,
        q,
        state,
        lambda theta: problem.log_likelihood(theta, client),
        start_key,
    )
    carry = run_blocks(settings, visit, q_local, chains, state.log_step_size, loop_key)
    mean_avg = carry.sum_mean * (1.0 / carry.weight)
    q_avg = family.from_mean_params(mean_avg, carry.nat)
    averaged = matches(family, q_avg, mean_avg)
    site = where_tree(averaged, q_avg, carry.nat) - cavity

    q_new = cavity + site
    chains = carried_chains(family, visit.frame, q_new, q_local, carry.chains)
    finite = family.is_valid(q_new) & jnp.all(jnp.isfinite(chains)) & jnp.isfinite(carry.log_step)
    site = where_tree(finite, site, t_old)
    new_state = SNEPBlockState(
        jnp.where(finite, chains, state.chains),
        jnp.where(finite, carry.log_step, state.log_step_size),
        state.count + settings.num_steps,
        finite | state.visited,
    )
    q_new = cavity + site
    free_energy = local_free_energy(
        family, q_new, cavity, visit.loglik, family.draw(q_new, fe_key, 32)
    )
    # the tilted's, as EP's (power EP)
    cavity_alpha = settings.alpha * cavity + (1.0 - settings.alpha) * q_new
    inflation = tilted_inflation(
        family, q_new, cavity_alpha, visit.loglik, settings.alpha, jax.random.fold_in(fe_key, 1)
    )
    return ClientResult(
        site - t_old,
        free_energy,
        new_state,
        carry.clamped + (~averaged) + (~finite),
        inflation=inflation,
    )
