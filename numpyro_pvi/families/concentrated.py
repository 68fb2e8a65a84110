"""Gamma, Beta and Dirichlet densities and entropies that stay accurate at any concentration.

NumPyro's closed forms (``lgamma(a) + (1 - a) digamma(a) + ...``) subtract terms of size ``a log a``
whose difference is of order ``log a``: in float32, at a concentration of ``1e7`` the entropy of a
Gamma is off by 10 nats, at ``1e10`` by thousands (and differently inside and outside ``jit``), and
``log_prob`` of the distribution's own draws likewise. A collapsed ``q`` (a Gamma block with a tiny
sd) then reports an ELBO far above ``log p(y)``. The forms here cancel the large terms analytically:
with Stirling's remainder ``s(a) = lgamma(a) - (a - 1/2) log a + a - log(2 pi) / 2`` and the digamma
remainder ``r(a) = log a - 1 / (2a) - digamma(a)`` (both ``O(1/a)``, by their asymptotic series for
large ``a``), the Dirichlet entropy is

``H = sum_i log(a_i) / 2 + (1/2 - K) log a_0 + (K - 1) log(2 pi) / 2 + (K - 1) / 2 + K / (2 a_0)
- sum_i 1 / (2 a_i) + sum_i s(a_i) - s(a_0) + sum_i (a_i - 1) r(a_i) - (a_0 - K) r(a_0)``

(the Beta is ``K = 2``), and the log density is written in ``u_i = x_i / m_i - 1`` around the mean
``m`` (``log1pmx(u) = log(1 + u) - u``): ``log p(x) = sum_i [(a_i - 1) log1pmx(u_i) - u_i] - H_0``
with ``H_0`` the ``a``-only terms. The Gamma is the same with one coordinate and the rate's ``log
b``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.scipy.special import digamma, gammaln

HALF_LOG_2PI = 0.5 * np.log(2.0 * np.pi)
SERIES_FROM = 10.0  # from here on, the remainders by their series (truncation below 1e-12 at 10)
# |u| below which log1p(u) - u by its series (to u^8: relative error below 1e-13)
LOG1PMX_SERIES_BELOW = 1e-2


def stirling_remainder(a: jax.Array) -> jax.Array:
    """``lgamma(a) - (a - 1/2) log a + a - log(2 pi) / 2`` (about ``1 / (12 a)``), accurate for
    every ``a > 0``.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_pvi.families.concentrated import stirling_remainder
        >>> round(float(stirling_remainder(jnp.array(1e8))) * 12e8, 6)
        1.0
    """
    big = jnp.maximum(a, SERIES_FROM)
    inv, inv2 = 1.0 / big, 1.0 / big**2
    series = inv * (
        1.0 / 12 - inv2 * (1.0 / 360 - inv2 * (1.0 / 1260 - inv2 * (1.0 / 1680 - inv2 / 1188)))
    )
    small = jnp.minimum(a, SERIES_FROM)
    direct = gammaln(small) - (small - 0.5) * jnp.log(small) + small - HALF_LOG_2PI
    return jnp.where(a >= SERIES_FROM, series, direct)


def digamma_remainder(a: jax.Array) -> jax.Array:
    """``log a - 1 / (2a) - digamma(a)`` (about ``1 / (12 a^2)``), accurate for every ``a > 0``."""
    big = jnp.maximum(a, SERIES_FROM)
    inv2 = 1.0 / big**2
    series = inv2 * (
        1.0 / 12 - inv2 * (1.0 / 120 - inv2 * (1.0 / 252 - inv2 * (1.0 / 240 - inv2 / 132)))
    )
    small = jnp.minimum(a, SERIES_FROM)
    direct = jnp.log(small) - 0.5 / small - digamma(small)
    return jnp.where(a >= SERIES_FROM, series, direct)


# shapes from which d x / d a is Wilson-Hilferty's (relative error 4e-7 at 1e4)
GAMMA_GRAD_SERIES_BELOW = 1e4


def gamma_sample_grad(concentration: jax.Array, value: jax.Array) -> jax.Array:
    """``d x / d a`` of a ``Gamma(a, 1)`` draw ``x`` at a fixed quantile (implicit
    reparameterisation), at any ``a``.

    ``jax.lax.random_gamma_grad`` sums a series in a ``while_loop`` with no bound on its iterations;
    in float32 its counter ``a + n`` stops growing once ``a > 2**24`` and the loop never ends (a
    collapsed Gamma block, shape ``9e9``: issue 23, sweep cell 3). From ``a = 1e4`` on, this is the
    derivative of the Wilson-Hilferty quantile ``x = a s^3``, ``s = 1 - 1 / (9a) + z / (3 sqrt(a))``
    at fixed ``z``: ``s^3 + s^2 (1 / (6a) - 3 (s - 1) / 2)``, with ``s = (x / a)^(1/3)`` (relative
    error ``O(a^-1.5)``: measured against ``random_gamma_grad`` in float64 over 2000 draws,
    ``4.7e-4`` at ``a = 100``, ``4.2e-7`` at ``1e4``); below it, ``random_gamma_grad`` (whose series
    then ends).

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_pvi.families.concentrated import gamma_sample_grad
        >>> round(
        ...     float(gamma_sample_grad(jnp.array(9.2e9), jnp.array(9.2e9))), 6
        ... )  # returns (and is ~1)
        1.0
    """
    big = concentration >= GAMMA_GRAD_SERIES_BELOW
    a, x = jnp.broadcast_arrays(concentration, value)
    series = jax.lax.random_gamma_grad(jnp.where(big, 1.0, a), jnp.where(big, 1.0, x))
    a_big = jnp.where(big, a, GAMMA_GRAD_SERIES_BELOW)
    s_minus_1 = jnp.expm1(jnp.log1p((jnp.where(big, x, a_big) - a_big) / a_big) / 3.0)
    s = 1.0 + s_minus_1
    wilson_hilferty = s**3 + s**2 * (1.0 / (6.0 * a_big) - 1.5 * s_minus_1)
    return jnp.where(big, wilson_hilferty, series)


def gamma_draws(rng_key: jax.Array, concentration: jax.Array, shape: tuple) -> jax.Array:
    """``Gamma(concentration, 1)`` draws of ``shape`` whose derivative in the concentration is
    :func:`gamma_sample_grad` (``jax.random.gamma``'s own derivative may never return at a large
    shape).

    The derivative is a custom JVP, computed only where one is taken: a program that only draws
    (a free energy, an ELBO term) holds no copy of ``random_gamma_grad``'s two series loops (in a
    Gamma CVI round, 8 of its 9 copies and half of XLA's kernels)."""
    a = jnp.broadcast_to(concentration, shape)
    return _gamma_slope_attached(a, jax.random.gamma(rng_key, jax.lax.stop_gradient(a), shape))


@jax.custom_jvp
def _gamma_slope_attached(concentration: jax.Array, draws: jax.Array) -> jax.Array:
    """``draws``, whose tangent is ``gamma_sample_grad(concentration, draws)`` times the
    concentration's (the draws' own tangent is zero: they are drawn at a stopped concentration)."""
    return draws


@_gamma_slope_attached.defjvp
def _gamma_slope_jvp(primals: tuple, tangents: tuple) -> tuple:
    concentration, draws = primals
    slope = jax.lax.stop_gradient(gamma_sample_grad(concentration, draws))
    return draws, slope * tangents[0]


def log1pmx(u: jax.Array) -> jax.Array:
    """``log(1 + u) - u`` without cancellation for small ``|u|``."""
    tiny = jnp.clip(u, -LOG1PMX_SERIES_BELOW, LOG1PMX_SERIES_BELOW)
    series = tiny**2 * (
        -1.0 / 2
        + tiny
        * (
            1.0 / 3
            + tiny * (-1.0 / 4 + tiny * (1.0 / 5 + tiny * (-1.0 / 6 + tiny * (1.0 / 7 - tiny / 8))))
        )
    )
    wide = jnp.where(jnp.abs(u) < LOG1PMX_SERIES_BELOW, 1.0, u)
    return jnp.where(jnp.abs(u) < LOG1PMX_SERIES_BELOW, series, jnp.log1p(wide) - wide)


def _deviation_terms(concentration: jax.Array, u: jax.Array) -> jax.Array:
    """``(a - 1) log1pmx(u) - u`` elementwise (0 where ``a == 1``, also at ``u = -1``)."""
    shape = concentration - 1.0
    return jnp.where(shape == 0, 0.0, shape * log1pmx(u)) - u


def dirichlet_entropy(concentration: jax.Array) -> jax.Array:
    """Entropy of ``Dirichlet(concentration)`` over the last axis (see the module docstring)."""
    a = concentration
    k = a.shape[-1]
    a0 = jnp.sum(a, axis=-1)
    return (
        0.5 * jnp.sum(jnp.log(a), axis=-1)
        + (0.5 - k) * jnp.log(a0)
        + (k - 1) * (HALF_LOG_2PI + 0.5)
        + 0.5 * k / a0
        - 0.5 * jnp.sum(1.0 / a, axis=-1)
        + jnp.sum(stirling_remainder(a), axis=-1)
        - stirling_remainder(a0)
        + jnp.sum((a - 1.0) * digamma_remainder(a), axis=-1)
        - (a0 - k) * digamma_remainder(a0)
    )


def _dirichlet_log_normalizer(a: jax.Array) -> jax.Array:
    """``sum_i (a_i - 1) log m_i - log B(a)`` (``m = a / a_0``): the log density at the mean, less
    its deviation."""
    k = a.shape[-1]
    a0 = jnp.sum(a, axis=-1)
    return (
        -0.5 * jnp.sum(jnp.log(a), axis=-1)
        + (k - 0.5) * jnp.log(a0)
        - (k - 1) * HALF_LOG_2PI
        - jnp.sum(stirling_remainder(a), axis=-1)
        + stirling_remainder(a0)
    )


def dirichlet_log_prob(concentration: jax.Array, value: jax.Array) -> jax.Array:
    """``log Dirichlet(value | concentration)`` over the last axis, written around the mean."""
    a = concentration
    u = value * (jnp.sum(a, axis=-1, keepdims=True) / a) - 1.0
    return jnp.sum(_deviation_terms(a, u), axis=-1) + _dirichlet_log_normalizer(a)


def gamma_entropy(concentration: jax.Array, rate: jax.Array) -> jax.Array:
    """Entropy of ``Gamma(concentration, rate)``, elementwise."""
    a = concentration
    return (
        0.5 * jnp.log(a)
        + HALF_LOG_2PI
        + 0.5
        - 0.5 / a
        + stirling_remainder(a)
        + (a - 1.0) * digamma_remainder(a)
        - jnp.log(rate)
    )


def gamma_log_prob(concentration: jax.Array, rate: jax.Array, value: jax.Array) -> jax.Array:
    """``log Gamma(value | concentration, rate)``, elementwise, written around the mean ``a /
    b``."""
    a = concentration
    u = value * (rate / a) - 1.0
    return (
        _deviation_terms(a, u)
        + jnp.log(rate)
        - 0.5 * jnp.log(a)
        - HALF_LOG_2PI
        - stirling_remainder(a)
    )


class ConcentratedGamma(dist.Gamma):
    """``dist.Gamma`` whose ``log_prob`` and ``entropy`` stay accurate at any concentration (module
    docstring).

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_pvi.families.concentrated import ConcentratedGamma
        >>> round(
        ...     float(ConcentratedGamma(jnp.array(1e10), 1e10).entropy()), 2
        ... )  # a Normal with sd 1e-5
        -10.09
    """

    def sample(self, key: jax.Array, sample_shape: tuple = ()) -> jax.Array:
        """Draws whose derivative in the concentration returns at any shape
        (:func:`gamma_draws`)."""
        shape = sample_shape + self.batch_shape + self.event_shape
        return gamma_draws(key, self.concentration, shape) / self.rate

    def log_prob(self, value: jax.Array) -> jax.Array:
        return gamma_log_prob(self.concentration, self.rate, value)

    def entropy(self) -> jax.Array:
        return gamma_entropy(self.concentration, self.rate)


class ConcentratedBeta(dist.Beta):
    """``dist.Beta`` whose ``log_prob`` and ``entropy`` stay accurate at any concentration (a
    Dirichlet of 2).

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_pvi.families.concentrated import ConcentratedBeta
        >>> round(
        ...     float(ConcentratedBeta(jnp.array(3e9), 7e9).entropy()), 2
        ... )  # a Normal with sd 4.6e-6
        -10.87
    """

    def _stacked(self) -> jax.Array:
        a, b = jnp.broadcast_arrays(self.concentration1, self.concentration0)
        return jnp.stack([a, b], axis=-1)

    def log_prob(self, value: jax.Array) -> jax.Array:
        return dirichlet_log_prob(self._stacked(), jnp.stack([value, 1.0 - value], axis=-1))

    def entropy(self) -> jax.Array:
        return dirichlet_entropy(self._stacked())


class ConcentratedDirichlet(dist.Dirichlet):
    """``dist.Dirichlet`` whose ``log_prob`` and ``entropy`` stay accurate at any concentration.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp, numpyro.distributions as dist
        >>> from numpyro_pvi.families.concentrated import ConcentratedDirichlet
        >>> alpha = jnp.array([2.0, 3.0, 5.0])
        >>> (
        ...     round(float(ConcentratedDirichlet(alpha).entropy()), 4),
        ...     round(float(dist.Dirichlet(alpha).entropy()), 4),
        ... )
        (-1.4612, -1.4612)
    """

    def log_prob(self, value: jax.Array) -> jax.Array:
        return dirichlet_log_prob(self.concentration, value)

    def entropy(self) -> jax.Array:
        return dirichlet_entropy(self.concentration)
