"""The prior in unconstrained space: an exact Gaussian part and, if needed, a prior factor ``t_0``.

A global site whose prior is Gaussian in unconstrained space with fixed parameters (``Normal`` on a
real site, ``LogNormal`` on a positive one, ``MultivariateNormal`` for full-rank) enters ``q``
exactly, as ``lambda_0``. Every other prior (``HalfNormal``, ``Gamma``, a hierarchical
``Normal(0, sigma)``...) is represented by one more factor ``t_0``, fitted like a client by the
natural-gradient (CVI) fixed point ``t_0 = grad_mu E_q[log p_z(zeta)]``:
``eta2 = E_q[H] / 2`` and ``eta1 = E_q[g] - E_q[H] mu`` with ``g``, ``H`` the gradient and Hessian of
the prior's log density in ``zeta`` (Jacobian included). The expectations use a fixed set of
scrambled-Sobol standard-normal points, so ``t_0`` is a deterministic function of ``q``; ``E_q[H]`` is
the Hessian itself for ``D <= max_hessian_dim`` and otherwise comes from gradients alone by Stein's
lemma. (Fitting ``t_0`` by SVI-and-subtract is pure noise: shared/notes/environment.md §7.)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import ndtri
from scipy.stats import qmc

from numpyro_pvi.families import ExponentialFamily, FactorFamily, Family, NatParams, SiteFamilies, expected_site
from numpyro_pvi.families.exponential import regression_site
from numpyro_pvi.sites import ModelSites

NUM_PRIOR_DRAWS = 256  # draws at which an exponential-family block's prior is read off by least squares
PRIOR_RESIDUAL = 1e-3  # largest relative residual of that fit: above it, the prior is not of the family


def exact_prior(family: FactorFamily, sites: ModelSites,
                log_density: Callable | None = None) -> tuple[NatParams, tuple]:
    """``lambda_0`` over the sites with an exact prior in the family, and the names of the other sites.

    A site's Gaussian block is exact when the family can hold it (:meth:`Family.with_block
    <numpyro_pvi.families.Family.with_block>`: a full-covariance prior is not mean-field). For
    :class:`~numpyro_pvi.SiteFamilies` and the exponential families every block's prior must be exact
    (``ValueError`` otherwise); ``log_density(zeta, names)`` is the prior's log density in ``zeta``.
    """
    if isinstance(family, Family):
        return _gaussian_prior(family, sites)
    if isinstance(family, SiteFamilies):
        blocks = family.blocks
    else:
        blocks = ((family, 0, sites.dim, tuple(s.name for s in sites.globals)),)
    reference = jnp.concatenate([_reference_draws(f, b - a) for f, a, b, _ in blocks], axis=1)
    parts = []
    for block_family, a, b, names in blocks:
        if isinstance(block_family, ExponentialFamily):
            parts.append(_exponential_prior(block_family, names, reference, a, b, log_density))
            continue
        sub = replace(sites, globals=tuple(s for s in sites.globals if s.name in names))
        part, rest = _gaussian_prior(block_family, sub)
        if rest:
            raise ValueError(f"{family!r}: the prior of {list(rest)} is not Gaussian in unconstrained space "
                             "(Normal, LogNormal or MultivariateNormal with fixed parameters). With SiteFamilies "
                             "every block's prior must be exact in its family: give such a site its conjugate "
                             "family (e.g. pvi.Gamma() for a Gamma prior) or a Gaussian prior.")
        parts.append(part)
    if isinstance(family, SiteFamilies):
        return family.join(parts), ()
    return parts[0], ()


def _reference_draws(family: FactorFamily, dim: int) -> jax.Array:
    """``(NUM_PRIOR_DRAWS, dim)`` points in a block's space at which the prior is evaluated."""
    key = jax.random.PRNGKey(0)
    if isinstance(family, ExponentialFamily):
        params = [jnp.full((dim,), 2.0)] * len(family.param_names)
        return family.base(*params).sample(key, (NUM_PRIOR_DRAWS,))
    return jax.random.normal(key, (NUM_PRIOR_DRAWS, dim))


def _exponential_prior(family: ExponentialFamily, names: tuple, reference: jax.Array, start: int, stop: int,
                       log_density: Callable | None) -> NatParams:
    """The block's prior read off exactly (least squares on the sufficient statistics); ``ValueError`` if it is
    not of the family."""
    if log_density is None:
        raise TypeError("exact_prior: an exponential-family block needs the prior's log_density.")
    values = jax.jit(jax.vmap(lambda z: log_density(z, names)))(reference)
    stats = family.stats(reference[:, start:stop])
    coef = regression_site(stats, values)
    fitted = (stats - jnp.mean(stats, axis=0)) @ coef
    residual = np.max(np.abs(np.asarray(values - jnp.mean(values) - fitted)))
    if not np.isfinite(residual) or residual > PRIOR_RESIDUAL * (1.0 + float(np.std(np.asarray(values)))):
        raise ValueError(f"The prior of {list(names)} is not a {type(family).__name__} distribution with fixed "
                         f"parameters, which {family!r} needs (its prior enters q exactly). Use a "
                         f"{type(family).__name__} prior (it is conjugate), or a Gaussian family for this site.")
    dim = stop - start
    return NatParams(coef[:dim], coef[dim:])


def _gaussian_prior(family: Family, sites: ModelSites) -> tuple[NatParams, tuple]:
    slices = sites.slices()
    loc, precision = jnp.zeros(sites.dim), family.precision(family.zeros(sites.dim))
    rest = []
    for site in sites.globals:
        block = sites.gaussian_prior.get(site.name)
        embedded = None if block is None else family.with_block(precision, slices[site.name], block[1])
        if embedded is None:
            rest.append(site.name)
            continue
        loc, precision = loc.at[slices[site.name]].set(block[0]), embedded
    return family.from_mean_precision(loc, precision), tuple(rest)


class PriorFactor:
    """The natural-gradient fixed point for the prior factor ``t_0`` of the non-Gaussian prior sites.

    :param family: the Gaussian family of ``q``.
    :param log_density: ``zeta -> log p_rest(theta(zeta)) + log|J|`` over the non-Gaussian sites.
    :param rest_mask: ``(D,)`` boolean, the coordinates of the non-Gaussian sites.
    :param seed: seed of the scrambled Sobol points.
    :param num_points: number of points.
    :param max_hessian_dim: largest ``D`` for which Hessians are computed; above it, Stein's lemma.
    """

    def __init__(self, family: Family, log_density: Callable, rest_mask: jax.Array, seed: int = 0,
                 num_points: int = 1024, max_hessian_dim: int = 256) -> None:
        self.family = family
        self.rest_mask = jnp.asarray(rest_mask)
        dim = self.rest_mask.shape[0]
        uniform = qmc.Sobol(dim, scramble=True, seed=seed).random(num_points)
        self.eps = jnp.asarray(ndtri(np.clip(uniform, 1e-12, 1 - 1e-12)), dtype=jnp.result_type(float))
        self.grad = jax.vmap(jax.grad(log_density))
        self.hessian = jax.vmap(jax.hessian(log_density)) if dim <= max_hessian_dim else None

    def target(self, q: NatParams) -> NatParams:
        """``grad_mu E_q[log p_rest]``: the value ``t_0`` takes at a fixed point, given ``q``."""
        return expected_site(self.family, q, self.eps, self.grad, self.hessian)

    def initial(self, prior: NatParams, num_iters: int = 50, step_size: float = 0.5) -> NatParams:
        """``t_0`` fitted to the prior alone (``q = lambda_0 t_0``), from ``N(0, 1)`` on the other coordinates."""
        mask = self.rest_mask
        unit_precision = self.family.from_dense(jnp.diag(mask.astype(jnp.result_type(float))))
        unit = self.family.from_mean_precision(jnp.zeros(mask.shape), unit_precision)

        def body(t0: NatParams, _: None) -> tuple[NatParams, None]:
            new = self.target(prior + t0)
            return t0 + step_size * (new - t0), None

        t0, _ = jax.lax.scan(body, unit, None, length=num_iters)
        return t0
