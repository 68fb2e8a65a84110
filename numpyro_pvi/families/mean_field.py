"""``MeanFieldGaussian``: diagonal Gaussians; every matrix in its form is a ``(D,)`` diagonal."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints

from numpyro_pvi.families.gaussian import GaussianFamily
from numpyro_pvi.families.protocol import Marginals, NatParams
from numpyro_pvi.families.reparameterised import MeanFieldParameters


class MeanFieldGaussian(GaussianFamily):
    """Diagonal Gaussian factors and approximation, like ``AutoDiagonalNormal``.

    The client guide is ``Normal(loc, scale).to_event(1)`` with ``scale`` constrained
    ``softplus_positive``, as in NumPyro's ``AutoNormal`` / ``AutoDiagonalNormal``. Every matrix
    (``eta2``, a precision, a covariance) is stored as its ``(D,)`` diagonal. Implements
    :class:`~numpyro_pvi.families.Family`.

    **Example:** ``pvi.PVI(model, family=pvi.MeanFieldGaussian(), ...)``

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_pvi import MeanFieldGaussian
        >>> family = MeanFieldGaussian()
        >>> q = family.from_moments(jnp.array([1.0, 2.0]), jnp.array([4.0, 0.25]))
        >>> family.precision(q), family.moments(q)[1]
        (Array([0.25, 4.  ], dtype=float32), Array([4.  , 0.25], dtype=float32))
    """

    scale_name = "scale"
    scale_constraint = constraints.softplus_positive

    # ------------------------------------------------------------------ guide and core
    def zeros(self, dim: int) -> NatParams:
        """The flat factor ``t = 1``: natural parameters of shape ``(D,)``."""
        return NatParams(jnp.zeros(dim), jnp.zeros(dim))

    def is_valid(self, nat: NatParams) -> jax.Array:
        """Whether ``nat`` is a proper, finite Gaussian (all precisions positive)."""
        return (
            jnp.all(nat.eta2 < 0)
            & jnp.all(jnp.isfinite(nat.eta1))
            & jnp.all(jnp.isfinite(nat.eta2))
        )

    def precision(self, nat: NatParams) -> jax.Array:
        """Diagonal precision ``(D,)``."""
        return -2.0 * nat.eta2

    def from_mean_precision(self, loc: jax.Array, precision: jax.Array) -> NatParams:
        """From a mean ``(D,)`` and a diagonal precision ``(D,)``."""
        return NatParams(precision * loc, -0.5 * precision)

    def loc_scale(self, nat: NatParams) -> tuple[jax.Array, jax.Array]:
        """To ``(loc, scale)`` (valid natural parameters only)."""
        var = -0.5 / nat.eta2
        return var * nat.eta1, jnp.sqrt(var)

    def from_loc_scale(self, loc: jax.Array, scale: jax.Array) -> NatParams:
        """From the guide's ``(loc, scale)``."""
        return self.from_mean_precision(loc, 1.0 / scale**2)

    def distribution(self, loc: jax.Array, scale: jax.Array) -> dist.Distribution:
        """The NumPyro distribution over ``zeta`` with the guide's parameters."""
        return dist.Normal(loc, scale).to_event(1)

    # ------------------------------------------------------------------ moments
    def moments(self, nat: NatParams) -> tuple[jax.Array, jax.Array]:
        """Mean and variances ``(D,)``."""
        loc, scale = self.loc_scale(nat)
        return loc, scale**2

    def from_moments(self, mean: jax.Array, cov: jax.Array) -> NatParams:
        """From a mean and variances ``(D,)``."""
        return self.from_mean_precision(mean, 1.0 / cov)

    def from_dense_precision(self, mean: jax.Array, precision: jax.Array) -> NatParams:
        """Moment matching: ``N(mean, precision^{-1})``'s marginal variances (not the precision's
        diagonal)."""
        return self.from_mean_precision(mean, 1.0 / jnp.diagonal(jnp.linalg.inv(precision)))

    # ------------------------------------------------------------------ densities
    def quadratic(self, nat: NatParams, zeta: jax.Array) -> jax.Array:
        """``eta1 . zeta + sum_i eta2_i zeta_i^2``."""
        return nat.eta1 @ zeta + jnp.sum(nat.eta2 * zeta**2)

    def marginals(self, nat: Any) -> Marginals:
        """Means, variances and precisions in float64 numpy (NaN mean and variance where a precision
        is <= 0)."""
        eta1, eta2 = np.asarray(nat.eta1, dtype=np.float64), np.asarray(nat.eta2, dtype=np.float64)
        precision = -2.0 * eta2
        with np.errstate(divide="ignore", invalid="ignore"):
            var = np.where(precision > 0, 1.0 / precision, np.nan)
        return Marginals(var * eta1, var, precision)

    # ------------------------------------------------------------------ forms: (D,) diagonals
    def to_dense(self, matrix: jax.Array) -> jax.Array:
        """The diagonal matrix."""
        return jnp.diag(matrix)

    def from_dense(self, matrix: jax.Array) -> jax.Array:
        """The diagonal."""
        return jnp.diagonal(matrix)

    def identity(self, dim: int) -> jax.Array:
        """``(D,)`` ones."""
        return jnp.ones(dim)

    def outer(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """The diagonal of ``a b^T``: ``a * b``."""
        return a * b

    def outer_sum(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """``sum_i x_i * y_i`` over the rows."""
        return jnp.sum(x * y, axis=0)

    def sym(self, matrix: jax.Array) -> jax.Array:
        """A diagonal is symmetric."""
        return matrix

    def matvec(self, matrix: jax.Array, v: jax.Array) -> jax.Array:
        """``matrix * v``."""
        return v * matrix

    def min_eig(self, matrix: jax.Array) -> jax.Array:
        """The smallest diagonal entry."""
        return jnp.min(matrix)

    # ------------------------------------------------------------------ whitening: zeta = loc +
    # scale * u
    def unwhiten(self, loc: jax.Array, scale: jax.Array, u: jax.Array) -> jax.Array:
        """``loc + scale * u``."""
        return loc + u * scale

    def whiten(self, loc: jax.Array, scale: jax.Array, zeta: jax.Array) -> jax.Array:
        """``(zeta - loc) / scale``."""
        return (zeta - loc) / scale

    def whitened_to_nat(
        self, loc: jax.Array, scale: jax.Array, mean: jax.Array, cov: jax.Array
    ) -> NatParams:
        """``N(loc + scale * mean, scale^2 * cov)``."""
        return self.from_mean_precision(loc + scale * mean, 1.0 / (cov * scale**2))

    def nat_to_whitened(
        self, loc: jax.Array, scale: jax.Array, nat: NatParams
    ) -> tuple[jax.Array, jax.Array]:
        """``((mean - loc) / scale, (sd / scale)^2)``."""
        mean, sd = self.loc_scale(nat)
        return (mean - loc) / scale, (sd / scale) ** 2

    # ------------------------------------------------------------------ sites
    def stein_hessian(self, grads: jax.Array, eps: jax.Array, scale: jax.Array) -> jax.Array:
        """``E_q[Hessian]`` (its diagonal) from gradients at ``zeta = loc + scale * eps`` (Stein's
        lemma)."""
        return jnp.mean(grads * eps, axis=0) / scale

    def site_update(self, grad_mean: jax.Array, hess_mean: jax.Array, loc: jax.Array) -> NatParams:
        """The natural parameters ``grad_mu E_q[f]`` given ``E_q[grad f]``, ``E_q[hess f]`` and
        ``q``'s mean."""
        return NatParams(grad_mean - hess_mean * loc, 0.5 * hess_mean)

    def clamp_precision(
        self, nat: NatParams, low: float, high: float
    ) -> tuple[NatParams, jax.Array]:
        """``nat`` with its precisions clipped to ``[low, high]``, and whether any was."""
        precision = self.precision(nat)
        clipped = jnp.clip(precision, low, high)
        return NatParams(nat.eta1, -0.5 * clipped), jnp.any(clipped != precision)

    def with_block(self, precision: jax.Array, block: slice, values: jax.Array) -> jax.Array | None:
        """Set a diagonal block; ``None`` for a full ``(k, k)`` block, which a diagonal cannot
        hold."""
        if jnp.ndim(values) == 2:
            return None
        return precision.at[block].set(values)

    # ------------------------------------------------------------------ DP-SGD
    def reparameterised(self, dim: int) -> MeanFieldParameters:
        """DP-SGD's ``(loc, u)`` with each row's gradient norm in closed form
        (:class:`~numpyro_pvi.families.reparameterised.MeanFieldParameters`)."""
        return MeanFieldParameters(self)
