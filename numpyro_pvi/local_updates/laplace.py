"""The Laplace approximation shared by the local updates: damped Newton to a density's mode, and a
family's Laplace site of a client's tilted distribution (the fallback of CVI steps, a proposal of
EP's importance sampling, SNEP's start)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.families import FactorFamily, NatParams


def laplace(
    log_density: Callable, start: jax.Array, fallback: jax.Array, num_newton: int, tol: float = 1e-3
) -> tuple:
    """Mode and ``(D, D)`` precision of ``log_density`` by damped Newton steps from ``start``.

    Where the negative Hessian is not positive definite (a non-log-concave density, or far from the
    mode) it is replaced by its eigendecomposition with the eigenvalues made positive: their
    absolute values for a step (an ascent direction), floored at the smallest eigenvalue of the
    positive-definite ``fallback`` precision (so no step is longer than one with ``fallback``). Each
    step is halved until the density rises by at least ``1e-4`` of the predicted gain (Armijo; at
    most 30 halvings). The iteration stops after ``num_newton`` steps, once the Newton decrement
    ``g^T P^-1 g`` is below ``tol``, or when no halving rises. The returned precision is the
    negative Hessian at the mode if positive definite, else its eigenvalues floored the same way
    (``fallback`` if it is not finite).
    """
    value_grad, hessian = jax.value_and_grad(log_density), jax.hessian(log_density)
    floor = jnp.linalg.eigvalsh(fallback)[0]

    def curvature(z: jax.Array, newton: bool) -> jax.Array:
        evals, evecs = jnp.linalg.eigh(_sym(-hessian(z)))
        modified = jnp.maximum(jnp.abs(evals) if newton else evals, floor)
        precision = (evecs * jnp.where(evals[0] > 0, evals, modified)) @ evecs.T
        return jnp.where(jnp.all(jnp.isfinite(precision)), _sym(precision), fallback)

    def newton(carry: tuple) -> tuple:
        z, _, k = carry
        value, grad = value_grad(z)
        direction = jnp.linalg.solve(curvature(z, True), grad)
        gain = jnp.dot(grad, direction)  # the Newton decrement: twice the predicted rise

        def propose(step: jax.Array) -> tuple[jax.Array, jax.Array]:
            new = z + step * direction
            return new, log_density(new) >= value + 1e-4 * step * gain

        out = backtrack(propose, 1.0, max_halvings=30)
        moved = out.valid & jnp.all(jnp.isfinite(direction)) & jnp.isfinite(gain)
        done = ~moved | (gain < tol)
        return jnp.where(moved, out.value, z), done, k + 1

    mode, _, _ = jax.lax.while_loop(
        lambda c: (~c[1]) & (c[2] < num_newton),
        newton,
        (start, jnp.asarray(num_newton <= 0), jnp.asarray(0)),
    )
    precision = curvature(mode, False)
    return mode, precision, jnp.linalg.cholesky(precision)


def laplace_site(
    family: FactorFamily, cavity: NatParams, q: NatParams, loglik: Callable, num_newton: int
) -> NatParams:
    """The site ``from_laplace(mode, P) / cavity`` of the Laplace approximation of ``cavity * p(y_m
    | theta)``: its mode and negative Hessian ``P`` by Newton in the family's Laplace coordinates
    ``x`` (from ``q``'s mode)."""

    def log_tilted(x: jax.Array) -> jax.Array:
        zeta, log_cavity = family.laplace_log_density(cavity, x)
        return log_cavity + loglik(zeta)

    mode, precision, _ = laplace(
        log_tilted, family.laplace_start(q), family.laplace_precision(cavity), num_newton
    )
    return family.from_laplace(mode, precision) - cavity


def _sym(matrix: jax.Array) -> jax.Array:
    return 0.5 * (matrix + matrix.T)
