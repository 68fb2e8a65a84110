"""A chosen start, like NumPyro's autoguides: ``q`` at ``init_loc_fn``'s values with sd ``init_scale``.

By default PVI starts at the prior (``q = prior``, every factor flat). With ``PVI(..., init_loc_fn=...,
init_scale=...)`` the initial ``q_init`` is a Gaussian in unconstrained space centred at the values
``init_loc_fn`` (e.g. ``numpyro.infer.init_to_median``) gives the global sites, with sd ``init_scale``
in every coordinate. It is split evenly over the ``M`` clients' factors,
``t_m = (q_init - q_prior) / M`` in natural parameters, so that ``q = q_prior + sum_m t_m = q_init``
and every cavity ``q - t_m = q_prior / M + (M - 1) q_init / M`` is a convex combination of two valid
Gaussians, hence valid.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from numpyro import handlers

from numpyro_pvi.families import Family, NatParams, SiteFamilies

DEFAULT_SCALE = 0.1  # NumPyro's autoguides' init_scale


def initial_loc(model: Callable, problem: Any, rng_key: jax.Array, init_loc_fn: Callable) -> jax.Array:
    """The flat vector ``zeta`` of the global sites' values that ``init_loc_fn`` gives (client 0's model call).

    **Example:** ``initial_loc(model, problem, key, numpyro.infer.init_to_median)``
    """
    args, kwargs = problem.split.layout.build([a[0] for a in problem.clients.arrays])
    seeded = handlers.substitute(handlers.seed(model, rng_key), substitute_fn=init_loc_fn)
    with handlers.block():
        trace = handlers.trace(seeded).get_trace(*args, **kwargs)
    return problem.sites.flatten({s.name: trace[s.name]["value"] for s in problem.sites.globals})


def initial_q(family: Any, loc: jax.Array, scale: float) -> NatParams:
    """The Gaussian (or block-Gaussian) ``q`` with mean ``loc`` and sd ``scale`` in every coordinate."""
    if isinstance(family, Family):
        return family.from_loc_scale(loc, scale * family.identity(loc.shape[-1]))
    if isinstance(family, SiteFamilies) and all(isinstance(b[0], Family) for b in family.blocks):
        return family.join([block.from_loc_scale(loc[a:b], scale * block.identity(b - a))
                            for block, a, b, _ in family.blocks])
    raise NotImplementedError(f"init_loc_fn / init_scale need Gaussian factors; {family!r} has exponential-family "
                              "blocks, which start at the prior.")


def chosen_start(family: Any, model: Callable, problem: Any, prior_q: NatParams, rng_key: jax.Array,
                 init_loc_fn: Callable | None, init_scale: float | None) -> tuple[NatParams, NatParams]:
    """``(q_init, factors)``: ``q_init`` split evenly over the real clients' factors (empty slots stay flat).

    :param prior_q: ``q`` at the prior (the exact prior times the prior factor ``t_0``).
    """
    from numpyro.infer import init_to_median

    loc = initial_loc(model, problem, rng_key, init_to_median if init_loc_fn is None else init_loc_fn)
    q_init = initial_q(family, loc, DEFAULT_SCALE if init_scale is None else float(init_scale))
    share = (q_init - prior_q) * (1.0 / problem.num_clients)
    real = jnp.arange(problem.capacity) < problem.num_clients
    factors = jax.tree.map(lambda s: jnp.where(real.reshape((-1,) + (1,) * jnp.ndim(s)), s[None], 0.0), share)
    return prior_q + share * float(problem.num_clients), factors
