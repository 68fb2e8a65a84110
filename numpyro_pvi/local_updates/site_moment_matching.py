"""EP for the families beyond one Gaussian (:class:`~numpyro_pvi.SiteFamilies`, ``Gamma``, ``Beta``,
``Dirichlet``).

The client matches the expected sufficient statistics of its tilted distribution ``p_m ∝ q_alpha
p(y_m | theta)^alpha`` (power-EP cavity ``q_alpha = q / t_m^alpha``), block by block
(:meth:`~numpyro_pvi.families.FactorFamily.match_moments`). The statistics come from self-normalised
importance sampling whose proposal is ``q_alpha`` times ``alpha`` times the client's
natural-gradient site (:meth:`~numpyro_pvi.families.FactorFamily.site_from_draws` at draws of
``q``), with the proposal's exact moments as control variate: for a conjugate likelihood the
proposal *is* the tilted distribution, every weight is equal and the step is exact. A proposal that
is not valid falls back to ``q``. That proposal is this path's ``proposal="laplace"`` (a local
approximation of the tilted distribution in the family); ``proposal="cavity"`` samples ``q_alpha``
itself. With ``"laplace"`` the cavity is tried as well and the statistics come from the proposal
whose weights have the larger effective sample size (the natural-gradient site is read off draws of
``q`` and can miss the tilted distribution entirely when ``q`` is far from it: a wide prior's first
rounds). Weights whose effective sample size stays below ``min_ess`` give no step (the step is not
taken and counted as clamped): their statistics are those of a few draws, and the member matched to
a few draws is a point mass (sweep cell 3 of issue 23: a Gamma block's shape went from 179 to
``9e9`` in one such step, from 2 effective draws of 1024).

With ``tilted="nuts"`` the statistics are averaged over NUTS draws of the tilted distribution
instead, in the family's chain coordinates
(:meth:`~numpyro_pvi.families.MeanParamFamily.from_chain`: unconstrained, standardised by the
proposal, with the log Jacobian in the potential; SNEP's), and the member with those mean parameters
is found by :meth:`~numpyro_pvi.families.MeanParamFamily.from_mean_params`. A draw's average always
lies in the family's mean domain; should the inverse still miss it, the step is not taken and is
counted as clamped.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from numpyro_pvi.families import MeanParamFamily, NatParams
from numpyro_pvi.families.gaussian import variance_inflation, weighted_covariance
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult, local_free_energy
from numpyro_pvi.local_updates.laplace import laplace_site
from numpyro_pvi.local_updates.nuts import NUTSSettings, nuts_draws
from numpyro_pvi.local_updates.snep_blocks import matches, stein_coefficients, stein_features

# : Importance weights with fewer effective draws than this give no step (counted as clamped): the
# member : matched to them is concentrated on those few draws (sweep cell 3: an ESS of 2 of 1,024
# draws matched a : Gamma block of shape 2e11). Between this and ``min_ess`` of the draws the step
# is halved.
MIN_EFFECTIVE_DRAWS = 10
#: Newton steps for the Laplace proposal (the family's Laplace approximation of the tilted).
NUM_NEWTON = 20


def bind_site_families(
    problem: ClientProblem,
    alpha: float,
    num_samples: int,
    min_ess: float,
    safe_step: Callable,
    max_backtracks: int,
    proposal: str = "laplace",
    nuts: NUTSSettings | None = None,
) -> Callable:
    """``client_update`` of :class:`~numpyro_pvi.MomentMatchingUpdate` for a non-Gaussian family.

    :param safe_step: ``(family, q, target, alpha, low_ess, max_backtracks) -> (delta, halvings,
        ok)``.
    :param proposal: ``"laplace"`` (the cavity times the client's natural-gradient site) or
        ``"cavity"``.
    :param nuts: the NUTS settings for ``tilted="nuts"`` (:func:`nuts_target`); ``None`` for
        importance sampling.

    **Example:** ``pvi.MomentMatchingUpdate(num_samples=1024)`` with ``pvi.Gamma()`` binds this.
    """
    family, pairs = problem.family, max(1, num_samples // 2)

    def _site_proposal(
        q: NatParams, cavity_alpha: NatParams, loglik: Callable, key: jax.Array
    ) -> NatParams:
        """``q_alpha`` times ``alpha`` times the client's natural-gradient site at draws of ``q``
        (``q`` if invalid)."""
        zeta = family.draw(q, key, pairs)
        values, grads = jax.vmap(jax.value_and_grad(loglik))(zeta)
        site = cavity_alpha + alpha * family.site_from_draws(q, zeta, values, grads, None)
        return jax.tree.map(lambda a, b: jnp.where(family.is_valid(site), a, b), site, q)

    def _importance_target(
        proposal_q: NatParams, cavity_alpha: NatParams, loglik: Callable, key: jax.Array
    ) -> tuple[NatParams, jax.Array, jax.Array]:
        """The member matched to the importance-weighted statistics, the weights' ESS (a fraction of
        the draws; 0 when no weight is finite), and the weighted draws' variance inflation beyond
        the family's form (:func:`variance_inflation`)."""
        zeta = family.draw(proposal_q, key, pairs)
        log_w = (
            alpha * jax.vmap(loglik)(zeta)
            + family.to_dist(cavity_alpha).log_prob(zeta)
            - family.to_dist(proposal_q).log_prob(zeta)
        )
        log_w = jnp.where(jnp.isfinite(log_w), log_w, -jnp.inf)
        weights = jax.nn.softmax(log_w)
        ess = 1.0 / jnp.sum(weights**2) / zeta.shape[0]
        inflation = variance_inflation(
            family, weighted_covariance(zeta, weights), 0.5 / jnp.sum(weights**2)
        )
        target = family.match_moments(proposal_q, zeta, weights)
        return target, jnp.where(jnp.isfinite(ess), ess, 0.0), inflation

    def _best_importance_target(
        proposals: list, cavity_alpha: NatParams, loglik: Callable, key: jax.Array
    ) -> tuple[NatParams, jax.Array, jax.Array]:
        """The target from the proposal whose weights have the largest ESS, that ESS (a fraction of
        the draws), and the variance inflation read off the first proposal's draws (the Laplace
        proposal's, the nearest to the tilted distribution: fewest chance correlations)."""
        keys = jax.random.split(key, len(proposals))
        outs = [_importance_target(p, cavity_alpha, loglik, k) for p, k in zip(proposals, keys)]
        target, ess, inflation = outs[0]
        for other, other_ess, _ in outs[1:]:
            better = other_ess > ess
            target = jax.tree.map(
                lambda a, b, better=better: jnp.where(better, b, a), target, other
            )
            ess = jnp.maximum(ess, other_ess)
        return target, ess, inflation

    def _laplace_proposal(q: NatParams, cavity_alpha: NatParams, loglik: Callable) -> NatParams:
        """The family's Laplace approximation of the tilted ``cavity_alpha * p(y_m | theta)^alpha``
        (``q`` where it is not a valid member)."""
        laplace_q = cavity_alpha + laplace_site(
            family, cavity_alpha, q, lambda z: alpha * loglik(z), NUM_NEWTON
        )
        finite = jnp.all(
            jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(laplace_q)])
        )
        valid = family.is_valid(laplace_q) & finite
        return jax.tree.map(lambda a, b: jnp.where(valid, a, b), laplace_q, q)

    def client_update(
        rng_key: jax.Array,
        client: Client,
        cavity: NatParams,
        q: NatParams,
        state: Any,
        hyper: Any = (),
    ) -> ClientResult:
        loglik = lambda z: problem.log_likelihood(z, client, hyper)  # noqa: E731
        site_key, sample_key, fe_key = jax.random.split(rng_key, 3)
        # q / t_m^alpha: valid, a convex combination
        cavity_alpha = alpha * cavity + (1.0 - alpha) * q
        proposal_q = (
            cavity_alpha
            if proposal == "cavity"
            else _site_proposal(q, cavity_alpha, loglik, site_key)
        )
        if nuts is None:
            proposals = [proposal_q]
            if proposal != "cavity":
                proposals = [_laplace_proposal(q, cavity_alpha, loglik), proposal_q, cavity_alpha]
            target, ess, inflation = _best_importance_target(
                proposals, cavity_alpha, loglik, sample_key
            )
            low_ess = ess < min_ess  # the step is halved
            degenerate = ess * 2 * pairs < MIN_EFFECTIVE_DRAWS  # no step
            target = jax.tree.map(lambda a, b: jnp.where(degenerate, b, a), target, q)
            inflation = jnp.where(degenerate, 1.0, inflation)  # not measured by a few draws
        else:
            target, missed, inflation = nuts_target(
                family, proposal_q, cavity_alpha, loglik, alpha, sample_key, nuts
            )
            target, low_ess = jax.tree.map(lambda a, b: jnp.where(missed, b, a), target, q), missed
        delta, halvings, _ = safe_step(family, q, target, alpha, low_ess, max_backtracks)
        q_new = q + delta
        free_energy = local_free_energy(
            family, q_new, cavity, loglik, family.draw(q_new, fe_key, 32)
        )
        return ClientResult(delta, free_energy, state, low_ess + halvings, inflation=inflation)

    return client_update


def nuts_target(
    family: MeanParamFamily,
    proposal_q: NatParams,
    cavity_alpha: NatParams,
    loglik: Callable,
    alpha: float,
    rng_key: jax.Array,
    nuts: NUTSSettings,
) -> tuple[NatParams, jax.Array, jax.Array]:
    """The member whose mean parameters are the NUTS estimate of the tilted distribution's ``E[T]``,
    whether no estimate could be inverted, and the draws' variance inflation beyond the family's
    form (:func:`~numpyro_pvi.families.gaussian.variance_inflation`: ``ClientResult.inflation``).

    The chains run in the family's chain coordinates standardised by ``proposal_q``, on the tilted
    density ``exp(cavity_alpha . T(theta)) p(y_m | theta)^alpha`` times the log Jacobian. ``E[T]``
    is the draws' average of ``T`` less Stein control variates whose coefficients are read off
    ``proposal_q`` (SNEP's, see
    :func:`~numpyro_pvi.local_updates.snep_blocks.stein_coefficients`: unbiased, exact when the
    tilted distribution is the proposal); if that estimate has no member, the plain average is used.

    **Example:** ``target, missed, inflation = nuts_target(pvi.Gamma(), q, q, loglik, 1.0, key,
    NUTSSettings(2, 300, 500, 6))``.
    """
    frame = family.chain_frame(proposal_q)

    def log_tilted(u: jax.Array) -> jax.Array:
        theta, log_det = family.from_chain(frame, u)
        return family.log_factor(cavity_alpha, theta) + alpha * loglik(theta) + log_det

    dim = family.chain_dim(proposal_q.eta1.shape[-1])
    u = nuts_draws(
        lambda v: -log_tilted(v),
        dim,
        rng_key,
        nuts.num_chains,
        nuts.num_warmup,
        nuts.num_samples,
        nuts.max_tree_depth,
    )
    theta = jax.vmap(lambda v: family.from_chain(frame, v)[0])(u)
    plain = family.chain_mean_params(theta)
    flat, unravel = ravel_pytree(plain)
    features = jnp.mean(jax.vmap(stein_features)(u, jax.vmap(jax.grad(log_tilted))(u)), axis=0)
    estimate = unravel(flat - stein_coefficients(family, frame, proposal_q) @ features)
    target, plain_target = (
        family.from_mean_params(estimate, proposal_q),
        family.from_mean_params(plain, proposal_q),
    )
    ok = matches(family, target, estimate)
    return (
        jax.tree.map(lambda a, b: jnp.where(ok, a, b), target, plain_target),
        ~(ok | matches(family, plain_target, plain)),
        variance_inflation(family, weighted_covariance(theta), theta.shape[0]),
    )
