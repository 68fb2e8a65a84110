"""Client-private local latent variables: each client's own mean-field guide, never sent to the
server.

An unobserved site inside the partition plate (a random intercept, a latent position, a per-datum
scale) belongs to the client that holds the row. The client keeps a guide for it, ``Normal(loc,
scale)`` in the unconstrained space of the site like ``AutoNormal``, optimised jointly with its
global ``q`` inside the local free energy

``F_m(q, q_m) = E_{q(zeta) q_m(z)}[log p(y_m, z | theta(zeta)) - log q_m(z)] - KL(q || cavity)``,

and stored in the client's state across rounds. Only the factor on the global sites leaves the
client. Discrete local latents marked for enumeration have no guide: ``TraceEnum_ELBO`` sums them
out. Padded rows (``vmap`` over clients of unequal size) are masked in the model and in the guide.

The local state of one client is a dict ``site -> (loc, scale)`` of unconstrained arrays with the
(padded) client's rows on the partition plate's axis.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.distributions.transforms import IdentityTransform

from numpyro_pvi.model.partition import ClientData
from numpyro_pvi.model.sites import LocalSite, ModelSites

PREFIX = "_pvi_local_"
INIT_SCALE = 0.1  # like AutoNormal's init_scale


def init_local_state(sites: ModelSites) -> dict:
    """A client's initial local guides: ``loc = 0`` and ``scale = 0.1`` in unconstrained space."""
    return {
        s.name: (jnp.zeros(s.flat_shape), jnp.full(s.flat_shape, INIT_SCALE)) for s in sites.locals
    }


def local_distribution(
    site: LocalSite, loc: jax.Array, scale: jax.Array, mask: jax.Array | None = None
) -> dist.Distribution:
    """The guide's distribution of a local site (constrained values), rows outside ``mask``
    masked."""
    fn = dist.Normal(loc, scale).to_event(site.event_dim)
    if not isinstance(site.transform, IdentityTransform):
        fn = dist.TransformedDistribution(fn, site.transform)
    if mask is not None:
        plate_dim = site.row_axis + site.event_dim
        fn = fn.mask(jnp.reshape(mask, (-1,) + (1,) * (-plate_dim - 1)))
    return fn


def local_guide(sites: ModelSites, mask: jax.Array | None, state: dict) -> dict:
    """Sample every local site from its guide, whose parameters start at ``state``.

    Call inside a guide: the parameters are ``numpyro.param`` sites named ``_pvi_local_loc_<site>``
    and ``_pvi_local_scale_<site>``, the samples sit in the same plates as in the model.

    :return: the local sites' constrained values.
    """
    values = {}
    for site in sites.locals:
        loc0, scale0 = state[site.name]
        loc = numpyro.param(f"{PREFIX}loc_{site.name}", loc0)
        scale = numpyro.param(
            f"{PREFIX}scale_{site.name}", scale0, constraint=constraints.softplus_positive
        )
        with ExitStack() as stack:
            for name, size, dim in site.frames:
                stack.enter_context(numpyro.plate(name, size, dim=dim))
            values[site.name] = numpyro.sample(
                site.name, local_distribution(site, loc, scale, mask)
            )
    return values


def state_from_params(sites: ModelSites, params: dict) -> dict:
    """The local state from (constrained) ``SVI`` parameters of :func:`local_guide`."""
    return {
        s.name: (params[f"{PREFIX}loc_{s.name}"], params[f"{PREFIX}scale_{s.name}"])
        for s in sites.locals
    }


def own_rows(site: LocalSite, state: dict, rows: int) -> tuple:
    """One client's guide parameters ``(loc, scale)`` of ``site`` on its first ``rows`` (real,
    unpadded) rows."""
    index = [slice(None)] * len(site.flat_shape)
    index[site.row_axis] = slice(0, rows)
    return tuple(x[tuple(index)] for x in state[site.name])


def sample_local(
    sites: ModelSites, rng_key: jax.Array, state: dict, num_samples: int, rows: int
) -> dict:
    """``num_samples`` draws of one client's local sites (its first ``rows`` real rows),
    constrained."""
    out = {}
    for site, key in zip(sites.locals, jax.random.split(rng_key, max(len(sites.locals), 1))):
        loc, scale = own_rows(site, state, rows)
        u = loc + scale * jax.random.normal(key, (num_samples,) + loc.shape)
        out[site.name] = site.transform(u)
    return out


def expected_local_elbo(
    elbo: Any, family: Any, local_model: Callable, sites: ModelSites
) -> Callable:
    """``(rng_key, client, q, state, hyper) -> E_q[ELBO_m(theta)]``: the client's term of the global
    ELBO.

    ``ELBO_m(theta) = E_{q_m(z)}[log p(y_m, z | theta) - log q_m(z)]`` (discrete sites summed out by
    a ``TraceEnum_ELBO``); computed as the negative ``elbo`` loss of a model and a guide that both
    draw ``zeta`` from ``q``, whose KL term is then exactly zero.
    """

    def model(client: Any, q: tuple, state: dict, hyper: Any) -> None:
        zeta = numpyro.sample("_pvi_zeta", family.params_distribution(q))
        local_model(zeta, client, hyper)

    def guide(client: Any, q: tuple, state: dict, hyper: Any) -> None:
        numpyro.sample("_pvi_zeta", family.params_distribution(q))
        local_guide(sites, client.mask, state)

    def expected(rng_key: jax.Array, client: Any, q: Any, state: dict, hyper: Any) -> jax.Array:
        return -elbo.loss(rng_key, {}, model, guide, client, family.guide_params(q), state, hyper)

    return expected


def pooled_order(sizes: Any, partitions: Any) -> np.ndarray:
    """Where the clients' rows, concatenated in client order, sit in the pooled data.

    ``partitions`` are the index arrays of ``PVI(partitions=...)`` (``None`` for one client); with
    ``ClientData`` the pooled order is client 0's rows, then client 1's, ...

    **Example:** ``pooled_order([2, 1], [np.array([2, 0]), np.array([1])])`` is ``array([2, 0,
    1])``.
    """
    if partitions is None or isinstance(partitions, ClientData):
        return np.arange(int(np.sum(sizes)))
    return np.concatenate([np.asarray(p) for p in partitions])


def pooled_local(sites: ModelSites, client_states: dict, sizes: Any, order: np.ndarray) -> dict:
    """Every client's guide parameters gathered in pooled row order: site -> ``(loc, scale)`` over
    all rows.

    **Example:** ``pooled_local(sites, state.client_states, problem.sizes,
    pooled_order(problem.sizes, parts))``.
    """
    rows = np.argsort(order, kind="stable")
    out = {}
    for site in sites.locals:
        per_client = [
            own_rows(site, jax.tree.map(lambda s, m=m: s[m], client_states), int(n))
            for m, n in enumerate(sizes)
        ]
        out[site.name] = tuple(
            jnp.take(
                jnp.concatenate([c[k] for c in per_client], axis=site.row_axis),
                rows,
                axis=site.row_axis,
            )
            for k in range(2)
        )
    return out
