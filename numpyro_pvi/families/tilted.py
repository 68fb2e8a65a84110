"""The client's guide against its cavity: how ``GradientUpdate`` asks a family for its tilted model
and guide.

Every :class:`~numpyro_pvi.families.FactorFamily` gives ``GradientUpdate`` a guide through its four
guide methods (``guide_params``, ``params_distribution``, ``guide``, ``from_guide``): the cavity and
``q`` are converted independently. A family may instead parameterise the client's guide *relative to
the cavity* (:class:`CavityGuideFamily`), e.g. :class:`~numpyro_pvi.FullRankGaussian`, whose guide
whitened by the cavity's precision makes each SVI step ``O(D^2)``
(:mod:`numpyro_pvi.families.whitened`). The four functions below are what ``GradientUpdate`` calls;
they use the family's cavity-relative methods when it has them and its plain guide methods
otherwise.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpyro.distributions as dist

from numpyro_pvi.families.params import NatParams


@runtime_checkable
class CavityGuideFamily(Protocol):
    """A family whose ``GradientUpdate`` guide is parameterised relative to the client's cavity.

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> from numpyro_pvi.families.tilted import CavityGuideFamily
        >>> [
        ...     isinstance(f, CavityGuideFamily)
        ...     for f in (pvi.FullRankGaussian(), pvi.MeanFieldGaussian())
        ... ]
        [True, False]
    """

    def tilted_params(self, cavity: NatParams, q: NatParams) -> tuple[Any, Any]:
        """``(cavity_params, guide_params)``: the cavity's and the guide's initial (``q``'s)
        parameters."""
        ...

    def cavity_distribution(self, cavity_params: Any) -> dist.Distribution:
        """The cavity as a distribution over ``zeta`` (the tilted model's prior)."""
        ...

    def cavity_guide(self, prefix: str, cavity_params: Any, params: Any) -> dist.Distribution:
        """Register ``numpyro.param`` sites ``prefix...`` initialised at ``params``; the guide's
        distribution."""
        ...

    def from_cavity_guide(self, prefix: str, cavity_params: Any, values: dict) -> NatParams:
        """Natural parameters from the constrained values of the sites :meth:`cavity_guide`
        registered."""
        ...


def tilted_params(family: Any, cavity: NatParams, q: NatParams) -> tuple[Any, Any]:
    """``(cavity_params, guide_params)`` of a client: the tilted model's and the guide's (initial)
    parameters.

    Under ``jax.vmap`` over clients with ``q`` shared, what depends on ``q`` alone is computed once.

    **Example:** ``cavity_params, q_params = tilted_params(family, q - t_m, q)``.
    """
    if isinstance(family, CavityGuideFamily):
        return family.tilted_params(cavity, q)
    return family.guide_params(cavity), family.guide_params(q)


def cavity_distribution(family: Any, cavity_params: Any) -> dist.Distribution:
    """The cavity as the tilted model's prior of ``zeta``, from ``tilted_params(...)[0]``.

    **Example:** ``numpyro.sample("zeta", cavity_distribution(family, cavity_params))``.
    """
    if isinstance(family, CavityGuideFamily):
        return family.cavity_distribution(cavity_params)
    return family.params_distribution(cavity_params)


def client_guide(family: Any, prefix: str, cavity_params: Any, params: Any) -> dist.Distribution:
    """The client's guide of ``zeta``, its ``numpyro.param`` sites named ``prefix...`` and
    initialised at ``params``.

    **Example:** ``numpyro.sample("zeta", client_guide(family, "_pvi_", cavity_params, q_params))``.
    """
    if isinstance(family, CavityGuideFamily):
        return family.cavity_guide(prefix, cavity_params, params)
    return family.guide(prefix, params)


def from_client_guide(family: Any, prefix: str, cavity_params: Any, values: dict) -> NatParams:
    """The natural parameters of the guide at the constrained parameter ``values`` (a dict of
    sites).

    **Example:** ``q_new = from_client_guide(family, "_pvi_", cavity_params,
    svi.get_params(svi_state))``.
    """
    if isinstance(family, CavityGuideFamily):
        return family.from_cavity_guide(prefix, cavity_params, values)
    return family.from_guide(prefix, values)
