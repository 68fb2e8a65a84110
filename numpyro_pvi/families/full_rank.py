"""``FullRankGaussian``: full-covariance Gaussians; every matrix in its form is ``(D, D)``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax.scipy.linalg import cho_solve, solve_triangular
from numpyro.distributions import constraints

from numpyro_pvi.families.gaussian import GaussianFamily
from numpyro_pvi.families.protocol import Marginals, NatParams
from numpyro_pvi.families.whitened import (
    CavityWhitenedNormal,
    PrecisionMultivariateNormal,
    inverse_tril,
    white_raw,
    white_tril,
)


def _sym(matrix: jax.Array) -> jax.Array:
    return 0.5 * (matrix + matrix.T)


def _inverse_tril(scale_tril: jax.Array) -> jax.Array:
    """``L^{-1}`` of a lower-triangular ``L``."""
    return solve_triangular(
        scale_tril, jnp.eye(scale_tril.shape[-1], dtype=scale_tril.dtype), lower=True
    )


class FullRankGaussian(GaussianFamily):
    """Full-covariance Gaussian factors and approximation, like ``AutoMultivariateNormal``.

    Its guide (:meth:`guide`) is ``MultivariateNormal(loc, scale_tril=L)`` with ``L`` constrained
    ``scaled_unit_lower_cholesky``, as in NumPyro's ``AutoMultivariateNormal``. ``GradientUpdate``'s
    client guide is instead whitened by the cavity
    (:class:`~numpyro_pvi.families.tilted.CavityGuideFamily`): ``zeta = loc + C^{-T} W^T eps`` with
    ``C C^T`` the cavity's precision and ``W`` lower triangular (``scaled_unit_lower_cholesky``), so
    that every SVI step costs ``O(D^2)`` and a client visit a few ``O(D^3)`` factorisations
    (:mod:`numpyro_pvi.families.whitened`). Every matrix is stored ``(D, D)``. Implements
    :class:`~numpyro_pvi.families.Family`.

    **Example:** ``pvi.PVI(model, family=pvi.FullRankGaussian(), ...)``

    .. doctest::

        >>> import jax.numpy as jnp, numpy as np
        >>> from numpyro_pvi import FullRankGaussian
        >>> family = FullRankGaussian()
        >>> q = family.from_moments(jnp.zeros(2), jnp.array([[2.0, 1.0], [1.0, 2.0]]))
        >>> np.asarray(family.precision(q), dtype=float).round(3).tolist()
        [[0.667, -0.333], [-0.333, 0.667]]
    """

    scale_name = "scale_tril"
    scale_constraint = constraints.scaled_unit_lower_cholesky

    # ------------------------------------------------------------------ guide and core
    def zeros(self, dim: int) -> NatParams:
        """The flat factor ``t = 1``: ``eta1`` ``(D,)``, ``eta2`` ``(D, D)``."""
        return NatParams(jnp.zeros(dim), jnp.zeros((dim, dim)))

    def is_valid(self, nat: NatParams) -> jax.Array:
        """Whether ``nat`` is a proper, finite Gaussian (precision matrix positive definite)."""
        chol = jnp.linalg.cholesky(self.precision(nat))
        return (
            jnp.all(jnp.isfinite(chol))
            & jnp.all(jnp.isfinite(nat.eta1))
            & jnp.all(jnp.diagonal(chol) > 0)
        )

    def precision(self, nat: NatParams) -> jax.Array:
        """Precision matrix ``(D, D)``."""
        return -(nat.eta2 + nat.eta2.T)

    def from_mean_precision(self, loc: jax.Array, precision: jax.Array) -> NatParams:
        """From a mean ``(D,)`` and a precision: a ``(D, D)`` matrix (or, for convenience, its
        ``(D,)`` diagonal)."""
        if precision.ndim == loc.ndim:
            precision = jnp.diag(precision)
        return NatParams(precision @ loc, -0.5 * precision)

    def loc_scale(self, nat: NatParams) -> tuple[jax.Array, jax.Array]:
        """To ``(loc, scale_tril)`` of the covariance, by Cholesky solves (no explicit inverse of
        eta2)."""
        chol = jnp.linalg.cholesky(self.precision(nat))
        loc = cho_solve((chol, True), nat.eta1)
        cov = cho_solve((chol, True), jnp.eye(loc.shape[-1], dtype=loc.dtype))
        return loc, jnp.linalg.cholesky(_sym(cov))

    def from_loc_scale(self, loc: jax.Array, scale_tril: jax.Array) -> NatParams:
        """From the guide's ``(loc, scale_tril)``: ``Lambda = L^{-T} L^{-1}``."""
        inv = _inverse_tril(scale_tril)
        precision = inv.T @ inv
        return NatParams(precision @ loc, -0.5 * precision)

    def distribution(self, loc: jax.Array, scale_tril: jax.Array) -> dist.Distribution:
        """``MultivariateNormal(loc, scale_tril=L)``.

        Not validated: ``L`` is a Cholesky factor PVI computed (``is_valid`` checks ``q`` itself),
        and NumPyro's check of a ``lower_cholesky`` argument builds its triangular mask eagerly,
        compiling about 12 small programs per shape while a round is traced.
        """
        return dist.MultivariateNormal(loc, scale_tril=scale_tril, validate_args=False)

    # ------------------------------------------------------------------ GradientUpdate's guide,
    # whitened by the cavity
    def tilted_params(self, cavity: NatParams, q: NatParams) -> tuple[tuple, tuple]:
        """``((mu_c, C, C^{-1}), (mu_q, C_q^{-1} C))``: the cavity in precision form ``Lambda_c = C
        C^T`` and ``q`` in the guide's whitened form (``W = C_q^{-1} C`` gives ``q``'s covariance
        ``C^{-T} W^T W C^{-1}``).

        One Cholesky, one triangular inverse (:func:`~numpyro_pvi.families.whitened.inverse_tril`,
        by matrix products) and one product per client; ``q``'s own do not depend on the client
        (under ``vmap`` over clients with ``q`` shared they are computed once).
        """
        chol = jnp.linalg.cholesky(self.precision(cavity))
        chol_inv = inverse_tril(chol)
        chol_q_inv = inverse_tril(jnp.linalg.cholesky(self.precision(q)))
        loc, loc_q = (chol_inv @ cavity.eta1) @ chol_inv, (chol_q_inv @ q.eta1) @ chol_q_inv
        return (loc, chol, chol_inv), (loc_q, chol_q_inv @ chol)

    def cavity_distribution(self, cavity_params: tuple) -> dist.Distribution:
        """The cavity ``PrecisionMultivariateNormal(mu_c, C)``."""
        # not validated: the arguments are PVI's triangular factors (see distribution)
        return PrecisionMultivariateNormal(*cavity_params, validate_args=False)

    def cavity_guide(self, prefix: str, cavity_params: tuple, params: tuple) -> dist.Distribution:
        """``numpyro.param`` sites ``prefix + "loc"`` and ``prefix + "white_raw"`` (``W`` as a dense
        unconstrained matrix, :func:`~numpyro_pvi.families.whitened.white_tril`);
        ``CavityWhitenedNormal``."""
        loc = numpyro.param(prefix + "loc", params[0])
        raw = numpyro.param(prefix + "white_raw", white_raw(params[1]))
        # not validated: the arguments are PVI's triangular factors (see distribution)
        return CavityWhitenedNormal(
            loc, white_tril(raw), cavity_params[1], cavity_params[2], validate_args=False
        )

    def from_cavity_guide(self, prefix: str, cavity_params: tuple, values: dict) -> NatParams:
        """``Lambda = B B^T`` with ``B = C W^{-1}``: one triangular inverse and two products."""
        loc, white = values[prefix + "loc"], white_tril(values[prefix + "white_raw"])
        root = cavity_params[1] @ inverse_tril(white)
        precision = root @ root.T
        return NatParams(precision @ loc, -0.5 * precision)

    # ------------------------------------------------------------------ moments
    def moments(self, nat: NatParams) -> tuple[jax.Array, jax.Array]:
        """Mean ``(D,)`` and covariance ``L L^T`` ``(D, D)``."""
        loc, scale_tril = self.loc_scale(nat)
        return loc, scale_tril @ scale_tril.T

    def from_moments(self, mean: jax.Array, cov: jax.Array) -> NatParams:
        """From a mean and a covariance ``(D, D)`` (symmetrised), by a Cholesky solve."""
        chol = jnp.linalg.cholesky(_sym(cov))
        precision = cho_solve((chol, True), jnp.eye(mean.shape[-1], dtype=mean.dtype))
        return self.from_mean_precision(mean, _sym(precision))

    def from_dense_precision(self, mean: jax.Array, precision: jax.Array) -> NatParams:
        """``N(mean, precision^{-1})`` itself."""
        return self.from_mean_precision(mean, precision)

    # ------------------------------------------------------------------ densities
    def quadratic(self, nat: NatParams, zeta: jax.Array) -> jax.Array:
        """``eta1 . zeta + zeta^T eta2 zeta``."""
        return nat.eta1 @ zeta + zeta @ nat.eta2 @ zeta

    def marginals(self, nat: Any) -> Marginals:
        """Means, variances (the covariance's diagonal) and the precision's diagonal in float64
        numpy.

        Mean and variance are NaN if the precision is not positive definite.
        """
        eta1, eta2 = np.asarray(nat.eta1, dtype=np.float64), np.asarray(nat.eta2, dtype=np.float64)
        precision = -(eta2 + eta2.T)
        try:
            np.linalg.cholesky(precision)
        except np.linalg.LinAlgError:
            nan = np.full(eta1.shape, np.nan)
            return Marginals(nan, nan, np.diagonal(precision).copy())
        cov = np.linalg.inv(precision)
        return Marginals(cov @ eta1, np.diagonal(cov).copy(), np.diagonal(precision).copy())

    # ------------------------------------------------------------------ forms: (D, D) matrices
    def to_dense(self, matrix: jax.Array) -> jax.Array:
        """The matrix itself."""
        return matrix

    def from_dense(self, matrix: jax.Array) -> jax.Array:
        """The matrix itself."""
        return matrix

    def identity(self, dim: int) -> jax.Array:
        """``I`` ``(D, D)``."""
        return jnp.eye(dim)

    def outer(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """``a b^T``."""
        return jnp.outer(a, b)

    def outer_sum(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """``x^T y``."""
        return x.T @ y

    def sym(self, matrix: jax.Array) -> jax.Array:
        """``(M + M^T) / 2``."""
        return _sym(matrix)

    def matvec(self, matrix: jax.Array, v: jax.Array) -> jax.Array:
        """``v M^T`` (rows ``M v``)."""
        return v @ matrix.T

    def min_eig(self, matrix: jax.Array) -> jax.Array:
        """The smallest eigenvalue (``eigvalsh``)."""
        return jnp.min(jnp.linalg.eigvalsh(matrix))

    # ------------------------------------------------------------------ whitening: zeta = loc + L u
    def unwhiten(self, loc: jax.Array, scale_tril: jax.Array, u: jax.Array) -> jax.Array:
        """``loc + L u`` (rows)."""
        return loc + u @ scale_tril.T

    def whiten(self, loc: jax.Array, scale_tril: jax.Array, zeta: jax.Array) -> jax.Array:
        """``L^{-1} (zeta - loc)`` (rows), by a triangular solve."""
        return solve_triangular(scale_tril, (zeta - loc).T, lower=True).T

    def whitened_to_nat(
        self, loc: jax.Array, scale_tril: jax.Array, mean: jax.Array, cov: jax.Array
    ) -> NatParams:
        """``N(loc + L mean, L cov L^T)``: precision ``L^{-T} cov^{-1} L^{-1}``."""
        inv_tril = _inverse_tril(scale_tril)
        precision = inv_tril.T @ _sym(jnp.linalg.inv(cov)) @ inv_tril
        return self.from_mean_precision(loc + scale_tril @ mean, _sym(precision))

    def nat_to_whitened(
        self, loc: jax.Array, scale_tril: jax.Array, nat: NatParams
    ) -> tuple[jax.Array, jax.Array]:
        """``(L^{-1} (mean - loc), L^{-1} Sigma L^{-T})``."""
        mean, tril = self.loc_scale(nat)
        inv_tril = _inverse_tril(scale_tril)
        white = inv_tril @ tril
        return inv_tril @ (mean - loc), white @ white.T

    # ------------------------------------------------------------------ sites
    def stein_hessian(self, grads: jax.Array, eps: jax.Array, scale_tril: jax.Array) -> jax.Array:
        """``E_q[Hessian]`` ``(D, D)`` from gradients at ``zeta = loc + L eps``: ``E[g eps^T]
        L^{-1}``."""
        cross = grads.T @ eps / eps.shape[0]
        hess = solve_triangular(scale_tril, cross.T, lower=True, trans=1).T
        return _sym(hess)

    def site_update(self, grad_mean: jax.Array, hess_mean: jax.Array, loc: jax.Array) -> NatParams:
        """The natural parameters ``grad_mu E_q[f]`` given ``E_q[grad f]``, ``E_q[hess f]`` and
        ``q``'s mean."""
        return NatParams(grad_mean - hess_mean @ loc, 0.5 * hess_mean)

    def clamp_precision(
        self, nat: NatParams, low: float, high: float
    ) -> tuple[NatParams, jax.Array]:
        """``nat`` with its precision's eigenvalues clipped to ``[low, high]``, and whether any
        was."""
        values, vectors = jnp.linalg.eigh(self.precision(nat))
        clipped = jnp.clip(values, low, high)
        new = (vectors * clipped) @ vectors.T
        return NatParams(nat.eta1, -0.25 * (new + new.T)), jnp.any(clipped != values)

    def with_block(self, precision: jax.Array, block: slice, values: jax.Array) -> jax.Array:
        """Set the block ``[block, block]`` to a ``(k, k)`` matrix, or its diagonal to a ``(k,)``
        vector."""
        if jnp.ndim(values) == 2:
            return precision.at[block, block].set(values)
        idx = jnp.arange(block.start, block.stop)
        return precision.at[idx, idx].set(values)
