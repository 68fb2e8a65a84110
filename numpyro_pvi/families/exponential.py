"""Exponential families in a site's own space: :class:`Gamma`, :class:`Beta`, :class:`Dirichlet`.

A factor is ``t(theta) = exp(eta1 . T1(theta) + eta2 . T2(theta))`` over the site's *constrained*
value ``theta`` (no bijection to unconstrained space: the block's coordinates are ``theta`` itself):

============  =====================================  ==========================
====================== family        density of ``q``                       ``(T1, T2)``
``(eta1, eta2)`` ============  =====================================  ==========================
====================== ``Gamma``     ``theta^(a-1) exp(-b theta)``           ``(log theta, theta)``
``(a - 1, -b)`` ``Beta``      ``theta^(a-1) (1 - theta)^(b-1)``       ``(log theta, log(1-theta))``
``(a - 1, b - 1)`` ``Dirichlet`` ``prod_k theta_k^(a_k - 1)``            ``(log theta, -)``
``(a - 1, ())`` ============  =====================================  ==========================
======================

Products and quotients are sums and differences of natural parameters, as for the Gaussians, so the
merge, cavities and damping are unchanged. ``Gamma`` and ``Beta`` are elementwise over every
coordinate; ``Dirichlet`` is one simplex site of shape ``(K,)`` or ``(..., K)`` (independent
simplices). A prior of the same family is exact; a conjugate likelihood (Poisson / exponential /
Normal-precision for ``Gamma``, Bernoulli / binomial for ``Beta``, categorical / multinomial for
``Dirichlet``) has a site that is exactly linear in ``T``, which
:meth:`ExponentialFamily.site_from_draws` recovers exactly by least squares (the natural gradient of
``E_q[f]`` is the regression coefficient of ``f`` on ``T`` under ``q``: Salimans & Knowles 2013). So
``NaturalGradientUpdate(step_size=1.0)`` (or EP) is exact in one round of an undamped server,
``Sequential()`` or ``Synchronous(1.0)``; the default ``Synchronous()`` damps its first round.
"""

from __future__ import annotations

import copy
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.scipy.special import digamma, polygamma
from numpyro.distributions import constraints
from numpyro.distributions.kl import kl_divergence
from numpyro.distributions.transforms import (
    ExpTransform,
    SigmoidTransform,
    StickBreakingTransform,
    biject_to,
)

from numpyro_pvi.families.concentrated import (
    ConcentratedBeta,
    ConcentratedDirichlet,
    ConcentratedGamma,
    gamma_sample_grad,
)
from numpyro_pvi.families.exponential_family import (
    NUM_PRIOR_DRAWS,
    ExponentialFamily,
    gamma2_draws,
    regression_site,
    unit_scale,
)
from numpyro_pvi.families.params import NatParams

__all__ = ["Beta", "Dirichlet", "ExponentialFamily", "Gamma", "regression_site", "unit_scale"]


class Gamma(ExponentialFamily):
    """Gamma factors over positive sites, elementwise: ``eta1 = shape - 1``, ``eta2 = -rate``.

    Conjugate to Poisson, exponential and gamma (known shape) likelihoods of a rate and to a Normal
    likelihood's precision. Valid when shape and rate are positive.

    **Example:** ``pvi.SiteFamilies({"rate": pvi.Gamma()})``, or ``pvi.Gamma()`` when every global
    site is positive.

    .. doctest::

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> q = pvi.Gamma().from_params(jnp.array([3.0]), jnp.array([2.0]))
        >>> q.eta1, q.eta2
        (Array([2.], dtype=float32), Array([-2.], dtype=float32))
    """

    support = constraints.positive
    transform_type = ExpTransform
    param_names = ("concentration", "rate")

    def to_params(self, nat: NatParams) -> tuple:
        """``(shape, rate)``."""
        return nat.eta1 + 1.0, -nat.eta2

    def from_params(self, concentration: jax.Array, rate: jax.Array) -> NatParams:
        """From shape and rate."""
        return NatParams(concentration - 1.0, -rate)

    def stats(self, theta: jax.Array) -> jax.Array:
        """``(log theta, theta)``."""
        return jnp.concatenate([jnp.log(theta), theta], axis=-1)

    def mean_stats(self, params: tuple) -> jax.Array:
        """``(digamma(a) - log b, a / b)``."""
        a, b = params
        return jnp.concatenate([digamma(a) - jnp.log(b), a / b])

    def site_from_draws(
        self,
        nat: NatParams,
        zeta: jax.Array,
        values: jax.Array,
        grads: jax.Array,
        hessians: jax.Array | None,
    ) -> NatParams:
        """``grad_mu E_q[f]`` from pathwise gradients, with the sufficient statistics' as control
        variates.

        ``d E_q[f] / d eta = E[f'(theta) d theta / d eta]`` (implicit reparameterisation of the
        Gamma draws:
        :func:`~numpyro_pvi.families.concentrated.gamma_sample_grad`, which returns at any shape)
        minus ``a . (mean of d T(theta) / d eta - F)``, ``F = Cov_q(T)`` the Fisher matrix, then
        ``F^-1``. The coefficients ``a`` are the mean over the draws of ``f``'s local ``(log theta,
        theta)`` coefficients (from its first and second derivatives) when Hessians are given, else
        the least-squares site. Unbiased for any ``a`` (but for the ``O(1 / S)`` of estimating it);
        exact up to the other blocks' noise when ``f`` is affine in ``T`` (a Gamma block conjugate
        to the likelihood): a Normal precision, a Poisson rate. The regression of ``f`` on ``T``
        instead carries the other blocks' variation of ``f`` and the collinearity of ``log theta``
        and ``theta`` (issue 23, 7).

        **Example:** ``f = 3 log theta - 2 theta`` is conjugate: its site is ``(3, -2)`` from any
        draws.

        .. doctest::

            >>> import jax, jax.numpy as jnp, numpyro_pvi as pvi
            >>> family = pvi.Gamma()
            >>> q = family.from_params(jnp.array([5.0]), jnp.array([2.0]))
            >>> theta = family.draw(q, jax.random.PRNGKey(0), 8)
            >>> f = lambda t: jnp.sum(3.0 * jnp.log(t) - 2.0 * t)
            >>> site = family.site_from_draws(
            ...     q,
            ...     theta,
            ...     jax.vmap(f)(theta),
            ...     jax.vmap(jax.grad(f))(theta),
            ...     jax.vmap(jax.hessian(f))(theta),
            ... )
            >>> jnp.round(site.eta1, 4), jnp.round(site.eta2, 4)
            (Array([3.], dtype=float32), Array([-2.], dtype=float32))
        """
        shape, rate = self.to_params(nat)
        # d theta / d (eta1, eta2) = (d theta / d shape, -d theta / d rate), each (S, D)
        dtheta = jnp.stack([gamma_sample_grad(shape, zeta * rate) / rate, zeta / rate], axis=-1)
        dstats = (
            jnp.stack([1.0 / zeta, jnp.ones_like(zeta)], axis=-1)[..., :, None]
            * dtheta[..., None, :]
        )
        fisher = jnp.stack(
            [
                jnp.stack([polygamma(1, shape), 1.0 / rate], -1),
                # (D, 2, 2): Cov(log theta, theta)
                jnp.stack([1.0 / rate, shape / rate**2], -1),
            ],
            -2,
        )
        if hessians is None:
            coef = super().site_from_draws(nat, zeta, values, grads, None)
            coef = jnp.stack([coef.eta1, coef.eta2], axis=-1)
        else:
            # f'' per coordinate; T' = (1/theta, 1)
            curv = jnp.diagonal(hessians, axis1=-2, axis2=-1)
            coef = jnp.mean(jnp.stack([-(zeta**2) * curv, grads + zeta * curv], axis=-1), axis=0)
        coef = jax.lax.stop_gradient(coef)
        pathwise = jnp.mean(grads[..., None] * dtheta, axis=0)  # (D, 2)
        control = jnp.einsum("dk,dkp->dp", coef, jnp.mean(dstats, axis=0) - fisher)
        site = jnp.linalg.solve(fisher, (pathwise - control)[..., None])[..., 0]
        return NatParams(site[..., 0], site[..., 1])

    def laplace_start(self, nat: NatParams) -> jax.Array:
        """``log(a / b)``: in ``u = log theta`` a ``Gamma(a, b)`` has log density ``a u - b
        exp(u)``, mode ``log(a / b)``."""
        a, b = self.to_params(nat)
        return jnp.log(a / b)

    def laplace_log_density(self, nat: NatParams, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(exp(x), sum(a x - b exp(x)))``."""
        a, b = self.to_params(nat)
        theta = jnp.exp(x)
        return theta, jnp.sum(a * x - b * theta)

    def laplace_precision(self, nat: NatParams) -> jax.Array:
        """``diag(a)``: the curvature of ``a u - b exp(u)`` at its mode is ``-a``."""
        return jnp.diag(self.to_params(nat)[0])

    def from_laplace(self, mode: jax.Array, precision: jax.Array) -> NatParams:
        """``a = diag(precision)``, ``b = a exp(-mode)`` (mode ``log(a / b)``, curvature ``-a`` in
        ``log theta``).

        .. doctest::

            >>> import jax.numpy as jnp, numpyro_pvi as pvi
            >>> family = pvi.Gamma()
            >>> q = family.from_params(jnp.array([3.0]), jnp.array([2.0]))
            >>> family.to_params(
            ...     family.from_laplace(family.laplace_start(q), family.laplace_precision(q))
            ... )
            (Array([3.], dtype=float32), Array([2.], dtype=float32))
        """
        a = jnp.diagonal(precision)
        return self.from_params(a, a * jnp.exp(-mode))

    def reference_draws(self, dim: int) -> jax.Array:
        """``(NUM_PRIOR_DRAWS, dim)`` draws of ``Gamma(2, rate=2)`` (from :func:`gamma2_draws`)."""
        return gamma2_draws((NUM_PRIOR_DRAWS, dim)) / 2.0

    def base(self, concentration: jax.Array, rate: jax.Array) -> dist.Distribution:
        """``Gamma(shape, rate)`` over ``(D,)`` (accurate ``log_prob`` and ``entropy`` at any
        concentration)."""
        return ConcentratedGamma(concentration, rate).to_event(1)

    def mean_var(self, params: tuple) -> tuple[np.ndarray, np.ndarray]:
        """``a / b`` and ``a / b^2``."""
        a, b = params
        return a / b, a / b**2

    def params_at(self, loc: jax.Array, scale: float) -> tuple:
        """Mean ``loc`` and coefficient of variation ``scale`` (sd ``scale * loc``): shape ``1 /
        scale^2``.

        For small ``scale`` this is about a sd of ``scale`` in ``log theta``, as a Gaussian start in
        unconstrained space with the same ``init_scale``.
        """
        mean = jnp.maximum(loc, jnp.finfo(jnp.result_type(float)).tiny)
        shape = jnp.full_like(mean, 1.0 / scale**2)
        return shape, shape / mean


class Beta(ExponentialFamily):
    """Beta factors over unit-interval sites, elementwise: ``eta1 = a - 1``, ``eta2 = b - 1``.

    Conjugate to Bernoulli, binomial and geometric likelihoods of a probability.

    **Example:** ``pvi.SiteFamilies({"p": pvi.Beta()})``.

    .. doctest::

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.Beta().to_params(pvi.Beta().from_params(jnp.array([2.0]), jnp.array([5.0])))
        (Array([2.], dtype=float32), Array([5.], dtype=float32))
    """

    support = constraints.unit_interval
    transform_type = SigmoidTransform
    param_names = ("concentration1", "concentration0")

    def to_params(self, nat: NatParams) -> tuple:
        """``(a, b)``."""
        return nat.eta1 + 1.0, nat.eta2 + 1.0

    def from_params(self, concentration1: jax.Array, concentration0: jax.Array) -> NatParams:
        """From ``a`` (of ``theta``) and ``b`` (of ``1 - theta``)."""
        return NatParams(concentration1 - 1.0, concentration0 - 1.0)

    def stats(self, theta: jax.Array) -> jax.Array:
        """``(log theta, log(1 - theta))``."""
        return jnp.concatenate([jnp.log(theta), jnp.log1p(-theta)], axis=-1)

    def mean_stats(self, params: tuple) -> jax.Array:
        """``(digamma(a) - digamma(a + b), digamma(b) - digamma(a + b))``."""
        a, b = params
        return jnp.concatenate([digamma(a) - digamma(a + b), digamma(b) - digamma(a + b)])

    def laplace_start(self, nat: NatParams) -> jax.Array:
        """``logit(a / (a + b))``: in ``x = logit theta`` a ``Beta(a, b)`` has log density
        ``a log sigmoid(x) + b log sigmoid(-x)``, mode ``logit(a / (a + b))``."""
        a, b = self.to_params(nat)
        return jnp.log(a) - jnp.log(b)

    def laplace_log_density(self, nat: NatParams, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(sigmoid(x), sum(a log sigmoid(x) + b log sigmoid(-x)))``."""
        a, b = self.to_params(nat)
        return jax.nn.sigmoid(x), jnp.sum(a * jax.nn.log_sigmoid(x) + b * jax.nn.log_sigmoid(-x))

    def laplace_precision(self, nat: NatParams) -> jax.Array:
        """``diag(a b / (a + b))``: ``(a + b) m (1 - m)`` at the mode ``m = a / (a + b)``."""
        a, b = self.to_params(nat)
        return jnp.diag(a * b / (a + b))

    def from_laplace(self, mode: jax.Array, precision: jax.Array) -> NatParams:
        """``a + b = diag(precision) / (m (1 - m))``, ``a = (a + b) m``, ``m = sigmoid(mode)``."""
        m = jax.nn.sigmoid(mode)
        total = jnp.diagonal(precision) / (m * (1.0 - m))
        return self.from_params(total * m, total * (1.0 - m))

    def reference_draws(self, dim: int) -> jax.Array:
        """``(NUM_PRIOR_DRAWS, dim)`` draws of ``Beta(2, 2)``: ``g1 / (g1 + g0)`` of two
        ``Gamma(2, 1)`` draws (:func:`gamma2_draws`)."""
        g1, g0 = gamma2_draws((2, NUM_PRIOR_DRAWS, dim))
        return g1 / (g1 + g0)

    def base(self, concentration1: jax.Array, concentration0: jax.Array) -> dist.Distribution:
        """``Beta(a, b)`` over ``(D,)`` (accurate ``log_prob`` and ``entropy`` at any
        concentration)."""
        return ConcentratedBeta(concentration1, concentration0).to_event(1)

    def mean_var(self, params: tuple) -> tuple[np.ndarray, np.ndarray]:
        """``a / (a + b)`` and ``ab / ((a + b)^2 (a + b + 1))``."""
        a, b = params
        return a / (a + b), a * b / ((a + b) ** 2 * (a + b + 1.0))

    def params_at(self, loc: jax.Array, scale: float) -> tuple:
        """Mean ``loc`` and sd ``scale * sqrt(loc (1 - loc))`` (``scale`` times the largest sd a
        distribution on ``[0, 1]`` with that mean can have): ``a + b = 1 / scale^2 - 1``; ``scale``
        must be below 1."""
        total = 1.0 / scale**2 - 1.0
        mean = jnp.clip(loc, 1e-6, 1.0 - 1e-6)
        return total * mean, total * (1.0 - mean)

    def checked_scale(self, scale: float) -> float:
        """``scale`` in ``(0, 1)``."""
        return unit_scale(self, scale)


class FlatDirichlets(dist.Distribution):
    """Independent Dirichlets over the rows of ``(..., K)`` simplices, flattened to one ``(D,)``
    event.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_pvi.families.exponential import FlatDirichlets
        >>> d = FlatDirichlets(jnp.array([1.0, 1.0, 2.0, 1.0, 1.0, 2.0]), 3)  # two simplices of 3
        >>> d.event_shape, d.mean[:3]
        ((6,), Array([0.25, 0.25, 0.5 ], dtype=float32))
    """

    arg_constraints: dict = {}
    support = constraints.real_vector
    reparametrized_params = ["concentration"]
    pytree_data_fields = ("concentration",)
    pytree_aux_fields = ("simplex_size",)

    def __init__(
        self, concentration: jax.Array, simplex_size: int, validate_args: bool | None = None
    ) -> None:
        self.concentration, self.simplex_size = concentration, int(simplex_size)
        super().__init__(
            batch_shape=(), event_shape=concentration.shape[-1:], validate_args=validate_args
        )

    @property
    def rows(self) -> dist.Dirichlet:
        return ConcentratedDirichlet(self.concentration.reshape(-1, self.simplex_size))

    def _flat(self, x: jax.Array) -> jax.Array:
        return x.reshape(x.shape[:-2] + (-1,))

    def sample(self, key: jax.Array, sample_shape: tuple = ()) -> jax.Array:
        return self._flat(self.rows.sample(key, sample_shape))

    def rsample(self, key: jax.Array, sample_shape: tuple = ()) -> jax.Array:
        return self.sample(key, sample_shape)

    def log_prob(self, value: jax.Array) -> jax.Array:
        return jnp.sum(
            self.rows.log_prob(value.reshape(value.shape[:-1] + (-1, self.simplex_size))), axis=-1
        )

    def entropy(self) -> jax.Array:
        return jnp.sum(self.rows.entropy(), axis=-1)

    @property
    def mean(self) -> jax.Array:
        return self._flat(self.rows.mean)

    @property
    def variance(self) -> jax.Array:
        return self._flat(self.rows.variance)


@kl_divergence.register(FlatDirichlets, FlatDirichlets)
def _kl_flat_dirichlets(p: FlatDirichlets, q: FlatDirichlets) -> jax.Array:
    return jnp.sum(kl_divergence(p.rows, q.rows), axis=-1)


class Dirichlet(ExponentialFamily):
    """Dirichlet factors over one simplex site of shape ``(K,)`` or ``(..., K)`` (a batch of
    simplices, independent rows): ``eta1 = alpha - 1`` flattened (``eta2`` is empty).

    Conjugate to categorical and multinomial likelihoods of the probabilities. The site's shape is
    read when PVI builds its problem, which holds the laid-out copy (``problem.family``); the
    instance itself is never changed. Unlaid (``shape`` ``None``), it reads ``(D,)`` as one simplex.

    **Example:** ``pvi.SiteFamilies({"probs": pvi.Dirichlet()})``.

    .. doctest::

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.Dirichlet().to_params(pvi.Dirichlet().from_params(jnp.array([1.0, 2.0, 3.0])))
        (Array([1., 2., 3.], dtype=float32),)
    """

    support = constraints.simplex
    transform_type = StickBreakingTransform
    param_names = ("concentration",)

    def __init__(self) -> None:
        self.shape: tuple | None = None  # the site's shape, once laid out

    def _eta2_size(self, dim: int) -> int:
        return 0

    def check_shapes(self, shapes: list) -> None:
        """One simplex site, of shape ``(K,)`` or ``(..., K)``."""
        if len(shapes) != 1:
            raise ValueError(
                f"Dirichlet() holds one simplex site; got {len(shapes)} sites: give each its own "
                f"Dirichlet() in pvi.SiteFamilies({{...}})."
            )

    def with_layout(self, layout: Any, shapes: dict) -> Dirichlet:
        """A copy that records its one simplex site's shape (this instance is left as it was, so
        one ``pvi.Dirichlet()`` may configure any number of sites and models)."""
        self.check_shapes([tuple(shape) for shape in shapes.values()])
        laid_out = copy.copy(self)
        laid_out.shape = tuple(next(iter(shapes.values())))
        return laid_out

    def _rows(self, x: Any) -> Any:
        """``(D,)`` -> ``(B, K)``: the simplices (one row unless the site is a batch of them)."""
        return x.reshape(-1, x.shape[-1] if self.shape is None else self.shape[-1])

    def to_params(self, nat: NatParams) -> tuple:
        """``(alpha,)``."""
        return (nat.eta1 + 1.0,)

    def from_params(self, concentration: jax.Array) -> NatParams:
        """From the (flattened) concentrations ``alpha`` ``(D,)``."""
        return NatParams(
            concentration - 1.0, jnp.zeros(concentration.shape[:-1] + (0,), concentration.dtype)
        )

    def stats(self, theta: jax.Array) -> jax.Array:
        """``log theta``."""
        return jnp.log(theta)

    def mean_stats(self, params: tuple) -> jax.Array:
        """``digamma(alpha) - digamma(sum alpha)`` per simplex."""
        rows = self._rows(params[0])
        return (digamma(rows) - digamma(jnp.sum(rows, axis=-1, keepdims=True))).reshape(-1)

    def reference_draws(self, dim: int) -> jax.Array:
        """``(NUM_PRIOR_DRAWS, dim)`` draws of ``Dirichlet(2, ..., 2)`` on each simplex:
        ``Gamma(2, 1)`` draws (:func:`gamma2_draws`) divided by their simplex's sum."""
        rows = self._rows(gamma2_draws((NUM_PRIOR_DRAWS, dim)))  # every draw's simplices
        return (rows / jnp.sum(rows, axis=-1, keepdims=True)).reshape(NUM_PRIOR_DRAWS, dim)

    def base(self, concentration: jax.Array) -> dist.Distribution:
        """``Dirichlet(alpha)`` over ``(K,)``, or :class:`FlatDirichlets` over a batch of
        simplices."""
        if self.shape is None or len(self.shape) == 1:
            return ConcentratedDirichlet(concentration)
        return FlatDirichlets(concentration, self.shape[-1])

    def mean_var(self, params: tuple) -> tuple[np.ndarray, np.ndarray]:
        """``alpha / alpha_0`` and ``alpha (alpha_0 - alpha) / (alpha_0^2 (alpha_0 + 1))`` per
        simplex."""
        alpha = self._rows(np.asarray(params[0]))
        total = np.sum(alpha, axis=-1, keepdims=True)
        mean, var = alpha / total, alpha * (total - alpha) / (total**2 * (total + 1.0))
        return mean.reshape(-1), var.reshape(-1)

    def params_at(self, loc: jax.Array, scale: float) -> tuple:
        """Mean ``loc / sum(loc)`` (per simplex) and sd ``scale * sqrt(m_k (1 - m_k))`` in every
        coordinate (as
        :class:`Beta`): ``alpha_0 = 1 / scale^2 - 1``; ``scale`` must be below 1."""
        mean = self._rows(jnp.clip(loc, 1e-6, None))
        return (
            (1.0 / scale**2 - 1.0) * (mean / jnp.sum(mean, axis=-1, keepdims=True)).reshape(-1),
        )

    def checked_scale(self, scale: float) -> float:
        """``scale`` in ``(0, 1)``."""
        return unit_scale(self, scale)

    def laplace_start(self, nat: NatParams) -> jax.Array:
        """``log alpha`` centred per simplex. The Laplace coordinates are ``theta = softmax(x)`` per
        simplex with a gauge term ``-(sum x)^2 / 2`` (``x`` and ``x + c`` are one ``theta``): the
        log density is ``sum_k alpha_k log theta_k - (sum_k x_k)^2 / 2``, mode ``theta = alpha /
        alpha_0``, ``sum x = 0``."""
        logs = jnp.log(self._rows(self.to_params(nat)[0]))
        return (logs - jnp.mean(logs, axis=-1, keepdims=True)).reshape(-1)

    def laplace_log_density(self, nat: NatParams, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(softmax(x) per simplex, sum alpha log theta - (sum x)^2 / 2)``."""
        rows = self._rows(x)
        log_theta = jax.nn.log_softmax(rows, axis=-1)
        alpha = self._rows(self.to_params(nat)[0])
        value = jnp.sum(alpha * log_theta) - 0.5 * jnp.sum(jnp.sum(rows, axis=-1) ** 2)
        return jnp.exp(log_theta).reshape(-1), value

    def laplace_precision(self, nat: NatParams) -> jax.Array:
        """Per simplex ``alpha_0 (diag(m) - m m^T) + 1 1^T`` at ``m = alpha / alpha_0``."""
        alpha = self._rows(self.to_params(nat)[0])
        total = jnp.sum(alpha, axis=-1, keepdims=True)
        mean = alpha / total
        count, size = alpha.shape
        blocks = (
            total[:, :, None] * (jax.vmap(jnp.diag)(mean) - mean[:, :, None] * mean[:, None, :])
            + 1.0
        )
        return (jnp.eye(count)[:, None, :, None] * blocks[:, :, None, :]).reshape(
            count * size, count * size
        )

    def from_laplace(self, mode: jax.Array, precision: jax.Array) -> NatParams:
        """``alpha = alpha_0 softmax(mode)`` per simplex, ``alpha_0`` from the trace of the
        simplex's block: ``trace = alpha_0 (1 - sum m^2) + K``."""
        rows = self._rows(mode)
        count, size = rows.shape
        mean = jax.nn.softmax(rows, axis=-1)
        blocks = jnp.diagonal(precision).reshape(count, size)
        total = (jnp.sum(blocks, axis=-1) - size) / (1.0 - jnp.sum(mean**2, axis=-1))
        return self.from_params((total[:, None] * mean).reshape(-1))

    def chain_dim(self, dim: int) -> int:
        """``K - 1`` stick-breaking coordinates per simplex of ``K``."""
        return dim - dim // (dim if self.shape is None else self.shape[-1])

    def unconstrain(self, theta: jax.Array) -> jax.Array:
        """Stick-breaking coordinates of every simplex, flattened: ``(..., chain_dim(D))``."""
        size = theta.shape[-1] if self.shape is None else self.shape[-1]
        rows = theta.reshape(theta.shape[:-1] + (-1, size))
        x = biject_to(self.support).inv(rows)
        return x.reshape(x.shape[:-2] + (-1,))

    def constrain(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The simplices of stick-breaking coordinates ``x`` ``(chain_dim(D),)``, flattened, and the
        log Jacobian."""
        size = x.shape[-1] if self.shape is None else self.shape[-1] - 1
        transform = biject_to(self.support)
        rows = x.reshape(-1, size)
        theta = transform(rows)
        return theta.reshape(-1), jnp.sum(transform.log_abs_det_jacobian(rows, theta))
