"""Gaussian families over the flat unconstrained vector ``zeta`` (size ``D``), in natural parameters.

A Gaussian ``N(mu, Lambda^{-1})`` has natural parameters ``eta1 = Lambda mu`` and
``eta2 = -Lambda / 2``. Products and quotients of factors are sums and differences of natural
parameters, so ``q = prior + sum_m t_m`` and ``cavity_m = q - t_m``; damping is a convex
combination. ``MeanFieldGaussian`` stores ``eta2`` as the ``(D,)`` diagonal, ``FullRankGaussian``
as a ``(D, D)`` matrix. Factors ``t_m`` may be improper; ``q`` and every cavity must be valid
(positive definite), which ``is_valid`` checks.

:class:`Family` is the contract both implement (siblings: neither subclasses the other); all family
algebra (moments, densities, whitening, sites) lives in the family classes, so a new family is one
new class.
"""

from numpyro_pvi.families.full_rank import FullRankGaussian
from numpyro_pvi.families.gaussian import expected_site
from numpyro_pvi.families.mean_field import MeanFieldGaussian
from numpyro_pvi.families.protocol import Family, Marginals, NatParams

__all__ = ["Family", "FullRankGaussian", "Marginals", "MeanFieldGaussian", "NatParams", "expected_site"]
