"""What the Gaussian families share: the ``GaussianFamily`` base class, :func:`expected_site` and
:func:`variance_inflation`."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

from numpyro_pvi.families.gaussian_chains import GaussianChains
from numpyro_pvi.families.params import Proposal
from numpyro_pvi.families.protocol import Family, NatParams
from numpyro_pvi.families.reparameterised import GaussianParameters

# points at which a block's prior is read off (see ExponentialFamily.exact_prior)
NUM_PRIOR_DRAWS = 256


def variance_inflation(family: Any, cov: jax.Array, num_draws: Any = None) -> jax.Array:
    """How far the correlations of a dense covariance ``(D, D)`` that ``family``'s form cannot hold
    inflate a variance.

    The variance inflation of coordinate ``i`` is ``Sigma_ii (Sigma^{-1})_ii``: its marginal
    variance over its variance with every other coordinate fixed (``1 / (1 - rho^2)`` for two
    coordinates of correlation ``rho``). Returned: the largest ratio of that of ``cov`` to that of
    the part of ``cov`` the family holds (:func:`held_covariance`), so ``1`` for a family that holds
    every correlation (``FullRankGaussian``) and ``cov``'s own largest variance inflation for
    ``MeanFieldGaussian``; ``1`` if it is not finite. EP and SNEP report it for their tilted
    distributions (``ClientResult.inflation``; with ``SiteFamilies`` and the exponential families
    from the tilted draws' covariance): with more than one client a factorised family's EP fixed
    point is then neither the posterior's marginals nor mean-field VI's optimum. ``cov`` estimated
    from ``num_draws`` (effective) draws: each ratio is corrected for the share of variance that
    many independent coordinates explain by chance (``(n - D) / (n - d_i)``, ``d_i`` the coordinates
    held with ``i``; an adjusted R^2).

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> from numpyro_pvi.families.gaussian import variance_inflation
        >>> cov = jnp.array([[1.0, 0.6], [0.6, 1.0]])  # rho = 0.6: 1 / (1 - 0.36)
        >>> round(float(variance_inflation(pvi.MeanFieldGaussian(), cov)), 4)
        1.5625
        >>> round(float(variance_inflation(pvi.FullRankGaussian(), cov)), 4)
        1.0
    """
    ratio = _inflations(cov) / _inflations(held_covariance(family, cov))
    # adjusted R^2: the other coordinates, D - d_i of them not held, explain a share of
    if num_draws is not None:
        # coordinate i's variance of about (D - d_i) / n in n draws however independent they are
        held = jnp.sum(held_covariance(family, jnp.ones_like(cov)) != 0, axis=1)
        dim = cov.shape[-1]
        ratio = ratio * jnp.maximum(num_draws - dim, 1.0) / jnp.maximum(num_draws - held, 1.0)
    largest = jnp.max(ratio)
    return jnp.where(jnp.isfinite(largest), jnp.maximum(largest, 1.0), 1.0)


def weighted_covariance(zeta: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """The covariance ``(D, D)`` of draws ``zeta`` ``(N, D)`` under normalised ``weights`` ``(N,)``
    (equal if ``None``): a tilted distribution's, for :func:`variance_inflation`."""
    weights = jnp.full(zeta.shape[:1], 1.0 / zeta.shape[0]) if weights is None else weights
    centred = zeta - weights @ zeta
    return centred.T @ (weights[:, None] * centred)


def tilted_inflation(
    family: Any,
    proposal: NatParams,
    cavity: NatParams,
    loglik: Callable,
    alpha: float,
    rng_key: jax.Array,
    pairs: int = 256,
) -> jax.Array:
    """:func:`variance_inflation` of the tilted distribution ``cavity * p(y_m | zeta)^alpha`` from
    ``2 pairs`` draws of ``proposal`` (``family.draw``), importance-weighted, corrected for the
    weights' effective size (halved: ``draw`` pairs its draws). SNEP's mean-parameter path reports
    it at the end of a visit, with ``q`` as the proposal (its chains' few draws are too few for a
    covariance).

    **Example:** ``tilted_inflation(family, q, cavity, loglik, 1.0, key)``.
    """
    zeta = family.draw(proposal, rng_key, pairs)
    log_w = (
        alpha * jax.vmap(loglik)(zeta)
        + family.to_dist(cavity).log_prob(zeta)
        - family.to_dist(proposal).log_prob(zeta)
    )
    weights = jax.nn.softmax(jnp.where(jnp.isfinite(log_w), log_w, -jnp.inf))
    return variance_inflation(family, weighted_covariance(zeta, weights), 0.5 / jnp.sum(weights**2))


def held_covariance(family: Any, cov: jax.Array) -> jax.Array:
    """The part of a dense covariance ``(D, D)`` that ``family``'s form holds, as a dense matrix:
    ``cov`` itself for ``FullRankGaussian``, its diagonal for ``MeanFieldGaussian``; for
    ``SiteFamilies`` block-diagonal, each block its own family's part (correlations across blocks
    are never held); for ``Gamma`` and ``Beta`` (independent coordinates) the diagonal, for
    ``Dirichlet`` the whole block (a simplex's coordinates are the family's own).

    **Example:** ``held_covariance(pvi.MeanFieldGaussian(), cov)`` is
    ``jnp.diag(jnp.diagonal(cov))``.
    """
    from numpyro_pvi.families.exponential import Dirichlet  # noqa: PLC0415 (they import this module)
    from numpyro_pvi.families.site_families import SiteFamilies  # noqa: PLC0415

    if isinstance(family, SiteFamilies):
        return jax.scipy.linalg.block_diag(
            *[held_covariance(block, cov[a:b, a:b]) for block, a, b, _ in family.blocks]
        )
    if isinstance(family, Family):
        return family.to_dense(family.from_dense(cov))
    return cov if isinstance(family, Dirichlet) else jnp.diag(jnp.diagonal(cov))


def _inflations(cov: jax.Array) -> jax.Array:
    """``Sigma_ii (Sigma^{-1})_ii`` of every coordinate, from the correlation matrix
    (scale-free)."""
    sd = jnp.sqrt(jnp.diagonal(cov))
    return jnp.diagonal(jnp.linalg.inv(cov / jnp.outer(sd, sd)))


class GaussianFamily:
    """The code every Gaussian family shares; a family subclasses it and implements the rest of
    :class:`Family`."""

    def to_dist(self, nat: NatParams) -> dist.Distribution:
        """``q`` as a NumPyro distribution over ``zeta``."""
        return self.distribution(*self.loc_scale(nat))

    def dense_precision(self, nat: NatParams) -> jax.Array:
        """The ``(D, D)`` precision matrix."""
        return self.to_dense(self.precision(nat))

    # ------------------------------------------------------------------ mean parameters (SNEP;
    # MeanParamFamily)
    def mean_param_family(self) -> GaussianFamily:
        """This family: a Gaussian has mean parameters ``(zeta, zeta zeta^T)``."""
        return self

    def chain_moments(self, control_variates: bool, site_variance: tuple | None) -> GaussianChains:
        """SNEP's O(D^2) estimator in whitened moments, with the optional site clamp
        (:class:`~numpyro_pvi.families.gaussian_chains.GaussianChains`)."""
        return GaussianChains(self, control_variates, site_variance)

    def log_factor(self, nat: NatParams, zeta: jax.Array) -> jax.Array:
        """``eta . T(zeta)`` with ``T = (zeta, zeta zeta^T)``: :meth:`quadratic`."""
        return self.quadratic(nat, zeta)

    def mean_params(self, nat: NatParams) -> NatParams:
        """``(mu, Sigma + mu mu^T)`` (the second moment in the family's form)."""
        mean, cov = self.moments(nat)
        return NatParams(mean, cov + self.outer(mean, mean))

    def chain_mean_params(self, zeta: jax.Array) -> NatParams:
        """The sample mean and second moment (family form) of the rows of ``zeta`` ``(C, D)``."""
        return NatParams(jnp.mean(zeta, axis=0), self.outer_sum(zeta, zeta) / zeta.shape[0])

    def from_mean_params(self, mean: NatParams, start: NatParams) -> NatParams:
        """The Gaussian with these first and second moments (closed form; ``start`` is not
        needed)."""
        return self.from_moments(mean.eta1, self.sym(mean.eta2 - self.outer(mean.eta1, mean.eta1)))

    def chain_dim(self, dim: int) -> int:
        """``zeta`` is unconstrained: one coordinate per value."""
        return dim

    def chain_frame(self, nat: NatParams) -> tuple[jax.Array, jax.Array]:
        """The whitening ``(loc, scale)`` of ``q`` (:meth:`loc_scale`)."""
        return self.loc_scale(nat)

    def from_chain(self, frame: tuple, u: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``zeta = loc + L u`` (its log Jacobian is a constant: 0)."""
        return self.unwhiten(*frame, u), jnp.zeros((), u.dtype)

    def to_chain(self, frame: tuple, zeta: jax.Array) -> jax.Array:
        """``u = L^{-1} (zeta - loc)``."""
        return self.whiten(*frame, zeta)

    # ------------------------------------------------------------------ the FactorFamily contract
    def lay_out(self, sites: Any) -> tuple[GaussianFamily, Any]:
        """``(self, sites)``: Gaussian factors live in the unconstrained space of every site, so
        the family needs no layout and the sites are as read."""
        return self, sites

    def guide_params(self, nat: NatParams) -> tuple[jax.Array, jax.Array]:
        """``(loc, scale)``, as :meth:`loc_scale`."""
        return self.loc_scale(nat)

    def params_distribution(self, params: tuple) -> dist.Distribution:
        """``distribution(loc, scale)``."""
        return self.distribution(*params)

    def guide(self, prefix: str, params: tuple) -> dist.Distribution:
        """``numpyro.param`` sites ``prefix + "loc"`` and ``prefix + scale_name``, like NumPyro's
        autoguides."""
        loc = numpyro.param(prefix + "loc", params[0])
        spread = numpyro.param(
            prefix + self.scale_name, params[1], constraint=self.scale_constraint
        )
        return self.distribution(loc, spread)

    def from_guide(self, prefix: str, values: dict) -> NatParams:
        """From the guide's constrained ``loc`` and scale."""
        return self.from_loc_scale(values[prefix + "loc"], values[prefix + self.scale_name])

    def draw(self, nat: NatParams, rng_key: jax.Array, pairs: int) -> jax.Array:
        """Antithetic draws: ``z`` and ``2 mu - z`` for ``pairs`` draws ``z``."""
        loc, scale = self.loc_scale(nat)
        half = jax.random.normal(rng_key, (pairs, loc.shape[-1]), loc.dtype)
        return self.unwhiten(loc, scale, jnp.concatenate([half, -half]))

    def site_from_draws(
        self,
        nat: NatParams,
        zeta: jax.Array,
        values: jax.Array,
        grads: jax.Array,
        hessians: jax.Array | None,
    ) -> NatParams:
        """Bonnet / Price: ``eta2 = E_q[H] / 2``, ``eta1 = E_q[g] - E_q[H] mu`` (Stein's lemma
        without Hessians)."""
        loc, scale = self.loc_scale(nat)
        if hessians is None:
            hess = self.stein_hessian(grads, self.whiten(loc, scale, zeta), scale)
        else:
            hess = self.from_dense(jnp.mean(hessians, axis=0))
        return self.site_update(jnp.mean(grads, axis=0), hess, loc)

    # ------------------------------------------------------------------ Laplace site (CVI's
    # fallback)
    def laplace_start(self, nat: NatParams) -> jax.Array:
        """The mean: the Laplace coordinates are ``zeta`` itself."""
        return self.loc_scale(nat)[0]

    def laplace_log_density(self, nat: NatParams, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(x, quadratic(nat, x))``."""
        return x, self.quadratic(nat, x)

    def laplace_precision(self, nat: NatParams) -> jax.Array:
        """The dense precision."""
        return self.dense_precision(nat)

    def from_laplace(self, mode: jax.Array, precision: jax.Array) -> NatParams:
        """``N(mode, precision^-1)`` (:meth:`from_dense_precision`: mean field keeps its marginal
        variances)."""
        return self.from_dense_precision(mode, precision)

    def laplace_proposal(
        self, mode: jax.Array, precision: jax.Array, rng_key: jax.Array, pairs: int
    ) -> Proposal:
        """Antithetic draws of the dense ``N(mode, precision^-1)`` (its correlations too, which a
        mean-field member drops), with :meth:`from_laplace` as the member: for a Gaussian tilted
        distribution every weight is equal and EP's step is exact."""
        chol_precision = jnp.linalg.cholesky(precision)
        inv = jax.scipy.linalg.solve_triangular(
            chol_precision, jnp.eye(mode.shape[-1], dtype=mode.dtype), lower=True
        )
        chol_cov = jnp.linalg.cholesky(inv.T @ inv)
        half = jax.random.normal(rng_key, (pairs, mode.shape[-1]), mode.dtype)
        eps = jnp.concatenate([half, -half])
        return Proposal(
            self.from_laplace(mode, precision),
            mode + eps @ chol_cov.T,
            -0.5 * jnp.sum(eps**2, axis=-1),
        )

    def min_effective_draws(self) -> int:
        """0: the control-variate moments of a few draws stay near the proposal's (EP halves a step
        whose covariance is not positive definite)."""
        return 0

    def match_moments(self, proposal: NatParams, zeta: jax.Array, weights: jax.Array) -> NatParams:
        """Weighted mean and covariance, with the proposal's exact moments as control variate."""
        loc, cov = self.moments(proposal)
        extra = weights - 1.0 / weights.shape[0]
        d = zeta - loc
        shift = extra @ d
        cov = cov + self.outer_sum(d * extra[:, None], d) - self.outer(shift, shift)
        return self.from_moments(loc + shift, self.sym(cov))

    # ------------------------------------------------------------------ start and prior
    def initial_q(self, loc: jax.Array, scale: float) -> NatParams:
        """The chosen start: mean ``loc`` (unconstrained) and sd ``scale`` in every coordinate,
        independent."""
        return self.from_loc_scale(loc, scale * self.identity(loc.shape[-1]))

    def reference_draws(self, dim: int) -> jax.Array:
        """``(NUM_PRIOR_DRAWS, dim)`` standard-normal points (a Gaussian block's prior is read off
        its sites)."""
        return jax.random.normal(jax.random.PRNGKey(0), (NUM_PRIOR_DRAWS, dim))

    def exact_prior(self, sites: Any, prior_values: Callable) -> tuple[NatParams, tuple]:
        """``lambda_0`` over the sites whose prior is Gaussian in unconstrained space and fits the
        family (:meth:`with_block`), and the names of the others (the prior factor ``t_0`` fits
        them). The sites' Gaussian priors were read from the model (``sites.gaussian_prior``):
        ``prior_values`` is not needed."""
        slices = sites.slices()
        blocks = tuple((slices[s.name].start, slices[s.name].stop) for s in sites.globals)
        values = tuple(sites.gaussian_prior.get(s.name) for s in sites.globals)
        # one compiled program (eager, each of its ~15 operations compiles one in a fresh process)
        prior, held = _embedded_prior(self, sites.dim, blocks, values)
        held = np.asarray(held)
        return prior, tuple(s.name for s, h in zip(sites.globals, held) if not h)

    def standard_normal(self, mask: Any) -> NatParams:
        """``N(0, 1)`` on the coordinates where ``mask`` ``(D,)`` is true, flat elsewhere (where
        ``t_0`` starts)."""
        mask = jnp.asarray(mask).astype(jnp.result_type(float))
        return self.from_mean_precision(jnp.zeros(mask.shape), self.from_dense(jnp.diag(mask)))

    def draws_at(self, nat: NatParams, eps: jax.Array) -> jax.Array:
        """Draws of valid ``nat`` at fixed standard-normal points ``eps`` ``(S, D)``: ``loc + L
        eps``."""
        return self.unwhiten(*self.loc_scale(nat), eps)

    def prior_site(
        self, q: NatParams, eps: jax.Array, log_density: Callable, mask: Any, use_hessian: bool
    ) -> NatParams:
        """``grad_mu E_q[log_density]`` at ``zeta = draws_at(q, eps)`` (:func:`expected_site`):
        ``t_0``'s target.

        ``mask`` (the coordinates ``log_density`` depends on) is not needed: the site is zero
        elsewhere.
        """
        hessian = jax.vmap(jax.hessian(log_density)) if use_hessian else None
        return expected_site(self, q, eps, jax.vmap(jax.grad(log_density)), hessian)

    # ------------------------------------------------------------------ DP-SGD and the wire
    def reparameterised(self, dim: int) -> GaussianParameters:
        """DP-SGD's parameters ``(loc, u)``, ``scale = biject_to(scale_constraint)(u)``, drawn as
        ``loc + scale @ eps`` (:class:`~numpyro_pvi.families.reparameterised.GaussianParameters`).
        """
        return GaussianParameters(self)

    def layout(self) -> None:
        """Nothing to lay out: a Gaussian holds any global sites of the model's flat ``zeta``."""
        return None

    def with_layout(self, layout: Any, shapes: dict) -> GaussianFamily:
        """This family itself (a Gaussian needs no layout)."""
        return self


def expected_site(
    family: Family, q: NatParams, eps: jax.Array, grad: Callable, hessian: Callable | None = None
) -> NatParams:
    """Natural parameters of ``grad_mu E_q[f(zeta)]``, the CVI / natural-gradient site of ``f``
    under ``q``.

    By Bonnet's and Price's theorems ``eta2 = E_q[H] / 2`` and ``eta1 = E_q[g] - E_q[H] mu``,
    estimated at ``zeta = mu + L eps`` (``eps`` ``(S, D)`` standard-normal points; antithetic pairs
    make it exact for a quadratic ``f``).

    :param grad: ``(S, D) -> (S, D)``, the gradient of ``f`` at each point.
    :param hessian: ``(S, D) -> (S, D, D)``, its Hessian; if ``None``, ``E_q[H]`` comes from the
        gradients by Stein's lemma.

    **Example:** the site of a Gaussian log density is that Gaussian, whatever ``q`` is.

    .. doctest::

        >>> import jax, jax.numpy as jnp
        >>> from numpyro_pvi import FullRankGaussian
        >>> from numpyro_pvi.families import expected_site
        >>> family = FullRankGaussian()
        >>> q = family.from_loc_scale(jnp.zeros(2), jnp.eye(2))
        >>> f = lambda z: -0.5 * jnp.sum((z - 1.0) ** 2 / jnp.array([1.0, 4.0]))
        >>> eps = jnp.concatenate([jnp.eye(2), -jnp.eye(2)])
        >>> site = expected_site(family, q, eps, jax.vmap(jax.grad(f)), jax.vmap(jax.hessian(f)))
        >>> site.eta1, jnp.diagonal(site.eta2)
        (Array([1.  , 0.25], dtype=float32), Array([-0.5  , -0.125], dtype=float32))
    """
    loc, scale = family.loc_scale(q)
    zeta = family.unwhiten(loc, scale, eps)
    grads = grad(zeta)
    if hessian is None:
        hess = family.stein_hessian(grads, eps, scale)
    else:
        hess = family.from_dense(jnp.mean(hessian(zeta), axis=0))
    return family.site_update(jnp.mean(grads, axis=0), hess, loc)


@partial(jax.jit, static_argnums=(0, 1, 2))
def _embedded_prior(
    family: GaussianFamily, dim: int, blocks: tuple, values: tuple
) -> tuple[NatParams, jax.Array]:
    """``lambda_0`` with each site's Gaussian prior ``values[i] = (loc, precision)`` (or ``None``)
    set in its coordinates ``blocks[i] = (start, stop)`` where the family holds it
    (the family's ``with_block``), and which sites it holds."""
    loc, precision = jnp.zeros(dim), family.precision(family.zeros(dim))
    held = []
    for (start, stop), block in zip(blocks, values):
        embedded = (
            None if block is None else family.with_block(precision, slice(start, stop), block[1])
        )
        held.append(embedded is not None)
        if embedded is not None:
            loc, precision = loc.at[start:stop].set(block[0]), embedded
    return family.from_mean_precision(loc, precision), np.array(held, bool)
