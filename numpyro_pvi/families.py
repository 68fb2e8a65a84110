"""Gaussian families over the flat unconstrained vector ``zeta`` (size ``D``), in natural parameters.

A Gaussian ``N(mu, Lambda^{-1})`` has natural parameters ``eta1 = Lambda mu`` and
``eta2 = -Lambda / 2``. Products and quotients of factors are sums and differences of natural
parameters, so ``q = prior + sum_m t_m`` and ``cavity_m = q - t_m``; damping is a convex
combination. ``MeanFieldGaussian`` stores ``eta2`` as the ``(D,)`` diagonal, ``FullRankGaussian``
as a ``(D, D)`` matrix. Factors ``t_m`` may be improper; ``q`` and every cavity must be valid
(positive definite), which :meth:`is_valid` checks.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.linalg import cho_solve, solve_triangular
from numpyro.distributions import constraints


class NatParams(NamedTuple):
    """Natural parameters of a Gaussian: ``eta1`` ``(..., D)`` and ``eta2`` ``(..., D)`` or ``(..., D, D)``.

    They add and scale like vectors (``q - t_m`` is a cavity, ``q + rho * delta`` a damped update).

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_pvi import MeanFieldGaussian
        >>> q = MeanFieldGaussian().from_loc_scale(jnp.array([1.0]), jnp.array([2.0]))
        >>> q.eta1, q.eta2  # mu / sigma^2, -1 / (2 sigma^2)
        (Array([0.25], dtype=float32), Array([-0.125], dtype=float32))
    """

    eta1: jax.Array
    eta2: jax.Array

    def __add__(self, other: NatParams) -> NatParams:  # type: ignore[override]
        return NatParams(self.eta1 + other.eta1, self.eta2 + other.eta2)

    def __sub__(self, other: NatParams) -> NatParams:
        return NatParams(self.eta1 - other.eta1, self.eta2 - other.eta2)

    def __mul__(self, rho: jax.Array | float) -> NatParams:  # type: ignore[override]
        return NatParams(rho * self.eta1, rho * self.eta2)

    __rmul__ = __mul__


class MeanFieldGaussian:
    """Diagonal Gaussian factors and approximation, like ``AutoDiagonalNormal``.

    The client guide is ``Normal(loc, scale).to_event(1)`` with ``scale`` constrained
    ``softplus_positive``, as in NumPyro's ``AutoNormal`` / ``AutoDiagonalNormal``.

    **Example:** ``pvi.PVI(model, family=pvi.MeanFieldGaussian(), ...)``
    """

    scale_name = "scale"
    scale_constraint = constraints.softplus_positive

    def zeros(self, dim: int) -> NatParams:
        """The flat factor ``t = 1``: natural parameters of shape ``(D,)``."""
        return NatParams(jnp.zeros(dim), jnp.zeros(dim))

    def from_mean_precision(self, loc: jax.Array, precision: jax.Array) -> NatParams:
        """From a mean ``(D,)`` and a diagonal precision ``(D,)``."""
        return NatParams(precision * loc, -0.5 * precision)

    def from_loc_scale(self, loc: jax.Array, scale: jax.Array) -> NatParams:
        """From the guide's ``(loc, scale)``."""
        return self.from_mean_precision(loc, 1.0 / scale**2)

    def loc_scale(self, nat: NatParams) -> tuple[jax.Array, jax.Array]:
        """To ``(loc, scale)`` (valid natural parameters only)."""
        var = -0.5 / nat.eta2
        return var * nat.eta1, jnp.sqrt(var)

    def precision(self, nat: NatParams) -> jax.Array:
        """Diagonal precision ``(D,)``."""
        return -2.0 * nat.eta2

    def distribution(self, loc: jax.Array, scale: jax.Array) -> dist.Distribution:
        """The NumPyro distribution over ``zeta`` with the guide's parameters."""
        return dist.Normal(loc, scale).to_event(1)

    def to_dist(self, nat: NatParams) -> dist.Distribution:
        """``q`` as a NumPyro distribution over ``zeta``."""
        return self.distribution(*self.loc_scale(nat))

    def is_valid(self, nat: NatParams) -> jax.Array:
        """Whether ``nat`` is a proper, finite Gaussian (all precisions positive)."""
        return jnp.all(nat.eta2 < 0) & jnp.all(jnp.isfinite(nat.eta1)) & jnp.all(jnp.isfinite(nat.eta2))

    def stein_hessian(self, grads: jax.Array, eps: jax.Array, scale: jax.Array) -> jax.Array:
        """``E_q[Hessian]`` (its diagonal) from gradients at ``zeta = loc + scale * eps`` (Stein's lemma)."""
        return jnp.mean(grads * eps, axis=0) / scale

    def site_update(self, grad_mean: jax.Array, hess_mean: jax.Array, loc: jax.Array) -> NatParams:
        """The natural parameters ``grad_mu E_q[f]`` given ``E_q[grad f]``, ``E_q[hess f]`` and ``q``'s mean."""
        return NatParams(grad_mean - hess_mean * loc, 0.5 * hess_mean)


class FullRankGaussian(MeanFieldGaussian):
    """Full-covariance Gaussian factors and approximation, like ``AutoMultivariateNormal``.

    The client guide is ``MultivariateNormal(loc, scale_tril=L)`` with ``L`` constrained
    ``scaled_unit_lower_cholesky``, as in NumPyro's ``AutoMultivariateNormal``.

    **Example:** ``pvi.PVI(model, family=pvi.FullRankGaussian(), ...)``
    """

    scale_name = "scale_tril"
    scale_constraint = constraints.scaled_unit_lower_cholesky

    def zeros(self, dim: int) -> NatParams:
        return NatParams(jnp.zeros(dim), jnp.zeros((dim, dim)))

    def from_mean_precision(self, loc: jax.Array, precision: jax.Array) -> NatParams:
        """From a mean ``(D,)`` and a precision: a ``(D,)`` diagonal or a ``(D, D)`` matrix."""
        if precision.ndim == loc.ndim:
            precision = jnp.diag(precision)
        return NatParams(precision @ loc, -0.5 * precision)

    def from_loc_scale(self, loc: jax.Array, scale_tril: jax.Array) -> NatParams:
        """From the guide's ``(loc, scale_tril)``: ``Lambda = L^{-T} L^{-1}``."""
        inv = solve_triangular(scale_tril, jnp.eye(loc.shape[-1], dtype=loc.dtype), lower=True)
        precision = inv.T @ inv
        return NatParams(precision @ loc, -0.5 * precision)

    def loc_scale(self, nat: NatParams) -> tuple[jax.Array, jax.Array]:
        """To ``(loc, scale_tril)`` of the covariance, by Cholesky solves (no explicit inverse of eta2)."""
        chol = jnp.linalg.cholesky(self.precision(nat))
        loc = cho_solve((chol, True), nat.eta1)
        cov = cho_solve((chol, True), jnp.eye(loc.shape[-1], dtype=loc.dtype))
        return loc, jnp.linalg.cholesky(0.5 * (cov + cov.T))

    def precision(self, nat: NatParams) -> jax.Array:
        """Precision matrix ``(D, D)``."""
        return -(nat.eta2 + nat.eta2.T)

    def distribution(self, loc: jax.Array, scale_tril: jax.Array) -> dist.Distribution:
        return dist.MultivariateNormal(loc, scale_tril=scale_tril)

    def is_valid(self, nat: NatParams) -> jax.Array:
        """Whether ``nat`` is a proper, finite Gaussian (precision matrix positive definite)."""
        chol = jnp.linalg.cholesky(self.precision(nat))
        return jnp.all(jnp.isfinite(chol)) & jnp.all(jnp.isfinite(nat.eta1)) & jnp.all(jnp.diagonal(chol) > 0)

    def stein_hessian(self, grads: jax.Array, eps: jax.Array, scale_tril: jax.Array) -> jax.Array:
        """``E_q[Hessian]`` ``(D, D)`` from gradients at ``zeta = loc + L eps``: ``E[g eps^T] L^{-1}``."""
        cross = grads.T @ eps / eps.shape[0]
        hess = solve_triangular(scale_tril, cross.T, lower=True, trans=1).T
        return 0.5 * (hess + hess.T)

    def site_update(self, grad_mean: jax.Array, hess_mean: jax.Array, loc: jax.Array) -> NatParams:
        return NatParams(grad_mean - hess_mean @ loc, 0.5 * hess_mean)


def expected_site(family: MeanFieldGaussian, q: NatParams, eps: jax.Array, grad: Callable,
                  hessian: Callable | None = None) -> NatParams:
    """Natural parameters of ``grad_mu E_q[f(zeta)]``, the CVI / natural-gradient site of ``f`` under ``q``.

    By Bonnet's and Price's theorems ``eta2 = E_q[H] / 2`` and ``eta1 = E_q[g] - E_q[H] mu``, estimated at
    ``zeta = mu + scale * eps`` (``eps`` ``(S, D)`` standard-normal points; antithetic pairs make it exact
    for a quadratic ``f``).

    :param grad: ``(S, D) -> (S, D)``, the gradient of ``f`` at each point.
    :param hessian: ``(S, D) -> (S, D, D)``, its Hessian; if ``None``, ``E_q[H]`` comes from the gradients by
        Stein's lemma.
    """
    loc, scale = family.loc_scale(q)
    zeta = loc + (eps * scale if jnp.ndim(scale) == 1 else eps @ scale.T)
    grads = grad(zeta)
    if hessian is None:
        hess = family.stein_hessian(grads, eps, scale)
    else:
        hess = jnp.mean(hessian(zeta), axis=0)
        hess = jnp.diagonal(hess) if jnp.ndim(scale) == 1 else hess
    return family.site_update(jnp.mean(grads, axis=0), hess, loc)
