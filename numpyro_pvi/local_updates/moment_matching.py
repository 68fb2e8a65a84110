"""``MomentMatchingUpdate``: EP and power EP as the PVI client step (Minka 2004; Bui et al. 2018,
§3.2), one ``client_update`` for every family.

Client ``m`` forms the tilted distribution ``p_m(theta) ∝ q_alpha(theta) p(y_m | theta)^alpha``
with the power-EP cavity ``q_alpha = q / t_m^alpha``, estimates its expected sufficient statistics
(a Gaussian's mean and covariance, in the family's form: the diagonal for ``MeanFieldGaussian``),
matches the family's member ``q_tilde`` to them
(:meth:`~numpyro_pvi.families.FactorFamily.match_moments`) and moves its factor by ``delta =
(eta(q_tilde) - eta(q)) / alpha``; with ``alpha = 1`` this is EP (``q_new = q_tilde``).

Both estimators start from the family's Laplace approximation of the tilted distribution (damped
Newton in the family's Laplace coordinates from ``q``'s mode, the curvature made positive definite
where the tilted density is not log-concave:
:func:`~numpyro_pvi.local_updates._numerics.laplace_fit`;
``proposal="cavity"`` uses ``q_alpha`` instead):

* :class:`Importance` (default): self-normalised importance sampling, with the proposal's exact
  moments as control variate, from the family's Laplace proposal
  (:meth:`~numpyro_pvi.families.FactorFamily.laplace_proposal`: a Gaussian's is the dense
  ``N(mode, P^-1)``), from ``q_alpha`` times ``alpha`` times the client's natural-gradient site, and
  from ``q_alpha``; the statistics come from the Laplace proposal, or from another with a larger
  effective sample size where the Laplace proposal's is below ``min_ess`` or the other's weights are
  uniform (it is the tilted distribution: an exponential family's conjugate likelihood). Exact
  (every weight equal) when the tilted distribution is a proposal: a conjugate likelihood. Weights
  whose effective sample size is below ``min_ess`` halve the step; below the family's
  :meth:`~numpyro_pvi.families.FactorFamily.min_effective_draws` they give no step (an exponential
  family's member matched to a few draws is concentrated on them: sweep cell 3 of issue 23, a Gamma
  block's shape went from 179 to ``9e9`` in one such step, from 2 effective draws of 1,024).
* :class:`NUTSMoments`: NUTS chains of the tilted distribution in the family's chain coordinates
  (:meth:`~numpyro_pvi.families.MeanParamFamily.from_chain`, standardised by the Laplace
  approximation; the log Jacobian in the potential), the draws' average of the sufficient
  statistics less Stein control variates whose coefficients are read off that approximation
  (:func:`~numpyro_pvi.families.chain_moments.stein_coefficients`; the plain average where that
  estimate has no member). With ``Synchronous`` this is distributed EP as in ep-stan (Vehtari et
  al. 2020).

A step that would make ``q`` improper is halved (counted in ``RoundInfo.clamped``); if no halving
helps, the step moves towards the Laplace approximation instead (halved the same way), and if that
fails too it is not taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.families import FactorFamily, NatParams
from numpyro_pvi.families.chain_moments import matches, stein_coefficients, stein_features
from numpyro_pvi.families.factor import member_proposal
from numpyro_pvi.families.gaussian import variance_inflation, weighted_covariance
from numpyro_pvi.families.params import Proposal
from numpyro_pvi.local_updates._numerics import laplace_fit, nuts_draws, where_tree
from numpyro_pvi.local_updates.base import (
    Client,
    ClientProblem,
    ClientResult,
    LocalUpdate,
    local_free_energy,
)

#: An effective sample size (a fraction of the draws) above this is uniform weights up to float32
#: rounding: that proposal is the tilted distribution.
UNIFORM_ESS = 0.999


class Tilted(NamedTuple):
    """A client's tilted distribution ``q_alpha(theta) p(y_m | theta)^alpha``: what an estimator
    reads.

    :param family: the problem's family.
    :param q: the current ``q``.
    :param cavity_alpha: the power-EP cavity ``q_alpha = q / t_m^alpha``.
    :param loglik: ``theta -> log p(y_m | theta)``.
    :param alpha: the power.
    :param laplace: ``(mode, precision)`` of the family's Laplace approximation of the tilted
        distribution, in its Laplace coordinates; ``None`` with ``proposal="cavity"``.
    :param start: the member the estimators start from: the Laplace approximation's (``q`` where it
        is not valid), or ``q_alpha``.
    """

    family: Any
    q: NatParams
    cavity_alpha: NatParams
    loglik: Callable
    alpha: float
    laplace: tuple | None
    start: NatParams

    def log_density(self, theta: jax.Array) -> jax.Array:
        """``log q_alpha(theta) + alpha log p(y_m | theta)`` of draws ``(S, D)``, up to a
        constant."""
        cavity = self.family.to_dist(self.cavity_alpha).log_prob(theta)
        return cavity + self.alpha * jax.vmap(self.loglik)(theta)


class TiltedEstimate(NamedTuple):
    """An estimator's answer: the member matched to the tilted distribution (``q``: no step),
    whether to halve the step (counted as clamped) and the tilted distribution's variance inflation
    beyond the family's form (``ClientResult.inflation``)."""

    target: NatParams
    low_ess: jax.Array
    inflation: jax.Array


@runtime_checkable
class TiltedEstimator(Protocol):
    """How :class:`MomentMatchingUpdate` estimates the tilted distribution's moments:
    :class:`Importance` or :class:`NUTSMoments`."""

    def check(self, family: Any) -> None:
        """Raise ``ValueError`` if the estimator cannot serve ``family``."""
        ...

    def estimate(self, tilted: Tilted, rng_key: jax.Array) -> TiltedEstimate:
        """The member matched to ``tilted``'s estimated moments."""
        ...


def _positive_int(owner: str, name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{owner}: {name} must be an integer >= {low}, got {value!r}.")


def _valid(family: Any, member: NatParams) -> jax.Array:
    """Whether ``member`` is a valid member with finite parameters."""
    finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(member)]))
    return family.is_valid(member) & finite


@dataclass(frozen=True, kw_only=True)
class Importance:
    """Self-normalised importance sampling of the tilted distribution (``MomentMatchingUpdate``'s
    default).

    :param int num_particles: importance draws per proposal (made even: antithetic pairs).
    :param float min_ess: the step is halved (and counted as clamped) when the weights' effective
        sample size is below this fraction of ``num_particles``.

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> ep = pvi.MomentMatchingUpdate(tilted=pvi.Importance(num_particles=512, min_ess=0.2))
    """

    num_particles: int = 1024
    min_ess: float = 0.1

    def __post_init__(self) -> None:
        _positive_int("Importance", "num_particles", self.num_particles, 2)
        if not 0.0 <= self.min_ess < 1.0:
            raise ValueError(f"Importance: min_ess must be in [0, 1), got {self.min_ess!r}.")

    def check(self, family: Any) -> None:
        """Every :class:`~numpyro_pvi.families.FactorFamily` has what importance sampling needs."""

    def estimate(self, tilted: Tilted, rng_key: jax.Array) -> TiltedEstimate:
        """The member matched to the importance-weighted statistics of the first proposal (the
        Laplace approximation), or of another whose weights have a larger effective sample size
        where the first's is below ``min_ess`` or the other's weights are uniform; the variance
        inflation from the first proposal's draws (the nearest to the tilted distribution, with the
        fewest chance correlations)."""
        family, pairs = tilted.family, self.num_particles // 2
        laplace_key, site_key, cavity_key = jax.random.split(rng_key, 3)
        proposals = [member_proposal(family, tilted.cavity_alpha, cavity_key, pairs)]
        if tilted.laplace is not None:
            laplace = family.laplace_proposal(*tilted.laplace, laplace_key, pairs)
            laplace = where_tree(
                _valid(family, laplace.member),
                laplace,
                member_proposal(family, tilted.q, laplace_key, pairs),
            )
            site = member_proposal(family, _site_proposal(tilted, site_key, pairs), site_key, pairs)
            proposals = [laplace, site, *proposals]
        outs = [_weighted_target(tilted, proposal) for proposal in proposals]
        target, ess, inflation = outs[0]
        for other, other_ess, _ in outs[1:]:
            # the first proposal unless its weights are poor or another's are uniform (that one is
            # the tilted distribution: a conjugate likelihood); picking the largest noisy ESS
            # otherwise favours proposals whose weights miss the tails (on the skewed logistic
            # model of tests/local_updates/test_moment_matching.py EP's covariance error went from
            # 3.5-3.8 % to
            # 5.3-6.0 %, seeds 0-1)
            better = (other_ess > ess) & ((ess < self.min_ess) | (other_ess > UNIFORM_ESS))
            target, ess = where_tree(better, other, target), jnp.where(better, other_ess, ess)
        # no step: the member matched to a few draws is concentrated on them
        degenerate = ess * 2 * pairs < family.min_effective_draws()
        return TiltedEstimate(
            where_tree(degenerate, tilted.q, target),
            ess < self.min_ess,
            jnp.where(degenerate, 1.0, inflation),  # not measured by a few draws
        )


def _site_proposal(tilted: Tilted, rng_key: jax.Array, pairs: int) -> NatParams:
    """``q_alpha`` times ``alpha`` times the client's natural-gradient site at draws of ``q`` (``q``
    if invalid): a local approximation of the tilted distribution in the family."""
    family, q = tilted.family, tilted.q
    zeta = family.draw(q, rng_key, pairs)
    values, grads = jax.vmap(jax.value_and_grad(tilted.loglik))(zeta)
    site = tilted.cavity_alpha + tilted.alpha * family.site_from_draws(q, zeta, values, grads, None)
    return where_tree(family.is_valid(site), site, q)


def _weighted_target(tilted: Tilted, proposal: Proposal) -> tuple:
    """The member matched to ``proposal``'s importance-weighted draws, the weights' effective sample
    size (a fraction of the draws; 0 when no weight is finite) and the weighted draws' variance
    inflation beyond the family's form (:func:`variance_inflation`)."""
    family, zeta = tilted.family, proposal.draws
    log_w = tilted.log_density(zeta) - proposal.log_density
    weights = jax.nn.softmax(jnp.where(jnp.isfinite(log_w), log_w, -jnp.inf))
    ess = 1.0 / jnp.sum(weights**2) / zeta.shape[0]
    inflation = variance_inflation(
        family, weighted_covariance(zeta, weights), 0.5 / jnp.sum(weights**2)
    )
    target = family.match_moments(proposal.member, zeta, weights)
    return target, jnp.where(jnp.isfinite(ess), ess, 0.0), inflation


@dataclass(frozen=True, kw_only=True)
class NUTSMoments:
    """NUTS chains of the tilted distribution (NumPyro's kernel, a unit mass matrix in the family's
    chain coordinates standardised by the Laplace approximation).

    :param int num_samples: NUTS draws per chain.
    :param int num_warmup: warm-up (step-size adaptation) steps per chain.
    :param int num_chains: chains per client.
    :param int max_tree_depth: NUTS maximum tree depth.

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> power_ep = pvi.MomentMatchingUpdate(
        ...     alpha=0.5, tilted=pvi.NUTSMoments(num_samples=500, num_warmup=300)
        ... )
    """

    num_samples: int = 500
    num_warmup: int = 300
    num_chains: int = 2
    max_tree_depth: int = 6

    def __post_init__(self) -> None:
        for name, value, low in [
            ("num_samples", self.num_samples, 2),
            ("num_warmup", self.num_warmup, 0),
            ("num_chains", self.num_chains, 1),
            ("max_tree_depth", self.max_tree_depth, 1),
        ]:
            _positive_int("NUTSMoments", name, value, low)

    def check(self, family: Any) -> None:
        """The chains need the family's chain coordinates and mean parameters."""
        if family.mean_param_family() is None:
            raise ValueError(
                "MomentMatchingUpdate: NUTSMoments needs a family with mean parameters and chain "
                f"coordinates (pvi.families.MeanParamFamily); {family!r} has none: use "
                "pvi.Importance()."
            )

    def estimate(self, tilted: Tilted, rng_key: jax.Array) -> TiltedEstimate:
        """The member whose mean parameters are the chains' Stein-corrected average of ``T`` (the
        plain average where that has no member; ``q`` and a halved step where neither has)."""
        family, start = tilted.family, tilted.start
        frame = family.chain_frame(start)

        def log_tilted(u: jax.Array) -> jax.Array:
            theta, log_det = family.from_chain(frame, u)
            loglik = tilted.alpha * tilted.loglik(theta)
            return family.log_factor(tilted.cavity_alpha, theta) + loglik + log_det

        dim = family.chain_dim(start.eta1.shape[-1])
        u = nuts_draws(
            lambda v: -log_tilted(v),
            dim,
            rng_key,
            self.num_chains,
            self.num_warmup,
            self.num_samples,
            self.max_tree_depth,
        )
        theta = jax.vmap(lambda v: family.from_chain(frame, v)[0])(u)
        plain = family.chain_mean_params(theta)
        flat, unravel = ravel_pytree(plain)
        features = jax.vmap(stein_features)(u, jax.vmap(jax.grad(log_tilted))(u))
        estimate = unravel(flat - stein_coefficients(family, frame, start) @ features.mean(axis=0))
        target = family.from_mean_params(estimate, start)
        plain_target = family.from_mean_params(plain, start)
        ok = matches(family, target, estimate)
        missed = ~(ok | matches(family, plain_target, plain))
        return TiltedEstimate(
            where_tree(missed, tilted.q, where_tree(ok, target, plain_target)),
            missed,
            variance_inflation(family, weighted_covariance(theta), theta.shape[0]),
        )


class MomentMatchingUpdate(LocalUpdate):
    """EP / power-EP local steps: match ``q`` to the client's tilted distribution (Minka 2004; Bui
    et al. 2018).

    The tilted distribution is ``q_alpha(theta) p(y_m | theta)^alpha`` with ``q_alpha = q /
    t_m^alpha``; its expected sufficient statistics are estimated (``tilted``), the family's member
    ``q_tilde`` matched to them, and the factor moves by ``(eta(q_tilde) - eta(q)) / alpha``.
    ``alpha = 1`` is EP; ``alpha < 1`` (power EP) smooths the likelihood and keeps the tilted
    distribution closer to ``q``. One algorithm for every family: the proposal, the draws and the
    moment matching are the family's (:class:`~numpyro_pvi.families.FactorFamily`).

    :param float alpha: the power, in ``(0, 1]``.
    :param tilted: how the tilted moments are estimated: :class:`Importance` (default; cheap, exact
        for a conjugate likelihood) or :class:`NUTSMoments`.
    :param str proposal: ``"laplace"`` (default: start from the family's Laplace approximation of
        the tilted distribution) or ``"cavity"`` (from ``q_alpha`` itself, only adequate when one
        client's likelihood moves ``q`` little).
    :param int num_newton: at most this many Newton steps for the Laplace approximation (fewer once
        it has converged).
    :param int max_backtracks: halvings of the step tried when it would make ``q`` improper (then,
        with the Laplace proposal, as many of a step towards the Laplace approximation).

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> ep = pvi.MomentMatchingUpdate(tilted=pvi.Importance(num_particles=512))
        >>> power_ep = pvi.MomentMatchingUpdate(alpha=0.5, tilted=pvi.NUTSMoments(num_warmup=300))
    """

    supports_factor_families = True

    def __init__(
        self,
        alpha: float = 1.0,
        *,
        tilted: TiltedEstimator = Importance(),
        proposal: str = "laplace",
        num_newton: int = 20,
        max_backtracks: int = 5,
    ) -> None:
        if not (isinstance(alpha, (int, float)) and 0.0 < alpha <= 1.0):
            raise ValueError(f"MomentMatchingUpdate: alpha must be in (0, 1], got {alpha!r}.")
        if not isinstance(tilted, TiltedEstimator):
            raise TypeError(
                "MomentMatchingUpdate: tilted must be an estimator such as pvi.Importance() or "
                f"pvi.NUTSMoments(), got {tilted!r}."
            )
        if proposal not in ("laplace", "cavity"):
            raise ValueError(
                f"MomentMatchingUpdate: proposal must be 'laplace' or 'cavity', got {proposal!r}."
            )
        _positive_int("MomentMatchingUpdate", "num_newton", num_newton, 0)
        _positive_int("MomentMatchingUpdate", "max_backtracks", max_backtracks, 0)
        self.alpha, self.tilted, self.proposal = float(alpha), tilted, proposal
        self.num_newton, self.max_backtracks = num_newton, max_backtracks

    def init_state(self, problem: ClientProblem) -> Any:
        """The client's persistent state (none for this update)."""
        return ()

    def bind(self, problem: ClientProblem) -> Callable:
        """Return the pure ``client_update(rng_key, client, cavity, q, state, hyper=()) ->
        ClientResult``."""
        family, alpha, max_backtracks = problem.family, self.alpha, self.max_backtracks
        self.tilted.check(family)

        def client_update(
            rng_key: jax.Array,
            client: Client,
            cavity: NatParams,
            q: NatParams,
            state: Any,
            hyper: Any = (),
        ) -> ClientResult:
            loglik = lambda z: problem.log_likelihood(z, client, hyper)  # noqa: E731
            # q / t_m^alpha: valid, a convex combination
            cavity_alpha = alpha * cavity + (1.0 - alpha) * q
            estimate_key, fe_key = jax.random.split(rng_key)
            tilted = self._tilted(family, q, cavity_alpha, loglik)
            estimate = self.tilted.estimate(tilted, estimate_key)
            delta, halvings, ok = _safe_step(
                family, q, estimate.target, alpha, estimate.low_ess, max_backtracks
            )
            clamped = estimate.low_ess + halvings
            # no halving gave a valid q: step towards the Laplace approximation instead
            if tilted.laplace is not None:
                fallback, extra, _ = _safe_step(
                    family, q, tilted.start, alpha, False, max_backtracks
                )
                delta = where_tree(ok, delta, fallback)
                clamped = clamped + jnp.where(ok, 0, extra)
            q_new = q + delta
            free_energy = local_free_energy(
                family, q_new, cavity, loglik, family.draw(q_new, fe_key, 32)
            )
            return ClientResult(delta, free_energy, state, clamped, inflation=estimate.inflation)

        return client_update

    def _tilted(
        self, family: FactorFamily, q: NatParams, cavity_alpha: NatParams, loglik: Callable
    ) -> Tilted:
        """The client's :class:`Tilted`, with the family's Laplace approximation unless
        ``proposal="cavity"``."""
        if self.proposal == "cavity":
            return Tilted(family, q, cavity_alpha, loglik, self.alpha, None, cavity_alpha)
        laplace = laplace_fit(
            family, cavity_alpha, q, lambda z: self.alpha * loglik(z), self.num_newton
        )
        member = family.from_laplace(*laplace)
        start = where_tree(_valid(family, member), member, q)
        return Tilted(family, q, cavity_alpha, loglik, self.alpha, laplace, start)


def _safe_step(
    family: FactorFamily,
    q: NatParams,
    target: NatParams,
    alpha: float,
    low_ess: jax.Array | bool,
    max_backtracks: int,
) -> tuple[NatParams, jax.Array, jax.Array]:
    """The step ``(target - q) / alpha``, halved until ``q`` stays valid, the number of halvings and
    whether it was.

    A low effective sample size starts at half the step (that halving is counted apart). At most
    ``max_backtracks`` halvings in all; if none gives a valid ``q`` the step is not taken (and
    counts ``max_backtracks + 1`` halvings, less the one for a low effective sample size).
    """
    delta = (target - q) * (1.0 / alpha)
    start = jnp.where(low_ess, 1, 0)

    def propose(step: jax.Array) -> tuple[NatParams, jax.Array]:
        return step * delta, family.is_valid(q + step * delta)

    out = backtrack(propose, 1.0, max_halvings=max_backtracks - start, start=start)
    # max_backtracks=0 allows no halving, not even for a low ESS
    ok = out.valid & (start <= max_backtracks)
    return jax.tree.map(lambda d: jnp.where(ok, d, 0.0), out.value), out.halvings, ok
