"""A Gaussian family's :class:`~numpyro_pvi.families.chain_moments.ChainMoments`: SNEP's cheap
O(D^2) estimator (:class:`GaussianChains`), and the matrix algebra in the family's form it needs
(:class:`WhitenedForm`)."""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from numpyro_pvi.families.chain_moments import TiltedMeanParams
from numpyro_pvi.families.params import NatParams


class WhitenedForm(Protocol):
    """What :class:`GaussianChains` needs of a Gaussian family beyond
    :class:`~numpyro_pvi.families.Family`: moments in the coordinates ``u`` whitened by a member,
    ``zeta = loc + L u``, and matrix algebra in the family's form. ``MeanFieldGaussian`` and
    ``FullRankGaussian`` implement it; nothing outside SNEP's Gaussian estimator calls it."""

    def whitened_to_nat(
        self, loc: jax.Array, scale: jax.Array, mean: jax.Array, cov: jax.Array
    ) -> NatParams:
        """Natural parameters (in ``zeta``) of the Gaussian with whitened ``mean`` and ``cov`` (in
        ``u``).

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> family = pvi.MeanFieldGaussian()  # zeta = 1 + 2 u; u ~ N(1, 1) is zeta ~ N(3, 4)
        >>> family.moments(
        ...     family.whitened_to_nat(jnp.ones(1), jnp.full(1, 2.0), jnp.ones(1), jnp.ones(1))
        ... )
        (Array([3.], dtype=float32), Array([4.], dtype=float32))
        """
        ...

    def nat_to_whitened(
        self, loc: jax.Array, scale: jax.Array, nat: NatParams
    ) -> tuple[jax.Array, jax.Array]:
        """Whitened mean and covariance of valid ``nat``: the inverse of :meth:`whitened_to_nat`.

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> family = pvi.MeanFieldGaussian()
        >>> nat = family.from_moments(jnp.array([3.0]), jnp.array([4.0]))
        >>> family.nat_to_whitened(jnp.ones(1), jnp.array([2.0]), nat)
        (Array([1.], dtype=float32), Array([1.], dtype=float32))
        """
        ...

    def matvec(self, matrix: jax.Array, v: jax.Array) -> jax.Array:
        """``M v`` for every row ``v`` of ``(..., D)``.

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.MeanFieldGaussian().matvec(jnp.array([2.0, 3.0]), jnp.ones((1, 2)))
        Array([[2., 3.]], dtype=float32)
        """
        ...

    def min_eig(self, matrix: jax.Array) -> jax.Array:
        """The smallest eigenvalue of a symmetric matrix in the family's form.

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.FullRankGaussian().min_eig(jnp.array([[2.0, 1.0], [1.0, 2.0]])).round(4)
        Array(1., dtype=float32)
        """
        ...

    def clamp_precision(
        self, nat: NatParams, low: float, high: float
    ) -> tuple[NatParams, jax.Array]:
        """``nat`` with its precision's eigenvalues clipped to ``[low, high]``, and whether any was.

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> from numpyro_pvi.families import NatParams
        >>> nat, clamped = pvi.MeanFieldGaussian().clamp_precision(
        ...     NatParams(jnp.zeros(2), jnp.array([-0.05, -1.0])), 0.5, 1.0
        ... )
        >>> nat.eta2, clamped
        (Array([-0.25, -0.5 ], dtype=float32), Array(True, dtype=bool))
        """
        ...


class GaussianChains:
    """:class:`~numpyro_pvi.families.chain_moments.ChainMoments` of one Gaussian family: moments in
    the coordinates ``u`` whitened by the visit's ``q`` (the frame ``(loc, L)``, ``zeta = loc + L
    u``), kept as mean parameters ``(E[u], E[u u^T])`` with the second moment in the family's form.

    The tilted moments come with zero-variance (Stein) control variates, ``E_p[u] = E_p[u + Sigma
    g]`` and ``E_p[(u - c)(u - c)^T] = Sigma + E_p[sym((u - c + Sigma g)(u - c)^T)]`` (``g`` the
    score, ``Sigma`` the current ``q``'s whitened covariance, ``c`` the previous step's mean
    estimate): unbiased for any ``Sigma``, exact when the tilted distribution is Gaussian with
    covariance ``Sigma``, and O(D^2) where a regression on the features would be O(D^4). An
    estimate whose covariance is not positive definite is not in the mean domain (the loop uses the
    plain moments). With ``site_variance = (v_min, v_max)`` a site's precision eigenvalues are
    clipped to ``[1 / v_max, 1 / v_min]`` after every step (the paper's projection).

    **Example:** chains of ``N(1, 1)`` (score ``1 - u``) with ``q``'s whitened covariance 1: the
    estimate is exact whatever the draws.

    .. doctest::

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> from numpyro_pvi.families import NatParams
        >>> family = pvi.MeanFieldGaussian()
        >>> chains = family.chain_moments(control_variates=True, site_variance=None)
        >>> u = jnp.array([[0.0], [3.0], [-1.0]])
        >>> mean = NatParams(jnp.ones(1), jnp.full(1, 2.0))  # E[u] = 1, E[u^2] = 2: variance 1
        >>> frame = (jnp.zeros(1), jnp.ones(1))
        >>> estimated = chains.tilted_mean_params(frame, (), u, 1.0 - u, mean, mean)
        >>> estimated.estimate, bool(estimated.in_domain)
        (NatParams(eta1=Array([1.], dtype=float32), eta2=Array([2.], dtype=float32)), True)
    """

    laplace_start = True

    def __init__(self, family: Any, control_variates: bool, site_variance: tuple | None) -> None:
        self.family, self.control_variates = family, control_variates
        self.site_variance = site_variance

    def _nat(self, frame: tuple, mean: jax.Array, cov: jax.Array) -> NatParams:
        return self.family.whitened_to_nat(*frame, mean, cov)

    def _second(self, mean: jax.Array, cov: jax.Array) -> NatParams:
        return NatParams(mean, cov + self.family.outer(mean, mean))

    def coefficients(self, frame: tuple, q: NatParams) -> tuple:
        """Nothing: the control variates' coefficient is the current ``q``'s covariance."""
        return ()

    def mean_params(self, frame: tuple, nat: NatParams) -> NatParams:
        """``(E[u], E[u u^T])`` of valid ``nat`` in the frame's whitened coordinates."""
        return self._second(*self.family.nat_to_whitened(*frame, nat))

    def from_mean_params(
        self, frame: tuple, mean: NatParams, start: NatParams
    ) -> tuple[NatParams, jax.Array]:
        """The Gaussian with these whitened moments (closed form) and whether it is valid."""
        family = self.family
        cov = family.sym(mean.eta2 - family.outer(mean.eta1, mean.eta1))
        nat = self._nat(frame, mean.eta1, cov)
        return nat, family.is_valid(nat)

    def tilted_mean_params(
        self,
        frame: tuple,
        coefficients: tuple,
        u: jax.Array,
        score: jax.Array,
        mean: NatParams,
        previous: NatParams,
    ) -> TiltedMeanParams:
        """The Stein-corrected moments (centred at ``previous``'s mean) and the plain ones."""
        family, n = self.family, u.shape[0]
        plain_mean = jnp.mean(u, axis=0)
        centred = u - plain_mean
        plain = self._second(plain_mean, family.outer_sum(centred, centred) / n)
        if not self.control_variates:
            return TiltedMeanParams(plain, plain, jnp.ones((), bool))
        cov_q = family.sym(mean.eta2 - family.outer(mean.eta1, mean.eta1))
        centre = previous.eta1
        shift = family.matvec(cov_q, score)
        cv_mean = jnp.mean(u + shift, axis=0)
        centred = u - centre
        second = cov_q + family.sym(family.outer_sum(centred + shift, centred)) / n
        cv_cov = family.sym(second - family.outer(cv_mean - centre, cv_mean - centre))
        ok = family.min_eig(cv_cov) > 0.0
        return TiltedMeanParams(self._second(cv_mean, cv_cov), plain, ok)

    def project(self, cavity: NatParams, nat: NatParams) -> tuple[NatParams, jax.Array]:
        """The site ``nat - cavity`` with its precision's eigenvalues clipped to ``[1 / v_max, 1 /
        v_min]`` (``site_variance``; none without it)."""
        if self.site_variance is None:
            return nat, jnp.zeros((), bool)
        v_min, v_max = self.site_variance
        site, clamped = self.family.clamp_precision(nat - cavity, 1.0 / v_max, 1.0 / v_min)
        return cavity + site, clamped
