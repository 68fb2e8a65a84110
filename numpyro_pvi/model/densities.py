"""Densities in ``zeta``: a client's log-likelihood, the model with its globals set, the prior in
unconstrained space.

Each runs the user's model with handlers (``substitute`` the global sites' values ``theta(zeta)``,
mask the padded rows of the partition plate, ``block`` so nothing leaks into an outer ELBO): pure
functions of ``zeta`` and the data, traced inside the compiled steps.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
from numpyro.primitives import Messenger

from numpyro_pvi.model.sites import ModelSites
from numpyro_pvi.model.trace import site_log_prob


class PlateMask(Messenger):
    """Mask the sites inside plate ``plate`` with a ``(rows,)`` boolean ``mask`` (padding for
    ``vmap``)."""

    def __init__(
        self, fn: Callable | None = None, plate: str = "", mask: jax.Array | None = None
    ) -> None:
        self.plate, self.mask = plate, mask
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample" or self.mask is None:
            return
        for frame in msg["cond_indep_stack"]:
            if frame.name == self.plate:
                msg["fn"] = msg["fn"].mask(jnp.reshape(self.mask, (-1,) + (1,) * (-frame.dim - 1)))
                return


def log_likelihood(
    model: Callable,
    sites: ModelSites,
    zeta: jax.Array,
    args: tuple,
    kwargs: dict,
    mask: jax.Array | None = None,
    hyper: dict | tuple = (),
) -> jax.Array:
    """``log p(y_m | theta(zeta))`` of one client's rows: a scalar, masked rows contribute 0.

    :param hyper: unconstrained values of the hyperparameters (default: their initial values).
    """
    values = sites.values(zeta, hyper)
    masked = PlateMask(handlers.substitute(model, data=values), plate=sites.plate, mask=mask)
    # block *outside* trace: the inner sites must not leak into an outer ELBO
    with handlers.block():
        trace = handlers.trace(masked).get_trace(*args, **kwargs)
    return sum(site_log_prob(trace[name]) for name in sites.likelihoods)


def local_model(
    model: Callable,
    sites: ModelSites,
    zeta: jax.Array,
    args: tuple,
    kwargs: dict,
    mask: jax.Array | None = None,
    hyper: dict | tuple = (),
) -> None:
    """Run the model with its global sites set to ``theta(zeta)`` and its hyperparameters to
    ``hyper``.

    The global and param sites are hidden from outer handlers (their prior is the cavity's
    business), so an outer ELBO sees only the client's local latents and observations, masked rows
    weighing 0. Use it inside a tilted model whose ``_pvi_zeta`` site carries the cavity.
    """
    values = sites.values(zeta, hyper)
    hidden = [s.name for s in sites.globals] + [h.name for h in sites.hyper]
    hidden_model = handlers.block(handlers.substitute(model, data=values), hide=hidden)
    PlateMask(hidden_model, plate=sites.plate, mask=mask)(*args, **kwargs)


def log_prior(
    model: Callable,
    sites: ModelSites,
    zeta: jax.Array,
    args: tuple,
    kwargs: dict,
    names: Any = None,
) -> jax.Array:
    """``log p(theta(zeta)) + log|d theta / d zeta|``: the prior density in unconstrained space.

    :param names: restrict the sum to these global sites (default: all).
    """
    values = sites.unflatten(zeta)
    substituted = handlers.substitute(model, data=values)
    if sites.has_local:  # local latents are drawn (and ignored): they need a key
        substituted = handlers.seed(substituted, jax.random.PRNGKey(0))
    with handlers.block():
        trace = handlers.trace(substituted).get_trace(*args, **kwargs)
    total = 0.0
    for site, start in zip(sites.globals, np.cumsum([0] + [s.size for s in sites.globals])):
        if names is not None and site.name not in names:
            continue
        u = jnp.reshape(zeta[start : start + site.size], site.flat_shape)
        jac = site.transform.log_abs_det_jacobian(u, values[site.name])
        total = total + site_log_prob(trace[site.name]) + jnp.sum(jac)
    return total
