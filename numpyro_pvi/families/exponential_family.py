"""The base class of the exponential families in a site's own space: :class:`ExponentialFamily`.

What :class:`~numpyro_pvi.Gamma`, :class:`~numpyro_pvi.Beta` and :class:`~numpyro_pvi.Dirichlet`
(:mod:`numpyro_pvi.families.exponential`) share: natural parameters, validity, the guide, the
least-squares natural-gradient site (:func:`regression_site`), moment matching, the chosen start and
the exact prior.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.distributions.transforms import (
    IdentityTransform,
    IndependentTransform,
    biject_to,
)

from numpyro_pvi.families.chain_moments import MeanParamChains, refuse_site_clamp
from numpyro_pvi.families.factor import member_proposal
from numpyro_pvi.families.params import Marginals, NatParams, Proposal
from numpyro_pvi.families.reparameterised import GuideParameters

#: EP takes no step from importance weights with fewer effective draws than this
#: (:meth:`ExponentialFamily.min_effective_draws`).
MIN_EFFECTIVE_DRAWS = 10

# draws at which an exponential-family block's prior is read off by least squares
NUM_PRIOR_DRAWS = 256
NUM_FRAME_DRAWS = 256  # draws of q that standardise SNEP's chain coordinates (chain_frame)
# largest relative residual of that fit: above it, the prior is not of the family
PRIOR_RESIDUAL = 1e-3


def gamma2_draws(shape: tuple) -> jax.Array:
    """Draws of ``Gamma(2, 1)`` of ``shape``, each the sum of two standard exponentials (fixed key):
    what the families' reference points (:meth:`ExponentialFamily.reference_draws`) are made of.

    ``jax.random.gamma``'s rejection sampler compiles for 0.6-0.9 s in a fresh process (most of an
    exponential-family block's ``init``); the exponentials' uniforms compile in milliseconds.

    **Example:** ``gamma2_draws((256, 3)) / 2.0`` are 256 draws of ``Gamma(2, rate=2)`` in each of
    3 coordinates.
    """
    return jnp.sum(jax.random.exponential(jax.random.PRNGKey(0), (2, *shape)), axis=0)


def regression_site(stats: jax.Array, values: jax.Array) -> jax.Array:
    """Least-squares coefficients of ``values`` ``(S,)`` on ``[1, stats]`` ``(S, P)``, intercept
    dropped: ``(P,)``.

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


@functools.partial(jax.jit, static_argnums=0)
def _fit_prior(
    family: ExponentialFamily, values: jax.Array, points: jax.Array
) -> tuple[NatParams, jax.Array, jax.Array]:
    """``family``'s natural parameters fitted to the prior's log density ``values`` at ``points``
    (:func:`regression_site` on the statistics), the largest residual and the values' spread.

    One compiled program (eagerly, its 20 operations compiled one program each in a fresh process,
    0.6 s of a Gamma prior's start-up).
    """
    stats = family.stats(points)
    coef = regression_site(stats, values)
    fitted = (stats - jnp.mean(stats, axis=0)) @ coef
    residual = jnp.max(jnp.abs(values - jnp.mean(values) - fitted))
    dim = points.shape[-1]
    return NatParams(coef[:dim], coef[dim:]), residual, jnp.std(values)


def _base_transform(transform: Any) -> Any:
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    return transform


class ExponentialFamily:
    """What :class:`Gamma`, :class:`Beta` and :class:`Dirichlet` share (a subclass gives the members
    below).

    Subclasses set ``support`` (the constraint of the site values they hold), ``transform_type``
    (the type of ``biject_to(support)`` a fitting site has) and ``param_names``, and implement
    :meth:`to_params`,
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
        """Sufficient statistics ``(S, P)`` of draws ``(S, D)``, ordered as ``concatenate([eta1,
        eta2])``."""
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

    def check_shapes(self, shapes: list) -> None:
        """Raise ``ValueError`` if the family cannot hold sites of these shapes (records
        nothing)."""

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
        """Marginal means and variances in float64 numpy (NaN where improper); ``precision`` is ``1
        / variance``."""
        params = tuple(
            np.asarray(p, dtype=np.float64)
            for p in self.to_params(
                NatParams(
                    np.asarray(nat.eta1, dtype=np.float64), np.asarray(nat.eta2, dtype=np.float64)
                )
            )
        )
        proper = np.all([np.all(p > 0) for p in params])
        if not proper:
            nan = np.full(np.shape(nat.eta1), np.nan)
            return Marginals(nan, nan, nan)
        mean, var = self.mean_var(params)
        return Marginals(mean, var, 1.0 / var)

    def lay_out(self, sites: Any) -> tuple[ExponentialFamily, Any]:
        """``(family, sites)``: the family laid out for the global sites' shapes
        (:meth:`with_layout`) and every global site in its own space (identity transform);
        ``ValueError`` if one has another support."""
        out = []
        for site in sites.globals:
            if not isinstance(_base_transform(site.transform), self.transform_type):
                raise ValueError(
                    f"{self!r} holds sites with support {self.support}, but global site "
                    f"'{site.name}' has a prior on another support (transform {site.transform}). "
                    f"Give it another family with pvi.SiteFamilies({{...}})."
                )
            out.append(replace(site, flat_shape=tuple(site.shape), transform=IdentityTransform()))
        family = self.with_layout(None, {s.name: tuple(s.shape) for s in sites.globals})
        gaussian = {k: v for k, v in sites.gaussian_prior.items() if k not in {s.name for s in out}}
        return family, replace(sites, globals=tuple(out), gaussian_prior=gaussian)

    # ------------------------------------------------------------------ guide
    def guide_params(self, nat: NatParams) -> tuple:
        """The distribution's parameters."""
        return self.to_params(nat)

    def params_distribution(self, params: tuple) -> dist.Distribution:
        """The distribution with these parameters."""
        return self.base(*params)

    def guide(self, prefix: str, params: tuple) -> dist.Distribution:
        """``numpyro.param`` sites ``prefix + name`` per parameter, ``positive`` (optimised in log
        space)."""
        values = [
            numpyro.param(prefix + name, value, constraint=constraints.positive)
            for name, value in zip(self.param_names, params)
        ]
        return self.base(*values)

    def from_guide(self, prefix: str, values: dict) -> NatParams:
        """From the guide's constrained parameters."""
        return self.from_params(*(values[prefix + name] for name in self.param_names))

    # ------------------------------------------------------------------ natural-gradient site
    def draw(self, nat: NatParams, rng_key: jax.Array, pairs: int) -> jax.Array:
        """``pairs`` draws from ``q``, each twice (so that they pair with a Gaussian block's
        antithetic draws)."""
        half = self.to_dist(nat).sample(rng_key, (pairs,))
        return jnp.concatenate([half, half])

    def site_from_draws(
        self,
        nat: NatParams,
        zeta: jax.Array,
        values: jax.Array,
        grads: jax.Array,
        hessians: jax.Array | None,
    ) -> NatParams:
        """``grad_mu E_q[f]``: the least-squares coefficients of ``f`` on the sufficient statistics
        under ``q``."""
        coef = regression_site(self.stats(zeta), values)
        dim = zeta.shape[-1]
        return NatParams(coef[:dim], coef[dim:])

    # ------------------------------------------------------------------ moment matching
    def laplace_proposal(
        self, mode: jax.Array, precision: jax.Array, rng_key: jax.Array, pairs: int
    ) -> Proposal:
        """Draws of the member :meth:`from_laplace`
        (:func:`~numpyro_pvi.families.factor.member_proposal`)."""
        return member_proposal(self, self.from_laplace(mode, precision), rng_key, pairs)

    def min_effective_draws(self) -> int:
        """``MIN_EFFECTIVE_DRAWS``: the member matched to fewer effective draws is concentrated on
        them (sweep cell 3 of issue 23: a Gamma block's shape went from 179 to ``9e9`` in one EP
        step, from 2 effective draws of 1,024)."""
        return MIN_EFFECTIVE_DRAWS

    def match_moments(self, proposal: NatParams, zeta: jax.Array, weights: jax.Array) -> NatParams:
        """The member with ``E[T]`` = the weighted mean of ``T`` (control variate: the proposal's
        exact ``E[T]``)."""
        stats = self.stats(zeta)
        target = (
            self.mean_stats(self.to_params(proposal)) + (weights - 1.0 / weights.shape[0]) @ stats
        )
        return self.from_mean_stats(target, proposal)

    def from_mean_stats(
        self, target: jax.Array, start: NatParams, num_newton: int = 30
    ) -> NatParams:
        """The member with ``E[T] = target``, by Newton steps in the log parameters from
        ``start``."""
        count = len(self.param_names)

        def residual(x: jax.Array) -> jax.Array:
            return self.mean_stats(tuple(jnp.split(jnp.exp(x), count))) - target

        def newton(x: jax.Array, _: None) -> tuple[jax.Array, None]:
            step = jnp.linalg.solve(jax.jacfwd(residual)(x), residual(x))
            return x - jnp.clip(step, -1.0, 1.0), None

        x, _ = jax.lax.scan(
            newton, jnp.log(jnp.concatenate(self.to_params(start))), None, length=num_newton
        )
        return self.from_params(*jnp.split(jnp.exp(x), count))

    # ------------------------------------------------------------------ mean parameters (SNEP;
    # MeanParamFamily)
    def mean_param_family(self) -> ExponentialFamily:
        """This family: its mean parameters are ``E_q[T]``."""
        return self

    def chain_moments(self, control_variates: bool, site_variance: tuple | None) -> MeanParamChains:
        """Stein features regressed under ``q``
        (:class:`~numpyro_pvi.families.chain_moments.MeanParamChains`); ``site_variance`` is a
        ``ValueError``."""
        refuse_site_clamp(self, site_variance)
        return MeanParamChains(self, control_variates)

    def log_factor(self, nat: NatParams, theta: jax.Array) -> jax.Array:
        """``eta . T(theta)`` of one point ``theta`` ``(D,)``."""
        return self.stats(theta) @ jnp.concatenate([nat.eta1, nat.eta2], axis=-1)

    def _split_stats(self, stats: jax.Array, dim: int) -> NatParams:
        return NatParams(stats[..., :dim], stats[..., dim:])

    def mean_params(self, nat: NatParams) -> NatParams:
        """``E_q[T]`` (:meth:`mean_stats`), split as ``(eta1, eta2)``."""
        return self._split_stats(self.mean_stats(self.to_params(nat)), nat.eta1.shape[-1])

    def chain_mean_params(self, theta: jax.Array) -> NatParams:
        """The average of ``T`` over the rows of ``theta`` ``(C, D)``."""
        return self._split_stats(jnp.mean(self.stats(theta), axis=0), theta.shape[-1])

    def from_mean_params(self, mean: NatParams, start: NatParams) -> NatParams:
        """The member with ``E[T] = mean``: :meth:`from_mean_stats` (Newton) from ``start``."""
        return self.from_mean_stats(jnp.concatenate([mean.eta1, mean.eta2], axis=-1), start)

    def chain_dim(self, dim: int) -> int:
        """One unconstrained coordinate per value."""
        return dim

    def unconstrain(self, theta: jax.Array) -> jax.Array:
        """``biject_to(support)^{-1}`` of values ``(..., D)``: ``(..., chain_dim(D))``."""
        return biject_to(self.support).inv(theta)

    def constrain(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Values of unconstrained ``x`` ``(chain_dim(D),)`` and the log Jacobian of the map."""
        transform = biject_to(self.support)
        theta = transform(x)
        return theta, jnp.sum(transform.log_abs_det_jacobian(x, theta))

    def chain_frame(self, nat: NatParams) -> tuple[jax.Array, jax.Array]:
        """``(loc, scale)`` of ``q``'s unconstrained coordinates, from ``NUM_FRAME_DRAWS`` draws (a
        fixed key)."""
        x = self.unconstrain(self.to_dist(nat).sample(jax.random.PRNGKey(0), (NUM_FRAME_DRAWS,)))
        return jnp.mean(x, axis=0), jnp.maximum(jnp.std(x, axis=0), jnp.finfo(x.dtype).eps)

    def from_chain(self, frame: tuple, u: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Values at ``loc + scale u`` and the log Jacobian (``log scale``, a constant, left
        out)."""
        loc, scale = frame
        return self.constrain(loc + scale * u)

    def to_chain(self, frame: tuple, theta: jax.Array) -> jax.Array:
        """``(unconstrain(theta) - loc) / scale``."""
        loc, scale = frame
        return (self.unconstrain(theta) - loc) / scale

    # ------------------------------------------------------------------ start and prior
    def initial_q(self, loc: jax.Array, scale: float) -> NatParams:
        """The chosen start, moment-matched: mean ``loc`` (the site's own value) and a spread set by
        ``scale`` (see the subclass's :meth:`params_at`)."""
        return self.from_params(*self.params_at(jnp.asarray(loc), self.checked_scale(scale)))

    def params_at(self, loc: jax.Array, scale: float) -> tuple:
        """The parameters of the member with mean ``loc`` and spread ``scale``."""
        raise NotImplementedError

    def checked_scale(self, scale: float) -> float:
        """``scale`` if this family can take it; ``ValueError`` otherwise."""
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"{self!r}: init_scale must be a positive number, got {scale!r}.")
        return float(scale)

    def reference_draws(self, dim: int) -> jax.Array:
        """``(NUM_PRIOR_DRAWS, dim)`` draws of the member with every parameter 2 (points in the
        block's support)."""
        params = [jnp.full((dim,), 2.0)] * len(self.param_names)
        return self.base(*params).sample(jax.random.PRNGKey(0), (NUM_PRIOR_DRAWS,))

    def exact_prior(self, sites: Any, prior_values: Callable) -> tuple[NatParams, tuple]:
        """The block's prior read off exactly (least squares of its log density on the sufficient
        statistics).

        :param prior_values: ``names -> (values (S,), points (S, D))``: the prior's log density of
            the sites ``names`` at ``S`` points of the block's space.
        :raises ValueError: if the prior is not a member of this family with fixed parameters.
        """
        names = tuple(s.name for s in sites.globals)
        prior, residual, spread = _fit_prior(self, *prior_values(names))
        residual = float(residual)
        if not np.isfinite(residual) or residual > PRIOR_RESIDUAL * (1.0 + float(spread)):
            kind = type(self).__name__
            raise ValueError(
                f"The prior of {list(names)} is not a {kind} distribution with fixed parameters, "
                f"which {self!r} needs (its prior enters q exactly; an exponential-family block "
                f"has no prior factor t_0). Use a {kind} prior (it is conjugate), or a Gaussian "
                "family for this site (pvi.MeanFieldGaussian() or pvi.FullRankGaussian(), which "
                "fit any prior)."
            )
        return prior, ()

    def standard_normal(self, mask: Any) -> NatParams:
        """Flat: an exponential-family block has no prior factor (``ValueError`` if ``mask`` asks
        for one)."""
        self._no_prior_factor(mask)
        return self.zeros(int(np.shape(mask)[0]))

    def draws_at(self, nat: NatParams, eps: jax.Array) -> jax.Array:
        """``S`` draws of ``nat`` with a fixed key (a deterministic function of ``nat``), ``eps``
        ``(S, D)``."""
        return self.to_dist(nat).sample(jax.random.PRNGKey(0), (eps.shape[0],))

    def prior_site(
        self, q: NatParams, eps: jax.Array, log_density: Callable, mask: Any, use_hessian: bool
    ) -> NatParams:
        """Flat: an exponential-family block has no prior factor (``ValueError`` if ``mask`` asks
        for one)."""
        self._no_prior_factor(mask)
        return self.zeros(eps.shape[-1])

    def _no_prior_factor(self, mask: Any) -> None:
        if np.any(np.asarray(mask)):
            raise ValueError(
                f"{self!r} has no prior factor t_0: its sites' prior must be of the family."
            )

    # ------------------------------------------------------------------ DP-SGD and the wire
    def reparameterised(self, dim: int) -> GuideParameters:
        """DP-SGD's parameters: the unconstrained values of the guide's sites, drawn by the
        distribution's implicitly reparameterised sampler
        (:class:`~numpyro_pvi.families.reparameterised.GuideParameters`)."""
        return GuideParameters(self, dim)

    def layout(self) -> None:
        """Nothing beyond the sites' shapes (which :meth:`with_layout` is given)."""
        return None

    def with_layout(self, layout: Any, shapes: dict) -> ExponentialFamily:
        """The family laid out for global sites of these ``shapes`` (site name -> shape):
        ``ValueError`` if it cannot hold them; this family itself when it records nothing of them
        (a ``Dirichlet`` returns a copy that records its site's shape)."""
        self.check_shapes([tuple(shape) for shape in shapes.values()])
        return self


def unit_scale(family: ExponentialFamily, scale: float) -> float:
    """``scale`` if it is in ``(0, 1)`` (a relative sd on a bounded support); ``ValueError``
    otherwise.

    **Example:** ``unit_scale(pvi.Beta(), 0.1)`` is ``0.1``.
    """
    if not (np.isfinite(scale) and 0 < scale < 1):
        raise ValueError(
            f"{family!r}: init_scale is the sd relative to its largest value sqrt(m (1 - m)) and "
            f"must be in (0, 1), got {scale!r}."
        )
    return float(scale)
