"""Gaussian families over the flat unconstrained vector ``zeta`` (size ``D``), in natural
parameters.

A Gaussian ``N(mu, Lambda^{-1})`` has natural parameters ``eta1 = Lambda mu`` and
``eta2 = -Lambda / 2``. Products and quotients of factors are sums and differences of natural
parameters, so ``q = prior + sum_m t_m`` and ``cavity_m = q - t_m``; damping is a convex
combination. ``MeanFieldGaussian`` stores ``eta2`` as the ``(D,)`` diagonal, ``FullRankGaussian``
as a ``(D, D)`` matrix. Factors ``t_m`` may be improper; ``q`` and every cavity must be valid
(positive definite), which ``is_valid`` checks.

Beyond the Gaussians: :mod:`~numpyro_pvi.families.exponential` (``Gamma``, ``Beta``, ``Dirichlet``
in a site's own space) and :class:`SiteFamilies` (a family per site; ``q`` block-diagonal), which
implement the smaller :class:`FactorFamily` contract.

:class:`Family` is the contract both Gaussians implement (siblings: neither subclasses the other);
all family algebra (moments, densities, whitening, sites) lives in the family classes, so a new
family is one new class.
"""

from numpyro_pvi.families.block_distribution import BlockDistribution
from numpyro_pvi.families.exponential import Beta, Dirichlet, ExponentialFamily, Gamma
from numpyro_pvi.families.factor import FactorFamily
from numpyro_pvi.families.full_rank import FullRankGaussian
from numpyro_pvi.families.gaussian import expected_site
from numpyro_pvi.families.mean_field import MeanFieldGaussian
from numpyro_pvi.families.mean_params import MeanParamFamily
from numpyro_pvi.families.params import Marginals, NatParams
from numpyro_pvi.families.protocol import Family
from numpyro_pvi.families.site_families import SiteFamilies

__all__ = [
    "Beta",
    "BlockDistribution",
    "Dirichlet",
    "ExponentialFamily",
    "FactorFamily",
    "Family",
    "FullRankGaussian",
    "Gamma",
    "Marginals",
    "MeanFieldGaussian",
    "MeanParamFamily",
    "NatParams",
    "SiteFamilies",
    "expected_site",
]
