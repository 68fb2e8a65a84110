"""SNEP's contract with a family, :class:`ChainMoments`: a tilted distribution's mean parameters
estimated from MCMC chains, and the mirror map back to natural parameters.

:class:`~numpyro_pvi.SNEPUpdate` runs one loop for every family (persistent NUTS chains on the
tilted distribution in the family's chain coordinates, the step ``m <- (1 - eps) m + eps E_hat[T]``
in mean parameters, the refresh and the averaging). What differs by family is an object the family
returns from :meth:`~numpyro_pvi.families.MeanParamFamily.chain_moments`:

* :class:`MeanParamChains` (the exponential families and :class:`~numpyro_pvi.SiteFamilies`): the
  mean parameters ``E_q[T]`` of :class:`~numpyro_pvi.families.MeanParamFamily`, with Stein control
  variates regressed under ``q`` (:func:`stein_coefficients`) and ``from_mean_params`` (Newton) as
  the mirror map; a first visit starts after natural-gradient steps.
* :class:`~numpyro_pvi.families.gaussian_chains.GaussianChains` (one Gaussian family): the first and
  second moments in the coordinates whitened by the visit's ``q``, with the O(D^2) Stein control
  variate of ``q``'s covariance, a closed-form mirror map and the optional site clamp; a first visit
  starts at the Laplace approximation.

:func:`stein_features`, :func:`stein_coefficients` and :func:`matches` serve EP's NUTS estimate
(``NUTSMoments``) too.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from numpyro_pvi.families.params import NatParams

# draws of q (fixed key) from which control-variate coefficients are read
NUM_CV_DRAWS = 256
# largest relative residual of a member's mean parameters (from_mean_params did not converge above)
MEAN_TOL = 1e-4


class TiltedMeanParams(NamedTuple):
    """The chains' estimates of a tilted distribution's mean parameters (one inner step of SNEP).

    :ivar estimate: the Stein-corrected estimate.
    :ivar plain: the chains' plain average (what a step falls back on).
    :ivar in_domain: whether ``estimate`` is a usable estimate (a family whose mirror map cannot
        tell says ``True`` and lets :meth:`ChainMoments.from_mean_params` decide).
    """

    estimate: NatParams
    plain: NatParams
    in_domain: jax.Array


class ChainMoments(Protocol):
    """What SNEP's loop needs of a family beyond its chain coordinates
    (:meth:`~numpyro_pvi.families.MeanParamFamily.chain_frame`, ``from_chain``, ``to_chain``,
    ``log_factor``).

    Mean parameters are kept in the implementation's own representation, relative to the chains'
    ``frame`` (the ``q`` at the start of a visit), as a :class:`NatParams`-shaped pytree: convex
    combinations of them are mixtures of members, so the loop's step and average are
    ``NatParams`` arithmetic.

    :ivar laplace_start: whether a client's first visit starts at the family's Laplace
        approximation of the tilted distribution (and the variance inflation reported is the
        Laplace covariance's, deterministic) rather than after natural-gradient steps (and the
        inflation from importance draws of ``q``).

    **Example:** :meth:`~numpyro_pvi.families.MeanParamFamily.chain_moments`.
    """

    laplace_start: bool

    def coefficients(self, frame: Any, q: NatParams) -> Any:
        """The control variates' constants for a visit whose chains' frame is ``q``'s (a pytree of
        fixed shapes)."""
        ...

    def mean_params(self, frame: Any, nat: NatParams) -> NatParams:
        """The mean parameters of valid ``nat``."""
        ...

    def from_mean_params(
        self, frame: Any, mean: NatParams, start: NatParams
    ) -> tuple[NatParams, jax.Array]:
        """The member with mean parameters ``mean`` (``start``: a valid member near it) and whether
        it is valid and has them (the mirror map)."""
        ...

    def tilted_mean_params(
        self,
        frame: Any,
        coefficients: Any,
        u: jax.Array,
        score: jax.Array,
        mean: NatParams,
        previous: NatParams,
    ) -> TiltedMeanParams:
        """Estimates of the tilted distribution's mean parameters from the chains ``u`` ``(C, K)``
        and its score there ``(C, K)``; ``mean`` is ``q``'s, ``previous`` the last step's estimate
        (a centre the control variates may use)."""
        ...

    def project(self, cavity: NatParams, nat: NatParams) -> tuple[NatParams, jax.Array]:
        """``nat`` with its site ``nat - cavity`` clamped (``site_variance``), and whether it
        was."""
        ...


def stein_features(u: jax.Array, score: jax.Array) -> jax.Array:
    """Zero-mean functions ``(K + K^2,)`` of a draw ``u`` of any ``p`` with score ``grad log p(u)``:
    ``score`` and ``I + u score^T`` (Stein's identity ``E_p[div f + f . score] = 0`` for ``f = e_k``
    and ``f = u_j e_k``)."""
    return jnp.concatenate([score, (jnp.eye(u.shape[-1]) + jnp.outer(u, score)).reshape(-1)])


def stein_coefficients(family: Any, frame: Any, q: NatParams) -> jax.Array:
    """The regression coefficients ``(P, K + K^2)`` of ``T`` on :func:`stein_features` under ``q``
    (``family``: a :class:`~numpyro_pvi.families.MeanParamFamily`).

    ``T - C features`` has the mean of ``T`` under any ``p`` (the features have mean zero under
    every ``p``), and with ``q``'s regression coefficients the least variance when ``p`` is ``q``:
    exact where ``T`` is in their span (a Gaussian block's ``zeta`` and ``zeta zeta^T``, a Gamma's
    ``theta``). Read off ``NUM_CV_DRAWS`` draws of ``q`` (a fixed key).
    """
    theta = family.to_dist(q).sample(jax.random.PRNGKey(1), (NUM_CV_DRAWS,))
    u = jax.vmap(lambda t: family.to_chain(frame, t))(theta)

    def log_q(v: jax.Array) -> jax.Array:
        value, log_det = family.from_chain(frame, v)
        return family.log_factor(q, value) + log_det

    features = jax.vmap(stein_features)(u, jax.vmap(jax.grad(log_q))(u))
    stats = jax.vmap(lambda t: ravel_pytree(family.chain_mean_params(t[None]))[0])(theta)
    features, stats = features - jnp.mean(features, axis=0), stats - jnp.mean(stats, axis=0)
    gram = features.T @ features + 1e-6 * jnp.trace(features.T @ features) * jnp.eye(
        features.shape[1]
    )
    return jnp.linalg.solve(gram, features.T @ stats).T


def matches(family: Any, nat: NatParams, target: NatParams) -> jax.Array:
    """Whether ``nat`` is valid and its mean parameters are ``target`` (to ``MEAN_TOL`` relative): a
    target outside the family's mean domain (a control-variate estimate may be) has no inverse."""
    flat = ravel_pytree(target)[0]
    residual = ravel_pytree(family.mean_params(nat))[0] - flat
    return family.is_valid(nat) & jnp.all(jnp.abs(residual) <= MEAN_TOL * (1.0 + jnp.abs(flat)))


def refuse_site_clamp(family: Any, site_variance: tuple | None) -> None:
    """``ValueError`` if ``site_variance`` (a Gaussian site's clamp) is set for ``family``."""
    if site_variance is not None:
        raise ValueError(
            "SNEPUpdate: site_variance (a clamp of a Gaussian site's covariance) has no meaning "
            f"for {family!r}; leave it None (the mean-parameter steps keep q valid)."
        )


class MeanParamChains:
    """:class:`ChainMoments` in the mean parameters ``E_q[T]`` of a
    :class:`~numpyro_pvi.families.MeanParamFamily` (the exponential families,
    :class:`~numpyro_pvi.SiteFamilies`).

    The estimate is the chains' average of ``T - C phi(u)``, with Stein's zero-mean features ``phi``
    (:func:`stein_features`) of the tilted distribution's score and ``C`` the regression
    coefficients of ``T`` on ``phi`` under the visit's ``q`` (:func:`stein_coefficients`; zeros
    without control variates): unbiased for any ``C``, exact where ``T`` is in the features' span
    under ``q`` (a Gaussian block, a Gamma). The mirror map is the family's ``from_mean_params``,
    checked by :func:`matches` (an estimate outside the mean domain has no member).

    **Example:** at a Gamma's own draws the corrected estimate is its mean parameters.

    .. doctest::

        >>> import jax, jax.numpy as jnp, numpyro_pvi as pvi
        >>> family = pvi.Gamma()
        >>> q = family.from_params(jnp.array([12.0]), jnp.array([5.0]))
        >>> chains = family.chain_moments(control_variates=True, site_variance=None)
        >>> frame = family.chain_frame(q)
        >>> u = jax.random.normal(jax.random.PRNGKey(0), (4, 1))
        >>> log_q = lambda v: (
        ...     family.log_factor(q, family.from_chain(frame, v)[0])
        ...     + (family.from_chain(frame, v)[1])
        ... )
        >>> score = jax.vmap(jax.grad(log_q))(u)
        >>> mean = chains.mean_params(frame, q)
        >>> estimated = chains.tilted_mean_params(
        ...     frame, chains.coefficients(frame, q), u, score, mean, mean
        ... )
        >>> bool(jnp.allclose(estimated.estimate.eta2, mean.eta2, rtol=1e-3))  # E[theta] = 12 / 5
        True
    """

    laplace_start = False

    def __init__(self, family: Any, control_variates: bool) -> None:
        self.family, self.control_variates = family, control_variates

    def coefficients(self, frame: Any, q: NatParams) -> jax.Array:
        """:func:`stein_coefficients` of ``q`` (zeros without control variates: the plain
        average)."""
        coef = stein_coefficients(self.family, frame, q)
        return coef if self.control_variates else jnp.zeros_like(coef)

    def mean_params(self, frame: Any, nat: NatParams) -> NatParams:
        """``E_q[T]`` (the frame is not needed)."""
        return self.family.mean_params(nat)

    def from_mean_params(
        self, frame: Any, mean: NatParams, start: NatParams
    ) -> tuple[NatParams, jax.Array]:
        """The family's ``from_mean_params`` from ``start``, and :func:`matches`."""
        nat = self.family.from_mean_params(mean, start)
        return nat, matches(self.family, nat, mean)

    def tilted_mean_params(
        self,
        frame: Any,
        coefficients: jax.Array,
        u: jax.Array,
        score: jax.Array,
        mean: NatParams,
        previous: NatParams,
    ) -> TiltedMeanParams:
        """The chains' average of ``T - C phi``; its domain is left to the mirror map."""
        family = self.family
        plain = family.chain_mean_params(jax.vmap(lambda v: family.from_chain(frame, v)[0])(u))
        flat, unravel = ravel_pytree(plain)
        features = jnp.mean(jax.vmap(stein_features)(u, score), axis=0)
        return TiltedMeanParams(unravel(flat - coefficients @ features), plain, jnp.ones((), bool))

    def project(self, cavity: NatParams, nat: NatParams) -> tuple[NatParams, jax.Array]:
        """No clamp: the mean-parameter steps keep ``q`` valid."""
        return nat, jnp.zeros((), bool)
