"""Natural parameters (:class:`NatParams`) and per-coordinate summaries (:class:`Marginals`) of
every family."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np


class NatParams(NamedTuple):
    """Natural parameters of a Gaussian: ``eta1`` ``(..., D)`` and ``eta2`` in the family's form.

    ``eta2`` is ``(..., D)`` for ``MeanFieldGaussian`` and ``(..., D, D)`` for ``FullRankGaussian``,
    and a tuple of the blocks' ``eta2`` for :class:`~numpyro_pvi.SiteFamilies` (``eta1`` is always
    the flat ``(..., D)`` vector). They add and scale like vectors (``q - t_m`` is a cavity, ``q +
    rho * delta`` a damped update).

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_pvi import MeanFieldGaussian
        >>> q = MeanFieldGaussian().from_loc_scale(jnp.array([1.0]), jnp.array([2.0]))
        >>> q.eta1, q.eta2  # mu / sigma^2, -1 / (2 sigma^2)
        (Array([0.25], dtype=float32), Array([-0.125], dtype=float32))
    """

    eta1: jax.Array
    eta2: Any

    def __add__(self, other: NatParams) -> NatParams:  # type: ignore[override]
        return NatParams(
            self.eta1 + other.eta1, jax.tree.map(lambda a, b: a + b, self.eta2, other.eta2)
        )

    def __sub__(self, other: NatParams) -> NatParams:
        return NatParams(
            self.eta1 - other.eta1, jax.tree.map(lambda a, b: a - b, self.eta2, other.eta2)
        )

    def __mul__(self, rho: jax.Array | float) -> NatParams:  # type: ignore[override]
        return NatParams(rho * self.eta1, jax.tree.map(lambda a: rho * a, self.eta2))

    __rmul__ = __mul__


class Marginals(NamedTuple):
    """Per-coordinate summaries of a Gaussian in natural parameters, as float64 numpy arrays
    ``(D,)``.

    :ivar mean: the marginal means (NaN if the Gaussian is improper).
    :ivar variance: the marginal variances (NaN if improper).
    :ivar precision: the diagonal of the precision matrix (defined for improper factors too).

    **Example:**

    .. doctest::

        >>> import numpy as np
        >>> from numpyro_pvi import MeanFieldGaussian
        >>> from numpyro_pvi.families import NatParams
        >>> MeanFieldGaussian().marginals(NatParams(np.array([1.0, 1.0]), np.array([-0.5, 0.5])))
        Marginals(mean=array([ 1., nan]), variance=array([ 1., nan]), precision=array([ 1., -1.]))
    """

    mean: np.ndarray
    variance: np.ndarray
    precision: np.ndarray


class Proposal(NamedTuple):
    """Draws from an importance proposal: the family member with its moments (the control variate
    of :meth:`~numpyro_pvi.families.FactorFamily.match_moments`), the draws ``(S, D)`` and their log
    density ``(S,)`` up to a constant.

    **Example:** ``family.laplace_proposal(mode, precision, key, 512)`` (EP's proposal), or
    :func:`~numpyro_pvi.families.factor.member_proposal` of any member.
    """

    member: NatParams
    draws: jax.Array
    log_density: jax.Array
