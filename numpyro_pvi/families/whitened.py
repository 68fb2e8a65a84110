"""Full-rank Gaussians whitened by the cavity: the client guide whose steps cost ``O(D^2)``, not
``O(D^3)``.

With the cavity in precision form, ``Lambda_c = C C^T`` (``C`` lower triangular, one Cholesky per
client visit), the client's guide is ``zeta = loc + C^{-T} L^T eps`` with ``L`` lower triangular,
i.e. ``Sigma = C^{-T} L^T L C^{-1}``. Then ``Lambda_c Sigma`` is similar to ``L^T L`` and

``KL(guide || cavity) = 0.5 (||L||_F^2 + ||C^T (loc - mu_c)||^2 - D) - sum log diag L``,

so an SVI step (one draw: a triangular mat-vec and a triangular solve; the KL) is ``O(D^2)``, where
NumPyro's ``KL(MultivariateNormal || MultivariateNormal)`` is two ``(D, D)`` triangular solves,
``O(D^3)``, per step. :class:`PrecisionMultivariateNormal` is the cavity (the tilted model's prior
of ``zeta``), :class:`CavityWhitenedNormal` the guide; ``kl_divergence`` of the pair is registered
here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.scipy.linalg import solve_triangular
from numpyro.distributions import constraints
from numpyro.distributions.kl import kl_divergence


def inverse_tril(tril: jax.Array, block: int = 8) -> jax.Array:
    """``L^{-1}`` of a lower-triangular ``L`` ``(..., D, D)`` by recursive 2 x 2 blocks, i.e. by
    matrix products.

    ``[[A, 0], [C, B]]^{-1} = [[A^{-1}, 0], [-B^{-1} C A^{-1}, B^{-1}]]``, down to blocks of at most
    ``block`` rows (triangular solves). On CPU, batched over clients, this is an order of magnitude
    faster than ``solve_triangular(L, I)``, whose batched form is slow.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_pvi.families.whitened import inverse_tril
        >>> inverse_tril(jnp.array([[2.0, 0.0], [1.0, 1.0]]), block=1)
        Array([[ 0.5,  0. ],
               [-0.5,  1. ]], dtype=float32)
    """
    dim = tril.shape[-1]
    if dim <= block:
        return _inverse_small_tril(tril)
    half = dim // 2
    top_inv, bottom_inv = (
        inverse_tril(tril[..., :half, :half], block),
        inverse_tril(tril[..., half:, half:], block),
    )
    lower = -bottom_inv @ tril[..., half:, :half] @ top_inv
    top = jnp.concatenate(
        [top_inv, jnp.zeros(tril.shape[:-2] + (half, dim - half), tril.dtype)], axis=-1
    )
    return jnp.concatenate([top, jnp.concatenate([lower, bottom_inv], axis=-1)], axis=-2)


def _inverse_small_tril(tril: jax.Array) -> jax.Array:
    """``L^{-1}`` of a small lower-triangular ``L = D (I + N)``: ``(I + N)^{-1} D^{-1}`` with the
    finite series ``(I + N)^{-1} = (I - N)(I + N^2)(I + N^4)...`` (``N`` strictly lower triangular,
    so ``N^k = 0`` for ``k >= dim``): matrix products only (a batched ``solve_triangular`` here hung
    XLA's CPU runtime)."""
    dim = tril.shape[-1]
    diagonal = jnp.diagonal(tril, axis1=-2, axis2=-1)
    eye = jnp.eye(dim, dtype=tril.dtype)
    nilpotent = jnp.tril(tril, -1) / diagonal[..., :, None]
    inverse, power = eye - nilpotent, nilpotent @ nilpotent
    for _ in range(max(0, (dim - 1).bit_length() - 1)):
        inverse = inverse + inverse @ power
        power = power @ power
    return inverse / diagonal[..., None, :]


def white_tril(raw: jax.Array) -> jax.Array:
    """The lower-triangular ``W`` with a positive diagonal stored as a dense unconstrained ``(D,
    D)`` matrix: its strict lower triangle, ``softplus`` of its diagonal (the upper triangle is
    unused).

    Dense storage makes a step's transform a mask, not the scatter of ``vec_to_tril_matrix`` (slow
    on CPU batched over clients); :func:`white_raw` is its inverse.

    **Example:** ``white_tril(white_raw(w))`` is ``w`` for lower-triangular ``w`` with positive
    diagonal.
    """
    eye = jnp.eye(raw.shape[-1], dtype=raw.dtype)
    return (
        jnp.tril(raw, -1) + eye * jax.nn.softplus(jnp.diagonal(raw, axis1=-2, axis2=-1))[..., None]
    )


def white_raw(tril: jax.Array) -> jax.Array:
    """The dense unconstrained matrix of a lower-triangular ``W`` with positive diagonal (see
    :func:`white_tril`).

    **Example:** ``white_raw(jnp.eye(2))`` has ``log(e - 1)`` on its diagonal, zeros elsewhere.
    """
    eye = jnp.eye(tril.shape[-1], dtype=tril.dtype)
    diagonal = eye * tril
    return jnp.tril(tril, -1) + eye * jnp.log(jnp.expm1(jnp.where(eye > 0, diagonal, 1.0)))


def _solve_upper(tril: jax.Array, values: jax.Array) -> jax.Array:
    """``tril^{-T} v`` for every row ``v`` of ``values`` ``(..., D)`` (``tril`` unbatched, lower
    triangular)."""
    flat = values.reshape(-1, values.shape[-1])
    return solve_triangular(tril, flat.T, lower=True, trans=1).T.reshape(values.shape)


def _gaussian_log_density(white: jax.Array, log_det_scale: jax.Array) -> jax.Array:
    """``log N(zeta)`` from its whitened residual ``(..., D)`` and ``log |det scale|`` of its
    covariance's root."""
    dim = white.shape[-1]
    return -0.5 * jnp.sum(white**2, axis=-1) - log_det_scale - 0.5 * dim * np.log(2 * np.pi)


def _check_unbatched(name: str, loc: jax.Array, *trils: jax.Array) -> None:
    if jnp.ndim(loc) != 1 or any(jnp.shape(t) != (loc.shape[0], loc.shape[0]) for t in trils):
        raise ValueError(
            f"{name}: loc must be (D,) and every triangular factor (D, D) (no batch shape; vmap "
            f"over clients instead), got {jnp.shape(loc)} and {[jnp.shape(t) for t in trils]}."
        )


class PrecisionMultivariateNormal(dist.Distribution):
    """``N(loc, (C C^T)^{-1})`` given by the lower Cholesky factor ``C`` of its *precision*.

    The tilted model's prior of ``zeta`` in :class:`~numpyro_pvi.FullRankGaussian`'s
    ``GradientUpdate``: the cavity, converted with one Cholesky. Unbatched: ``loc`` ``(D,)``,
    ``precision_tril`` ``(D, D)``; ``precision_tril_inv`` is ``C^{-1}`` if known (computed by
    :func:`inverse_tril` otherwise), so that a draw ``loc + C^{-T} eps`` is a matrix-vector product.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_pvi.families.whitened import PrecisionMultivariateNormal
        >>> d = PrecisionMultivariateNormal(jnp.zeros(2), 2.0 * jnp.eye(2))  # precision 4 I
        >>> round(
        ...     float(d.log_prob(jnp.zeros(2))), 4
        ... )  # log(4 / (2 pi)), the density of N(0, I / 4) at 0
        -0.4516
    """

    arg_constraints = {
        "loc": constraints.real_vector,
        "precision_tril": constraints.lower_cholesky,
        "precision_tril_inv": constraints.lower_cholesky,
    }
    support = constraints.real_vector
    reparametrized_params = ["loc", "precision_tril", "precision_tril_inv"]
    pytree_data_fields = ("loc", "precision_tril", "precision_tril_inv")

    def __init__(
        self,
        loc: jax.Array,
        precision_tril: jax.Array,
        precision_tril_inv: jax.Array | None = None,
        validate_args: bool | None = None,
    ) -> None:
        precision_tril_inv = (
            inverse_tril(precision_tril) if precision_tril_inv is None else precision_tril_inv
        )
        _check_unbatched("PrecisionMultivariateNormal", loc, precision_tril, precision_tril_inv)
        self.loc, self.precision_tril, self.precision_tril_inv = (
            loc,
            precision_tril,
            precision_tril_inv,
        )
        super().__init__(batch_shape=(), event_shape=jnp.shape(loc), validate_args=validate_args)

    def sample(self, key: jax.Array, sample_shape: tuple = ()) -> jax.Array:
        eps = jax.random.normal(
            key, tuple(sample_shape) + self.event_shape, jnp.result_type(self.loc)
        )
        return self.loc + eps @ self.precision_tril_inv  # rows of C^{-T} eps

    def log_prob(self, value: jax.Array) -> jax.Array:
        white = (value - self.loc) @ self.precision_tril
        return _gaussian_log_density(white, -jnp.sum(jnp.log(jnp.diagonal(self.precision_tril))))

    @property
    def mean(self) -> jax.Array:
        return self.loc

    @property
    def covariance_matrix(self) -> jax.Array:
        return self.precision_tril_inv.T @ self.precision_tril_inv

    @property
    def variance(self) -> jax.Array:
        return jnp.diagonal(self.covariance_matrix)


class CavityWhitenedNormal(dist.Distribution):
    """``zeta = loc + C^{-T} L^T eps``: a full-rank Gaussian whose covariance ``C^{-T} L^T L
    C^{-1}`` is whitened by the cavity's precision Cholesky ``C`` (``cavity_tril``); ``L``
    (``white_tril``) is optimised.

    ``L = I`` is the cavity's covariance, and for ``kl_divergence`` against a
    :class:`PrecisionMultivariateNormal` whose ``precision_tril`` *is* ``cavity_tril`` (the same
    array object, as in the tilted model and guide of one client) the KL costs ``O(D^2)``; against
    any other, the general ``O(D^3)`` formula is used. Unbatched: ``loc`` ``(D,)``, the factors
    ``(D, D)``; ``cavity_tril_inv`` is ``C^{-1}`` if known (computed by :func:`inverse_tril`
    otherwise), so that a draw is two matrix-vector products.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro.distributions import kl_divergence
        >>> from numpyro_pvi.families.whitened import (
        ...     CavityWhitenedNormal,
        ...     PrecisionMultivariateNormal,
        ... )
        >>> chol = jnp.array([[2.0, 0.0], [1.0, 1.0]])
        >>> cavity = PrecisionMultivariateNormal(jnp.zeros(2), chol)
        >>> float(kl_divergence(CavityWhitenedNormal(jnp.zeros(2), jnp.eye(2), chol), cavity))
        0.0
    """

    arg_constraints = {
        "loc": constraints.real_vector,
        "white_tril": constraints.lower_cholesky,
        "cavity_tril": constraints.lower_cholesky,
        "cavity_tril_inv": constraints.lower_cholesky,
    }
    support = constraints.real_vector
    reparametrized_params = ["loc", "white_tril", "cavity_tril", "cavity_tril_inv"]
    pytree_data_fields = ("loc", "white_tril", "cavity_tril", "cavity_tril_inv")

    def __init__(
        self,
        loc: jax.Array,
        white_tril: jax.Array,
        cavity_tril: jax.Array,
        cavity_tril_inv: jax.Array | None = None,
        validate_args: bool | None = None,
    ) -> None:
        cavity_tril_inv = inverse_tril(cavity_tril) if cavity_tril_inv is None else cavity_tril_inv
        _check_unbatched("CavityWhitenedNormal", loc, white_tril, cavity_tril, cavity_tril_inv)
        self.loc, self.white_tril = loc, white_tril
        self.cavity_tril, self.cavity_tril_inv = cavity_tril, cavity_tril_inv
        super().__init__(batch_shape=(), event_shape=jnp.shape(loc), validate_args=validate_args)

    def sample(self, key: jax.Array, sample_shape: tuple = ()) -> jax.Array:
        eps = jax.random.normal(
            key, tuple(sample_shape) + self.event_shape, jnp.result_type(self.loc)
        )
        return self.loc + (eps @ self.white_tril) @ self.cavity_tril_inv  # rows of C^{-T} W^T eps

    def log_prob(self, value: jax.Array) -> jax.Array:
        # eps = L^{-T} C^T (zeta - loc); log |det C^{-T} L^T| = sum log diag L - sum log diag C
        white = _solve_upper(self.white_tril, (value - self.loc) @ self.cavity_tril)
        log_det = jnp.sum(jnp.log(jnp.diagonal(self.white_tril))) - jnp.sum(
            jnp.log(jnp.diagonal(self.cavity_tril))
        )
        return _gaussian_log_density(white, log_det)

    @property
    def mean(self) -> jax.Array:
        return self.loc

    @property
    def scale_tril_upper(self) -> jax.Array:
        """``C^{-T} L^T``, an upper-triangular root of the covariance."""
        return self.cavity_tril_inv.T @ self.white_tril.T

    @property
    def covariance_matrix(self) -> jax.Array:
        root = self.scale_tril_upper
        return root @ root.T

    @property
    def variance(self) -> jax.Array:
        return jnp.diagonal(self.covariance_matrix)


@kl_divergence.register(CavityWhitenedNormal, PrecisionMultivariateNormal)
def _kl_whitened_precision(p: CavityWhitenedNormal, q: PrecisionMultivariateNormal) -> jax.Array:
    """``KL(p || q)``; ``O(D^2)`` when ``p`` is whitened by ``q``'s own precision factor."""
    dim = p.loc.shape[-1]
    if p.cavity_tril is q.precision_tril:
        trace = jnp.sum(p.white_tril**2)  # tr(Lambda_q Sigma_p) = ||L||_F^2
        # log det(Lambda_q Sigma_p)^{-1}
        log_det = -2.0 * jnp.sum(jnp.log(jnp.diagonal(p.white_tril)))
    else:  # Lambda_q Sigma_p = C_q C_q^T C_p^{-T} L^T L C_p^{-1}
        root = q.precision_tril.T @ p.scale_tril_upper
        trace = jnp.sum(root**2)
        log_det = 2.0 * (
            jnp.sum(jnp.log(jnp.diagonal(p.cavity_tril)))
            - jnp.sum(jnp.log(jnp.diagonal(p.white_tril)))
            - jnp.sum(jnp.log(jnp.diagonal(q.precision_tril)))
        )
    mahalanobis = jnp.sum(((p.loc - q.loc) @ q.precision_tril) ** 2)
    return 0.5 * (trace + mahalanobis - dim + log_det)
