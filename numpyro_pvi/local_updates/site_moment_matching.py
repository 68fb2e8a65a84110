"""EP for the families beyond one Gaussian (:class:`~numpyro_pvi.SiteFamilies`, ``Gamma``, ``Beta``, ``Dirichlet``).

The client matches the expected sufficient statistics of its tilted distribution
``p_m ∝ q_alpha p(y_m | theta)^alpha`` (power-EP cavity ``q_alpha = q / t_m^alpha``), block by block
(:meth:`~numpyro_pvi.families.FactorFamily.match_moments`). The statistics come from self-normalised
importance sampling whose proposal is ``q_alpha`` times ``alpha`` times the client's natural-gradient site
(:meth:`~numpyro_pvi.families.FactorFamily.site_from_draws` at draws of ``q``), with the proposal's exact
moments as control variate: for a conjugate likelihood the proposal *is* the tilted distribution, every
weight is equal and the step is exact. A proposal that is not valid falls back to ``q``. That proposal is
this path's ``proposal="laplace"`` (a local approximation of the tilted distribution in the family);
``proposal="cavity"`` samples ``q_alpha`` itself. ``tilted="nuts"`` has no counterpart here (NUTS runs in
unconstrained space, the blocks live in their sites' own): :class:`~numpyro_pvi.MomentMatchingUpdate` refuses it.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from numpyro_pvi.families import NatParams
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult, local_free_energy


def bind_site_families(problem: ClientProblem, alpha: float, num_samples: int, min_ess: float,
                       safe_step: Callable, max_backtracks: int, proposal: str = "laplace") -> Callable:
    """``client_update`` of :class:`~numpyro_pvi.MomentMatchingUpdate` for a non-Gaussian family.

    :param safe_step: ``(family, q, target, alpha, low_ess, max_backtracks) -> (delta, halvings, ok)``.
    :param proposal: ``"laplace"`` (the cavity times the client's natural-gradient site) or ``"cavity"``.

    **Example:** ``pvi.MomentMatchingUpdate(num_samples=1024)`` with ``pvi.Gamma()`` binds this.
    """
    family, pairs = problem.family, max(1, num_samples // 2)

    def _site_proposal(q: NatParams, cavity_alpha: NatParams, loglik: Callable, key: jax.Array) -> NatParams:
        """``q_alpha`` times ``alpha`` times the client's natural-gradient site at draws of ``q`` (``q`` if invalid)."""
        zeta = family.draw(q, key, pairs)
        values, grads = jax.vmap(jax.value_and_grad(loglik))(zeta)
        site = cavity_alpha + alpha * family.site_from_draws(q, zeta, values, grads, None)
        return jax.tree.map(lambda a, b: jnp.where(family.is_valid(site), a, b), site, q)

    def client_update(rng_key: jax.Array, client: Client, cavity: NatParams, q: NatParams,
                      state: Any, hyper: Any = ()) -> ClientResult:
        loglik = lambda z: problem.log_likelihood(z, client, hyper)  # noqa: E731
        site_key, sample_key, fe_key = jax.random.split(rng_key, 3)
        cavity_alpha = alpha * cavity + (1.0 - alpha) * q  # q / t_m^alpha: valid, a convex combination
        proposal_q = cavity_alpha if proposal == "cavity" else _site_proposal(q, cavity_alpha, loglik, site_key)
        zeta = family.draw(proposal_q, sample_key, pairs)
        log_w = alpha * jax.vmap(loglik)(zeta) + family.to_dist(cavity_alpha).log_prob(zeta) \
            - family.to_dist(proposal_q).log_prob(zeta)
        log_w = jnp.where(jnp.isfinite(log_w), log_w, -jnp.inf)
        weights = jax.nn.softmax(log_w)
        low_ess = 1.0 / jnp.sum(weights**2) < min_ess * zeta.shape[0]
        target = family.match_moments(proposal_q, zeta, weights)
        delta, halvings, _ = safe_step(family, q, target, alpha, low_ess, max_backtracks)
        q_new = q + delta
        free_energy = local_free_energy(family, q_new, cavity, loglik, family.draw(q_new, fe_key, 32))
        return ClientResult(delta, free_energy, state, low_ess + halvings)

    return client_update
