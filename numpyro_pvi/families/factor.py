"""The contract of every family of factors: :class:`FactorFamily` (the Gaussian :class:`Family` extends it)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import numpyro.distributions as dist

from numpyro_pvi.families.params import Marginals, NatParams


@runtime_checkable
class FactorFamily(Protocol):
    """What every family of factors implements: what PVI, the servers, the merge and ``GradientUpdate`` use.

    :class:`Family` (the Gaussian families) extends it with Gaussian algebra (whitening, forms, sites)
    that EP, SNEP and the Gaussian CVI path need. The exponential families in a site's own space
    (:class:`~numpyro_pvi.Gamma`, :class:`~numpyro_pvi.Beta`, :class:`~numpyro_pvi.Dirichlet`) and
    :class:`~numpyro_pvi.SiteFamilies` implement this contract only.

    * **Core**: :meth:`zeros`, :meth:`is_valid`, :meth:`to_dist`, :meth:`marginals`, :meth:`prepare_sites`.
    * **Guide** (``GradientUpdate``): :meth:`guide_params`, :meth:`params_distribution`, :meth:`guide`,
      :meth:`from_guide`.
    * **Natural-gradient site** (CVI): :meth:`draw`, :meth:`site_from_draws`.
    * **Moment matching** (EP): :meth:`match_moments`.

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> from numpyro_pvi.families import FactorFamily
        >>> isinstance(pvi.Gamma(), FactorFamily), isinstance(pvi.MeanFieldGaussian(), FactorFamily)
        (True, True)
    """

    def zeros(self, dim: int) -> NatParams:
        """The flat factor ``t = 1``."""
        ...

    def is_valid(self, nat: NatParams) -> jax.Array:
        """Whether ``nat`` is a proper, finite member of the family."""
        ...

    def to_dist(self, nat: NatParams) -> dist.Distribution:
        """``q`` as a NumPyro distribution over the flat vector ``zeta``."""
        ...

    def marginals(self, nat: Any) -> Marginals:
        """Per-coordinate means, variances (NaN where improper) and a precision-like diagonal, float64 numpy."""
        ...

    def prepare_sites(self, sites: Any) -> Any:
        """The model's sites as this family lays them out (sites in their own space get an identity transform).

        Called once per problem; raises ``ValueError`` if a site does not fit the family.
        """
        ...

    def guide_params(self, nat: NatParams) -> Any:
        """The guide's (constrained) parameters of valid ``nat``: a pytree."""
        ...

    def params_distribution(self, params: Any) -> dist.Distribution:
        """The distribution over ``zeta`` with guide parameters ``params``."""
        ...

    def guide(self, prefix: str, params: Any) -> dist.Distribution:
        """Register ``numpyro.param`` sites named ``prefix...`` initialised at ``params``; their distribution."""
        ...

    def from_guide(self, prefix: str, values: dict) -> NatParams:
        """Natural parameters from the constrained values of the sites :meth:`guide` registered."""
        ...

    def draw(self, nat: NatParams, rng_key: jax.Array, pairs: int) -> jax.Array:
        """``2 * pairs`` draws ``(2 pairs, D)`` of valid ``nat`` (antithetic where the family allows)."""
        ...

    def site_from_draws(self, nat: NatParams, zeta: jax.Array, values: jax.Array, grads: jax.Array,
                        hessians: jax.Array | None) -> NatParams:
        """``grad_mu E_q[f]`` (natural parameters) from draws ``zeta`` of ``q``, ``f``'s values ``(S,)``, its
        gradients ``(S, D)`` and, if computed, Hessians ``(S, D, D)``."""
        ...

    def match_moments(self, proposal: NatParams, zeta: jax.Array, weights: jax.Array) -> NatParams:
        """The member whose sufficient statistics' means match the weighted draws ``zeta`` ``(S, D)`` of
        ``proposal`` (self-normalised ``weights`` ``(S,)``), with ``proposal``'s exact moments as control
        variate: uniform weights give ``proposal`` itself (EP is exact when the tilted distribution is in
        the family)."""
        ...
