"""The round's ELBO from the clients' reports: no pass over the data on the server.

The global ELBO of ``q`` splits into the clients' terms and the prior's:

``ELBO(q) = sum_m E_q[log p(y_m, z_m | theta) - log q_m(z_m)] + E_q[log p(theta)] + H[q]``

(``z_m`` client ``m``'s local latents and ``q_m`` their guide, if the model has any). Client ``m``
computes its term under the ``q`` it was sent (:func:`client_elbo_term`, in the compiled step of its
update); the server adds the prior's terms, which need ``q`` and the prior's density only
(:func:`prior_elbo_term`); :func:`round_elbo` is their sum. Every term draws ``theta`` from the same
key, :data:`ELBO_KEY` (common random numbers: the same draws every round, and every client and the
prior on the same draws), so rounds' ELBOs compare without most of the sampling noise and the sum
is, to float rounding, :meth:`PVI.evaluate <numpyro_pvi.PVI.evaluate>`'s pooled pass with that key.

**Example:** a server that received the clients' terms ``terms`` under ``q``::

    elbo = round_elbo(terms, prior_elbo_term(family, q, prior_logdensity, 64))
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer import Trace_ELBO, TraceEnum_ELBO

from numpyro_pvi.local_updates.base import Client, ClientProblem
from numpyro_pvi.model.local_latents import expected_local_elbo

ELBO_KEY = jax.random.PRNGKey(1)  # RoundInfo.elbo's draws, the same every round


def elbo_draws(family: Any, q: Any, num_particles: int, rng_key: jax.Array = ELBO_KEY) -> jax.Array:
    """``(num_particles, D)`` draws of ``zeta`` from ``q``: the draws every term of the ELBO
    shares."""
    return family.to_dist(q).sample(jax.random.split(rng_key)[0], (num_particles,))


def prior_elbo_term(
    family: Any,
    q: Any,
    prior_logdensity: Callable[[jax.Array], jax.Array],
    num_particles: int,
    rng_key: jax.Array = ELBO_KEY,
) -> jax.Array:
    """The server's part of the ELBO, ``E_q[log p(theta)] + H[q]``, on :func:`elbo_draws`.

    :param prior_logdensity: ``zeta -> log p(theta(zeta)) + log|d theta / d zeta|``, the prior's
        density in the unconstrained space of the global sites. It needs no data when the prior
        does not depend on them (in process it is the model's prior read from the first client's
        call, :func:`~numpyro_pvi.model.densities.log_prior`; a prior whose parameters are computed
        from the data gets that client's).
    """
    zeta = elbo_draws(family, q, num_particles, rng_key)
    return jnp.mean(jax.vmap(prior_logdensity)(zeta)) + family.to_dist(q).entropy()


def client_elbo_term(problem: ClientProblem, num_particles: int) -> Callable:
    """``(q, client_id, client, state, hyper, rng_key=ELBO_KEY) -> E_q[log p(y_m, z_m | theta) -
    log q_m(z_m)]``, client ``m``'s term of the ELBO under the ``q`` it was sent.

    Without local latents this is ``E_q[log p(y_m | theta)]`` on :func:`elbo_draws`; with them, the
    negative loss of a ``Trace_ELBO`` (``TraceEnum_ELBO`` with enumerated sites) of
    ``num_particles`` draws under the client's local guides ``state``, its key folded in from
    ``client_id`` (:func:`~numpyro_pvi.model.local_latents.expected_local_elbo`).
    """
    family, sites = problem.family, problem.sites
    if problem.has_local:
        ensemble = TraceEnum_ELBO(num_particles) if sites.enumerated else Trace_ELBO(num_particles)
        expected = expected_local_elbo(ensemble, family, problem.local_model, sites)

    def term(
        q: Any,
        client_id: jax.Array,
        client: Client,
        state: Any = (),
        hyper: Any = (),
        rng_key: jax.Array = ELBO_KEY,
    ) -> jax.Array:
        if problem.has_local:
            local_key = jax.random.fold_in(jax.random.split(rng_key)[1], client_id)
            return expected(local_key, client, q, state, hyper)
        zeta = elbo_draws(family, q, num_particles, rng_key)
        return jnp.mean(jax.vmap(lambda z: problem.log_likelihood(z, client, hyper))(zeta))

    return term


def round_elbo(client_terms: Any, prior_term: Any) -> float:
    """``sum(client_terms) + prior_term``: the ELBO of the ``q`` the clients were sent, from their
    reported terms (:func:`client_elbo_term`) and the server's :func:`prior_elbo_term`; NaN if a
    client's term is missing (NaN).

    **Example:** ``round_elbo([-10.0, -12.5], -3.0)`` is ``-25.5``.
    """
    terms = np.asarray(client_terms, np.float64)
    return float(np.sum(terms) + float(prior_term))
