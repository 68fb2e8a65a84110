"""The mean-parameter contract of a family, :class:`MeanParamFamily`: what SNEP needs beyond
:class:`FactorFamily`.

A member of an exponential family is ``q(theta) ∝ exp(eta . T(theta))`` (base measure 1 in the
block's own coordinates). Its **mean parameters** ``E_q[T]`` are kept in a pytree shaped like its
natural parameters (a :class:`~numpyro_pvi.families.NatParams` whose ``eta1`` holds ``E[T1]`` and
``eta2`` ``E[T2]``), so that a convex combination of mean parameters is ``NatParams`` arithmetic and
``eta . T`` pairs leaf by leaf:

================================  ======================================
================================== family                            ``T(theta)`` (as ``(eta1,
eta2)``)       chain coordinates ================================
======================================  ================================== ``MeanFieldGaussian``
``(zeta, zeta^2)``                       ``u = L^{-1}(zeta - mu)`` ``FullRankGaussian``
``(zeta, zeta zeta^T)``                  ``u = L^{-1}(zeta - mu)`` ``Gamma``
``(log theta, theta)``                   ``log theta``, standardised ``Beta``
``(log theta, log(1 - theta))``          ``logit theta``, standardised ``Dirichlet``
``(log theta, -)``                       stick-breaking, standardised ``SiteFamilies``
the blocks', block by block              the blocks', concatenated ================================
======================================  ==================================

The **chain coordinates** ``u`` are an unconstrained, standardised parameterisation of the block's
values in which an MCMC chain with a unit mass matrix fits ``q``:
:meth:`MeanParamFamily.chain_frame` reads the standardisation off ``q``,
:meth:`MeanParamFamily.from_chain` maps ``u`` to the values, with the log Jacobian, and
:meth:`MeanParamFamily.to_chain` back. A Dirichlet block of ``B`` simplices of ``K`` has ``B (K -
1)`` chain coordinates (:meth:`MeanParamFamily.chain_dim`). SNEP's loop
(:mod:`numpyro_pvi.local_updates.snep`) uses these and the family's estimator of a tilted
distribution's mean parameters from chains, :meth:`MeanParamFamily.chain_moments`
(:mod:`numpyro_pvi.families.chain_moments`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from numpyro_pvi.families.chain_moments import ChainMoments
from numpyro_pvi.families.params import NatParams


@runtime_checkable
class MeanParamFamily(Protocol):
    """The sufficient statistics, mean parameters and an MCMC parameterisation of a family's
    members.

    Implemented by the Gaussian families, :class:`~numpyro_pvi.families.ExponentialFamily`
    (``Gamma``, ``Beta``, ``Dirichlet``) and :class:`~numpyro_pvi.SiteFamilies` (block by block).

    **Example:** a Gamma's mean parameters ``(E[log theta], E[theta])`` and back.

    .. doctest::

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> from numpyro_pvi.families import MeanParamFamily
        >>> family = pvi.Gamma()
        >>> isinstance(family, MeanParamFamily), isinstance(pvi.FullRankGaussian(), MeanParamFamily)
        (True, True)
        >>> q = family.from_params(jnp.array([3.0]), jnp.array([2.0]))
        >>> family.mean_params(q).eta2  # E[theta] = 3 / 2
        Array([1.5], dtype=float32)
        >>> start = family.from_params(jnp.ones(1), jnp.ones(1))  # where the Newton inverse starts
        >>> [
        ...     round(float(p[0]), 3)
        ...     for p in family.to_params(family.from_mean_params(family.mean_params(q), start))
        ... ]
        [3.0, 2.0]
    """

    def log_factor(self, nat: NatParams, theta: jax.Array) -> jax.Array:
        """``eta . T(theta)`` of one point ``theta`` ``(D,)``: the log of the factor ``nat`` (may be
        improper)."""
        ...

    def mean_params(self, nat: NatParams) -> NatParams:
        """``E_q[T]`` of valid ``nat``, shaped like ``nat``."""
        ...

    def chain_mean_params(self, theta: jax.Array) -> NatParams:
        """The average of ``T`` over the rows of ``theta`` ``(C, D)``, shaped like natural
        parameters."""
        ...

    def from_mean_params(self, mean: NatParams, start: NatParams) -> NatParams:
        """The member with ``E[T] = mean`` (``start``: a valid member near it, where an iterative
        inverse begins)."""
        ...

    def chain_dim(self, dim: int) -> int:
        """The number of chain coordinates of a block of ``dim`` values."""
        ...

    def chain_frame(self, nat: NatParams) -> Any:
        """The standardisation of the chain coordinates for valid ``nat`` (a pytree of fixed
        shapes)."""
        ...

    def from_chain(self, frame: Any, u: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(theta, log |d theta / d u|)`` of chain coordinates ``u`` ``(chain_dim,)`` (up to a
        constant in ``u``)."""
        ...

    def to_chain(self, frame: Any, theta: jax.Array) -> jax.Array:
        """The chain coordinates ``(chain_dim,)`` of values ``theta`` ``(D,)``: the inverse of
        :meth:`from_chain`."""
        ...

    def chain_moments(self, control_variates: bool, site_variance: tuple | None) -> ChainMoments:
        """SNEP's estimator of a tilted distribution's mean parameters from chains in this family's
        coordinates, and its mirror map (:class:`~numpyro_pvi.families.chain_moments.ChainMoments`):
        a Gaussian's O(D^2) control variate, or Stein features regressed under ``q`` (the others).

        :param control_variates: Stein control variates (else the chains' plain averages).
        :param site_variance: ``(v_min, v_max)``, a clamp of a Gaussian site's covariance, or
            ``None``; ``ValueError`` for a family that has no such clamp.

        >>> import numpyro_pvi as pvi
        >>> pvi.Gamma().chain_moments(control_variates=True, site_variance=None).laplace_start
        False
        """
        ...
