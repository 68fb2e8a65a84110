"""Exponential families in a site's own space: :class:`Gamma`, :class:`Beta`, :class:`Dirichlet`.

A factor is ``t(theta) = exp(eta1 . T1(theta) + eta2 . T2(theta))`` over the site's *constrained* value
``theta`` (no bijection to unconstrained space: the block's coordinates are ``theta`` itself):

============  =====================================  ==========================  ======================
family        density of ``q``                       ``(T1, T2)``                ``(eta1, eta2)``
============  =====================================  ==========================  ======================
``Gamma``     ``theta^(a-1) exp(-b theta)``           ``(log theta, theta)``      ``(a - 1, -b)``
``Beta``      ``theta^(a-1) (1 - theta)^(b-1)``       ``(log theta, log(1-theta))``  ``(a - 1, b - 1)``
``Dirichlet`` ``prod_k theta_k^(a_k - 1)``            ``(log theta, -)``          ``(a - 1, ())``
============  =====================================  ==========================  ======================

Products and quotients are sums and differences of natural parameters, as for the Gaussians, so the
merge, cavities and damping are unchanged. ``Gamma`` and ``Beta`` are elementwise over every coordinate;
``Dirichlet`` is one simplex of ``K`` coordinates. A prior of the same family is exact; a conjugate
likelihood (Poisson / exponential / Normal-precision for ``Gamma``, Bernoulli / binomial for ``Beta``,
categorical / multinomial for ``Dirichlet``) has a site that is exactly linear in ``T``, which
:meth:`ExponentialFamily.site_from_draws` recovers exactly by least squares (the natural gradient of
``E_q[f]`` is the regression coefficient of ``f`` on ``T`` under ``q``: Salimans & Knowles 2013).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax.scipy.special import digamma
from numpyro.distributions import constraints
from numpyro.distributions.transforms import (
    ExpTransform,
    IdentityTransform,
    IndependentTransform,
    SigmoidTransform,
    StickBreakingTransform,
)

from numpyro_pvi.families.params import Marginals, NatParams


def regression_site(stats: jax.Array, values: jax.Array) -> jax.Array:
    """Least-squares coefficients of ``values`` ``(S,)`` on ``[1, stats]`` ``(S, P)``, intercept dropped: ``(P,)``.

    Exact (to float precision) when ``values`` is an affine function of the statistics.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_pvi.families.exponential import regression_site
        >>> x = jnp.array([[1.0, 2.0], [2.0, 1.0], [3.0, 5.0], [0.5, 0.1]])
        >>> regression_site(x, 4.0 + x @ jnp.array([2.0, -1.0])).round(4)
        Array([ 2., -1.], dtype=float32)
    """
    center, spread = jnp.mean(stats, axis=0), jnp.std(stats, axis=0)
    spread = jnp.where(spread > 0, spread, 1.0)
    design = jnp.concatenate([jnp.ones_like(values)[:, None], (stats - center) / spread], axis=1)
    coef, *_ = jnp.linalg.lstsq(design, values - jnp.mean(values))
    return coef[1:] / spread


def _base_transform(transform: Any) -> Any:
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    return transform


class ExponentialFamily:
    """What :class:`Gamma`, :class:`Beta` and :class:`Dirichlet` share (a subclass gives the members below).

    Subclasses set ``support`` (the constraint of the site values they hold), ``transform_type`` (the type
    of ``biject_to(support)`` a fitting site has) and ``param_names``, and implement :meth:`to_params`,
    :meth:`from_params`, :meth:`stats`, :meth:`base` and :meth:`mean_var`.
    """

    support: constraints.Constraint
    transform_type: type
    param_names: tuple

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ------------------------------------------------------------------ what a subclass gives
    def to_params(self, nat: NatParams) -> tuple:
        """The distribution's parameters (e.g. concentration and rate)."""
        raise NotImplementedError

    def from_params(self, *params: jax.Array) -> NatParams:
        """Natural parameters from the distribution's parameters."""
        raise NotImplementedError

    def stats(self, theta: jax.Array) -> jax.Array:
        """Sufficient statistics ``(S, P)`` of draws ``(S, D)``, ordered as ``concatenate([eta1, eta2])``."""
        raise NotImplementedError

    def base(self, *params: jax.Array) -> dist.Distribution:
        """The NumPyro distribution over ``(D,)`` with these parameters."""
        raise NotImplementedError

    def mean_var(self, params: tuple) -> tuple[np.ndarray, np.ndarray]:
        """Marginal means and variances (float64 numpy) of valid parameters."""
        raise NotImplementedError

    def mean_stats(self, params: tuple) -> jax.Array:
        """``E[T]`` ``(P,)`` of the member with these parameters, ordered as :meth:`stats`."""
        raise NotImplementedError

    def check_sizes(self, sizes: list) -> None:
        """Raise ``ValueError`` if the family cannot hold sites of these flat sizes."""

    # ------------------------------------------------------------------ core
    def zeros(self, dim: int) -> NatParams:
        """The flat factor ``t = 1``."""
        return NatParams(jnp.zeros(dim), jnp.zeros(self._eta2_size(dim)))

    def _eta2_size(self, dim: int) -> int:
        return dim

    def is_valid(self, nat: NatParams) -> jax.Array:
        """Whether ``nat`` is a proper, finite member (every parameter positive)."""
        params = self.to_params(nat)
        finite = jnp.all(jnp.isfinite(nat.eta1)) & jnp.all(jnp.isfinite(nat.eta2))
        return finite & jnp.all(jnp.stack([jnp.all(p > 0) for p in params]))

    def to_dist(self, nat: NatParams) -> dist.Distribution:
        """``q`` as a NumPyro distribution over the block's values."""
        return self.base(*self.to_params(nat))

    def marginals(self, nat: Any) -> Marginals:
        """Marginal means and variances in float64 numpy (NaN where improper); ``precision`` is ``1 / variance``."""
        params = tuple(np.asarray(p, dtype=np.float64) for p in self.to_params(NatParams(
            np.asarray(nat.eta1, dtype=np.float64), np.asarray(nat.eta2, dtype=np.float64))))
        proper = np.all([np.all(p > 0) for p in params])
        if not proper:
            nan = np.full(np.shape(nat.eta1), np.nan)
            return Marginals(nan, nan, nan)
        mean, var = self.mean_var(params)
        return Marginals(mean, var, 1.0 / var)

    def prepare_sites(self, sites: Any) -> Any:
        """Every global site in its own space (identity transform); ``ValueError`` if one has another support."""
        out = []
        for site in sites.globals:
            if not isinstance(_base_transform(site.transform), self.transform_type):
                raise ValueError(f"{self!r} holds sites with support {self.support}, but global site '{site.name}' "
                                 f"has a prior on another support (transform {site.transform}). Give it another "
                                 "family with pvi.SiteFamilies({...}).")
            out.append(replace(site, flat_shape=tuple(site.shape), transform=IdentityTransform()))
        self.check_sizes([int(np.prod(s.shape, dtype=np.int64)) for s in sites.globals])
        gaussian = {k: v for k, v in sites.gaussian_prior.items() if k not in {s.name for s in out}}
        return replace(sites, globals=tuple(out), gaussian_prior=gaussian)

    # ------------------------------------------------------------------ guide
    def guide_params(self, nat: NatParams) -> tuple:
        """The distribution's parameters."""
        return self.to_params(nat)

    def params_distribution(self, params: tuple) -> dist.Distribution:
        """The distribution with these parameters."""
        return self.base(*params)

    def guide(self, prefix: str, params: tuple) -> dist.Distribution:
        """``numpyro.param`` sites ``prefix + name`` per parameter, ``positive`` (optimised in log space)."""
        values = [numpyro.param(prefix + name, value, constraint=constraints.positive)
                  for name, value in zip(self.param_names, params)]
        return self.base(*values)

    def from_guide(self, prefix: str, values: dict) -> NatParams:
        """From the guide's constrained parameters."""
        return self.from_params(*(values[prefix + name] for name in self.param_names))

    # ------------------------------------------------------------------ natural-gradient site
    def draw(self, nat: NatParams, rng_key: jax.Array, pairs: int) -> jax.Array:
        """``pairs`` draws from ``q``, each twice (so that they pair with a Gaussian block's antithetic draws)."""
        half = self.to_dist(nat).sample(rng_key, (pairs,))
        return jnp.concatenate([half, half])

    def site_from_draws(self, nat: NatParams, zeta: jax.Array, values: jax.Array, grads: jax.Array,
                        hessians: jax.Array | None) -> NatParams:
        """``grad_mu E_q[f]``: the least-squares coefficients of ``f`` on the sufficient statistics under ``q``."""
        coef = regression_site(self.stats(zeta), values)
        dim = zeta.shape[-1]
        return NatParams(coef[:dim], coef[dim:])

    # ------------------------------------------------------------------ moment matching
    def match_moments(self, proposal: NatParams, zeta: jax.Array, weights: jax.Array) -> NatParams:
        """The member with ``E[T]`` = the weighted mean of ``T`` (control variate: the proposal's exact ``E[T]``)."""
        stats = self.stats(zeta)
        target = self.mean_stats(self.to_params(proposal)) + (weights - 1.0 / weights.shape[0]) @ stats
        return self.from_mean_stats(target, proposal)

    def from_mean_stats(self, target: jax.Array, start: NatParams, num_newton: int = 30) -> NatParams:
        """The member with ``E[T] = target``, by Newton steps in the log parameters from ``start``."""
        count = len(self.param_names)

        def residual(x: jax.Array) -> jax.Array:
            return self.mean_stats(tuple(jnp.split(jnp.exp(x), count))) - target

        def newton(x: jax.Array, _: None) -> tuple[jax.Array, None]:
            step = jnp.linalg.solve(jax.jacfwd(residual)(x), residual(x))
            return x - jnp.clip(step, -1.0, 1.0), None

        x, _ = jax.lax.scan(newton, jnp.log(jnp.concatenate(self.to_params(start))), None, length=num_newton)
        return self.from_params(*jnp.split(jnp.exp(x), count))


class Gamma(ExponentialFamily):
    """Gamma factors over positive sites, elementwise: ``eta1 = shape - 1``, ``eta2 = -rate``.

    Conjugate to Poisson, exponential and gamma (known shape) likelihoods of a rate and to a Normal
    likelihood's precision. Valid when shape and rate are positive.

    **Example:** ``pvi.SiteFamilies({"rate": pvi.Gamma()})``, or ``pvi.Gamma()`` when every global site is positive.

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

    def base(self, concentration: jax.Array, rate: jax.Array) -> dist.Distribution:
        """``Gamma(shape, rate)`` over ``(D,)``."""
        return dist.Gamma(concentration, rate).to_event(1)

    def mean_var(self, params: tuple) -> tuple[np.ndarray, np.ndarray]:
        """``a / b`` and ``a / b^2``."""
        a, b = params
        return a / b, a / b**2


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

    def base(self, concentration1: jax.Array, concentration0: jax.Array) -> dist.Distribution:
        """``Beta(a, b)`` over ``(D,)``."""
        return dist.Beta(concentration1, concentration0).to_event(1)

    def mean_var(self, params: tuple) -> tuple[np.ndarray, np.ndarray]:
        """``a / (a + b)`` and ``ab / ((a + b)^2 (a + b + 1))``."""
        a, b = params
        return a / (a + b), a * b / ((a + b) ** 2 * (a + b + 1.0))


class Dirichlet(ExponentialFamily):
    """Dirichlet factors over one simplex site of ``K`` coordinates: ``eta1 = alpha - 1`` (``eta2`` is empty).

    Conjugate to categorical and multinomial likelihoods of the probabilities.

    **Example:** ``pvi.SiteFamilies({"probs": pvi.Dirichlet()})``.

    .. doctest::

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.Dirichlet().to_params(pvi.Dirichlet().from_params(jnp.array([1.0, 2.0, 3.0])))
        (Array([1., 2., 3.], dtype=float32),)
    """

    support = constraints.simplex
    transform_type = StickBreakingTransform
    param_names = ("concentration",)

    def _eta2_size(self, dim: int) -> int:
        return 0

    def check_sizes(self, sizes: list) -> None:
        """One simplex site."""
        if len(sizes) != 1:
            raise ValueError(f"Dirichlet() holds one simplex site of shape (K,); got {len(sizes)} sites: give each "
                             "its own Dirichlet() in pvi.SiteFamilies({...}).")

    def to_params(self, nat: NatParams) -> tuple:
        """``(alpha,)``."""
        return (nat.eta1 + 1.0,)

    def from_params(self, concentration: jax.Array) -> NatParams:
        """From the concentrations ``alpha`` ``(K,)``."""
        return NatParams(concentration - 1.0, jnp.zeros(concentration.shape[:-1] + (0,), concentration.dtype))

    def stats(self, theta: jax.Array) -> jax.Array:
        """``log theta``."""
        return jnp.log(theta)

    def mean_stats(self, params: tuple) -> jax.Array:
        """``digamma(alpha) - digamma(sum alpha)``."""
        (alpha,) = params
        return digamma(alpha) - digamma(jnp.sum(alpha))

    def base(self, concentration: jax.Array) -> dist.Distribution:
        """``Dirichlet(alpha)`` over ``(K,)``."""
        return dist.Dirichlet(concentration)

    def mean_var(self, params: tuple) -> tuple[np.ndarray, np.ndarray]:
        """``alpha / alpha_0`` and ``alpha (alpha_0 - alpha) / (alpha_0^2 (alpha_0 + 1))``."""
        (alpha,) = params
        total = np.sum(alpha)
        return alpha / total, alpha * (total - alpha) / (total**2 * (total + 1.0))
