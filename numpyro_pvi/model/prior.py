"""The prior in unconstrained space: an exact Gaussian part and, if needed, a prior factor ``t_0``.

A global site whose prior is Gaussian in unconstrained space with fixed parameters (``Normal`` on a
real site, ``LogNormal`` on a positive one, ``MultivariateNormal`` for full-rank) enters ``q``
exactly, as ``lambda_0``. Every other prior (``HalfNormal``, ``Gamma``, a hierarchical ``Normal(0,
sigma)``...) is represented by one more factor ``t_0``, fitted like a client by the natural-gradient
(CVI) fixed point ``t_0 = grad_mu E_q[log p_z(zeta)]``: ``eta2 = E_q[H] / 2`` and ``eta1 = E_q[g] -
E_q[H] mu`` with ``g``, ``H`` the gradient and Hessian of the prior's log density in ``zeta``
(Jacobian included). The expectations use a fixed set of scrambled-Sobol standard-normal points, so
``t_0`` is a deterministic function of ``q``; ``E_q[H]`` is the Hessian itself for ``D <=
max_hessian_dim`` and otherwise comes from gradients alone by Stein's lemma. (Fitting ``t_0`` by
SVI-and-subtract is pure noise: shared/notes/environment.md §7.)

Which sites a family holds exactly, and how ``t_0``'s target is computed, are the family's methods
(``exact_prior``, ``prior_site``, ``standard_normal``): with :class:`~numpyro_pvi.SiteFamilies` a
Gaussian block gets its own ``t_0`` block for its non-Gaussian priors (the other blocks' ``t_0``
stay flat), and an exponential-family block's prior must be of its family.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import ndtri

from numpyro_pvi.families import FactorFamily, NatParams
from numpyro_pvi.model.sites import ModelSites


def exact_prior(
    family: FactorFamily, sites: ModelSites, log_density: Callable | None = None
) -> tuple[NatParams, tuple]:
    """``lambda_0`` over the sites with an exact prior in the family, and the names of the other
    sites.

    The family decides (``family.exact_prior``): a Gaussian block holds a site exactly when its
    prior is Gaussian in unconstrained space and fits the family (:meth:`Family.with_block
    <numpyro_pvi.families.Family.with_block>`: a full-covariance prior is not mean-field), and
    leaves the others to the prior factor ``t_0``; an exponential-family block reads its prior off
    the prior's log density (``ValueError`` if it is not of the family). ``log_density(zeta,
    names)`` is the prior's log density in ``zeta`` of the sites ``names``.

    **Example:** ``lambda_0, rest = exact_prior(pvi.MeanFieldGaussian(), sites)``
    """

    def prior_values(names: tuple) -> tuple[jax.Array, jax.Array]:
        if log_density is None:
            raise TypeError(
                "exact_prior: an exponential-family block needs the prior's log_density."
            )

        def values() -> tuple[jax.Array, jax.Array]:
            points = family.reference_draws(sites.dim)
            return jax.vmap(lambda z: log_density(z, names))(points), points

        # the draws and the density in one compiled program (eagerly, each operation of the draws
        # compiles one in a fresh process)
        return jax.jit(values)()

    return family.exact_prior(sites, prior_values)


class PriorFactor:
    """The natural-gradient fixed point for the prior factor ``t_0`` of the non-Gaussian prior
    sites.

    :param family: the family of ``q`` (a Gaussian, or a :class:`~numpyro_pvi.SiteFamilies` whose
        blocks holding these sites are Gaussian).
    :param log_density: ``zeta -> log p_rest(theta(zeta)) + log|J|`` over the non-Gaussian sites.
    :param rest_mask: ``(D,)`` boolean, the coordinates of the non-Gaussian sites.
    :param seed: seed of the scrambled Sobol points.
    :param num_points: number of points.
    :param max_hessian_dim: largest ``D`` for which Hessians are computed; above it, Stein's lemma.
    """

    def __init__(
        self,
        family: FactorFamily,
        log_density: Callable,
        rest_mask: jax.Array,
        seed: int = 0,
        num_points: int = 1024,
        max_hessian_dim: int = 256,
    ) -> None:
        self.family, self.log_density = family, log_density
        self.rest_mask = np.asarray(rest_mask)
        dim = self.rest_mask.shape[0]
        # imported here: scipy.stats takes 0.3-0.4 s to import, which every process that imports
        # numpyro_pvi would pay (a Ray actor, a Flower site), and only non-Gaussian priors use it
        from scipy.stats import qmc

        uniform = qmc.Sobol(dim, scramble=True, seed=seed).random(num_points)
        self.eps = jnp.asarray(
            ndtri(np.clip(uniform, 1e-12, 1 - 1e-12)), dtype=jnp.result_type(float)
        )
        self.use_hessian = dim <= max_hessian_dim

    def target(self, q: NatParams) -> NatParams:
        """``grad_mu E_q[log p_rest]`` (``family.prior_site``): ``t_0`` at a fixed point, given
        ``q``."""
        return self.family.prior_site(
            q, self.eps, self.log_density, self.rest_mask, self.use_hessian
        )

    def initial(self, prior: NatParams, num_iters: int = 50, step_size: float = 0.5) -> NatParams:
        """``t_0`` fitted to the prior alone (``q = lambda_0 t_0``), from ``N(0, 1)`` on the other
        coordinates."""
        unit = self.family.standard_normal(self.rest_mask)

        def body(t0: NatParams, _: None) -> tuple[NatParams, None]:
            new = self.target(prior + t0)
            return t0 + step_size * (new - t0), None

        t0, _ = jax.lax.scan(body, unit, None, length=num_iters)
        return t0
