"""A chosen start, like NumPyro's autoguides: ``q`` at ``init_loc_fn``'s values with spread
``init_scale``.

By default PVI starts at the prior (``q = prior``, every factor flat). With ``PVI(...,
init_loc_fn=..., init_scale=...)`` the initial ``q_init`` is centred at the values ``init_loc_fn``
(e.g. ``numpyro.infer.init_to_median``) gives the global sites; each family (each block of a
:class:`~numpyro_pvi.SiteFamilies`) builds its own member, ``family.initial_q(loc, init_scale)``:

=====================
===================================================================================== family
``q_init`` of a block at ``loc`` with ``init_scale = s`` =====================
===================================================================================== Gaussian
families      mean ``loc`` (unconstrained), sd ``s`` in every coordinate, independent ``Gamma``
mean ``loc``, sd ``s * loc`` (shape ``1 / s^2``, rate ``shape / loc``) ``Beta``               mean
``loc``, sd ``s * sqrt(loc (1 - loc))``: ``a + b = 1 / s^2 - 1`` (``s < 1``) ``Dirichlet``
mean ``loc / sum(loc)``, sd ``s * sqrt(m_k (1 - m_k))``: ``alpha_0 = 1 / s^2 - 1``
=====================
=====================================================================================

For small ``s`` the three exponential families have a sd of about ``s`` in ``log theta`` (Gamma) or
a relative sd ``s`` of the largest possible (Beta, Dirichlet). ``q_init`` is split evenly over the
``M`` clients' factors, ``t_m = (q_init - q_prior) / M`` in natural parameters, so that ``q =
q_prior + sum_m t_m = q_init`` and every cavity ``q - t_m = q_prior / M + (M - 1) q_init / M`` is a
convex combination of two valid members, hence valid: the valid natural parameters of every family
here form a convex set (a positive-definite precision; Gamma ``shape > 0, rate > 0``; Beta and
Dirichlet concentrations ``> 0``, each a half-space in ``eta``).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from numpyro import handlers

from numpyro_pvi.families import NatParams

DEFAULT_SCALE = 0.1  # NumPyro's autoguides' init_scale


def initial_loc(
    model: Callable, problem: Any, rng_key: jax.Array, init_loc_fn: Callable
) -> jax.Array:
    """The flat vector ``zeta`` of the global sites' values that ``init_loc_fn`` gives (client 0's
    model call).

    **Example:** ``initial_loc(model, problem, key, numpyro.infer.init_to_median)``
    """
    args, kwargs = problem.split.layout.build([a[0] for a in problem.clients.arrays])
    seeded = handlers.substitute(handlers.seed(model, rng_key), substitute_fn=init_loc_fn)
    with handlers.block():
        trace = handlers.trace(seeded).get_trace(*args, **kwargs)
    return problem.sites.flatten({s.name: trace[s.name]["value"] for s in problem.sites.globals})


def initial_q(family: Any, loc: jax.Array, scale: float) -> NatParams:
    """The family's chosen start at ``loc`` with spread ``scale`` (``family.initial_q``; see the
    module docstring).

    **Example:** ``initial_q(pvi.Gamma(), jnp.array([2.0]), 0.1)`` is a Gamma with mean 2 and sd
    0.2.
    """
    return family.initial_q(loc, scale)


def chosen_start(
    family: Any,
    model: Callable,
    problem: Any,
    prior_q: NatParams,
    rng_key: jax.Array,
    init_loc_fn: Callable | None,
    init_scale: float | None,
) -> tuple[NatParams, NatParams]:
    """``(q_init, factors)``: ``q_init`` split evenly over the real clients' factors (empty slots
    stay flat).

    :param prior_q: ``q`` at the prior (the exact prior times the prior factor ``t_0``).
    """
    from numpyro.infer import init_to_median

    loc = initial_loc(
        model, problem, rng_key, init_to_median if init_loc_fn is None else init_loc_fn
    )
    q_init = initial_q(family, loc, DEFAULT_SCALE if init_scale is None else float(init_scale))
    share = (q_init - prior_q) * (1.0 / problem.num_clients)
    real = jnp.arange(problem.capacity) < problem.num_clients
    factors = jax.tree.map(
        lambda s: jnp.where(real.reshape((-1,) + (1,) * jnp.ndim(s)), s[None], 0.0), share
    )
    return prior_q + share * float(problem.num_clients), factors
