"""``MomentMatchingUpdate``: EP and power EP as the PVI client step (Minka 2004; Bui et al. 2018,
§3.2).

Client ``m`` forms the tilted distribution ``p_m(zeta) ∝ q_alpha(zeta) p(y_m | zeta)^alpha`` with
the power-EP cavity ``q_alpha = q / t_m^alpha``, estimates its mean and covariance (its diagonal for
``MeanFieldGaussian``: the family's own form), matches a Gaussian ``q_tilde`` to them and moves its
factor by ``delta = (eta(q_tilde) - eta(q)) / alpha``; with ``alpha = 1`` this is EP (``q_new =
q_tilde``).

The tilted moments come from importance sampling (default) or NUTS. Both start from a Laplace
approximation of the tilted distribution (damped Newton steps from ``q``'s mean, with the curvature
made positive definite where the tilted density is not log-concave, until the Newton decrement is
small): it is the importance proposal, and NUTS runs in its whitened coordinates. Importance
sampling uses the proposal's exact moments as a control variate, so it is exact when the tilted
distribution is Gaussian (a conjugate likelihood) and cheap when it is nearly so. A step that would
make ``q`` improper is halved (counted in ``RoundInfo.clamped``), as is a step from weights with a
low effective sample size; if no halving helps, the step moves towards the Laplace approximation
instead (halved the same way), and if that fails too it is not taken. For the families beyond one
Gaussian (``SiteFamilies``, ``Gamma``, ``Beta``, ``Dirichlet``) the client matches its tilted
distribution's expected sufficient statistics instead
(:mod:`numpyro_pvi.local_updates.site_moment_matching`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.families import Family, MeanParamFamily, NatParams
from numpyro_pvi.families.gaussian import variance_inflation
from numpyro_pvi.local_updates.base import (
    Client,
    ClientProblem,
    ClientResult,
    LocalUpdate,
    local_free_energy,
)
from numpyro_pvi.local_updates.laplace import laplace
from numpyro_pvi.local_updates.nuts import NUTSSettings, nuts_draws
from numpyro_pvi.local_updates.site_moment_matching import bind_site_families


def importance_moments(
    log_density: Callable, loc: jax.Array, chol_cov: jax.Array, eps: jax.Array
) -> tuple:
    """Self-normalised importance estimates of the mean and covariance, proposal ``N(loc, L L^T)``.

    The proposal's exact moments are the control variate: ``E_p[f] ~ E_g[f] + sum_i (w_i - 1/S)
    f(z_i)``, exact (up to rounding) when ``p`` is the proposal. ``eps`` ``(S, D)`` are
    standard-normal points.

    :return: ``(mean, cov, ess)``, the effective sample size ``1 / sum_i w_i^2`` of the normalised
        weights.
    """
    num = eps.shape[0]
    zeta = loc + eps @ chol_cov.T
    # up to a constant, which the normalisation removes
    log_proposal = -0.5 * jnp.sum(eps**2, axis=-1)
    log_w = jax.vmap(log_density)(zeta) - log_proposal
    log_w = jnp.where(jnp.isnan(log_w), -jnp.inf, log_w)
    w = jax.nn.softmax(log_w)
    excess = w - 1.0 / num
    centred = zeta - loc
    shift = excess @ centred
    second = chol_cov @ chol_cov.T + (centred * excess[:, None]).T @ centred
    cov = second - jnp.outer(shift, shift)
    return loc + shift, 0.5 * (cov + cov.T), 1.0 / jnp.sum(w**2)


def nuts_moments(
    log_density: Callable,
    loc: jax.Array,
    chol_cov: jax.Array,
    rng_key: jax.Array,
    num_chains: int,
    num_warmup: int,
    num_samples: int,
    max_tree_depth: int,
) -> tuple[jax.Array, jax.Array]:
    """Mean and covariance from NUTS chains in the coordinates ``zeta = loc + L u`` (a unit mass
    matrix fits).

    The chains are :func:`~numpyro_pvi.local_updates.nuts.nuts_draws`.
    """
    potential = lambda u: -log_density(loc + chol_cov @ u)  # noqa: E731
    u = nuts_draws(
        potential, loc.shape[0], rng_key, num_chains, num_warmup, num_samples, max_tree_depth
    )
    zeta = loc + u @ chol_cov.T
    mean = jnp.mean(zeta, axis=0)
    centred = zeta - mean
    return mean, centred.T @ centred / (zeta.shape[0] - 1)


class MomentMatchingUpdate(LocalUpdate):
    """EP / power-EP local steps: match ``q`` to the client's tilted distribution (Minka 2004; Bui
    et al. 2018).

    The tilted distribution is ``q_alpha(zeta) p(y_m | zeta)^alpha`` with ``q_alpha = q /
    t_m^alpha``; its moments are estimated, a Gaussian ``q_tilde`` matched to them, and the factor
    moves by ``(eta(q_tilde) - eta(q)) / alpha``. ``alpha = 1`` is EP; ``alpha < 1`` (power EP)
    smooths the likelihood and keeps the tilted distribution closer to ``q``. With ``Synchronous``
    and ``tilted="nuts"`` this is distributed EP as in ep-stan (Vehtari et al. 2020). With
    ``SiteFamilies``, ``Gamma``, ``Beta`` or ``Dirichlet`` the family's expected sufficient
    statistics are matched, by importance sampling from the cavity times the client's
    natural-gradient site (exact for a conjugate likelihood; that is ``proposal="laplace"`` there,
    ``proposal="cavity"`` samples the cavity), or with ``tilted="nuts"`` by NUTS in the family's
    unconstrained chain coordinates, standardised by that proposal.

    :param float alpha: the power, in ``(0, 1]``.
    :param str tilted: ``"importance"`` (self-normalised importance sampling from a Laplace
        approximation of the tilted distribution, with its moments as control variates; cheap, exact
        for Gaussian likelihoods) or ``"nuts"`` (NumPyro's NUTS in the Laplace approximation's
        whitened coordinates).
    :param int num_samples: importance draws (made even: antithetic pairs), or NUTS draws per chain.
    :param str proposal: ``"laplace"`` (default) or ``"cavity"`` (importance sampling from
        ``q_alpha`` itself, which is only adequate when one client's likelihood moves ``q`` little).
    :param float min_ess: the step is halved (and counted as clamped) when the importance weights'
        effective sample size is below this fraction of ``num_samples``.
    :param int num_newton: at most this many Newton steps for the Laplace approximation (fewer once
        it has converged).
    :param int num_chains: NUTS chains per client.
    :param int num_warmup: NUTS warm-up steps per chain.
    :param int max_tree_depth: NUTS maximum tree depth.
    :param int max_backtracks: halvings of the step tried when it would make ``q`` improper (then,
        with the Laplace proposal, as many of a step towards the Laplace approximation).

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> ep = pvi.MomentMatchingUpdate(alpha=1.0, tilted="importance", num_samples=512)
        >>> power_ep = pvi.MomentMatchingUpdate(
        ...     alpha=0.5, tilted="nuts", num_samples=500, num_warmup=300
        ... )
    """

    supports_factor_families = True

    def __init__(
        self,
        alpha: float = 1.0,
        tilted: str = "importance",
        num_samples: int | None = None,
        proposal: str = "laplace",
        min_ess: float = 0.1,
        num_newton: int = 20,
        num_chains: int = 2,
        num_warmup: int = 300,
        max_tree_depth: int = 6,
        max_backtracks: int = 5,
    ) -> None:
        if not (isinstance(alpha, (int, float)) and 0.0 < alpha <= 1.0):
            raise ValueError(f"MomentMatchingUpdate: alpha must be in (0, 1], got {alpha!r}.")
        if tilted not in ("importance", "nuts"):
            raise ValueError(
                f"MomentMatchingUpdate: tilted must be 'importance' or 'nuts', got {tilted!r}."
            )
        if proposal not in ("laplace", "cavity"):
            raise ValueError(
                f"MomentMatchingUpdate: proposal must be 'laplace' or 'cavity', got {proposal!r}."
            )
        num_samples = (
            (1024 if tilted == "importance" else 500) if num_samples is None else num_samples
        )
        if not isinstance(num_samples, int) or num_samples < 2:
            raise ValueError(
                f"MomentMatchingUpdate: num_samples must be an integer >= 2, got {num_samples!r}."
            )
        if not 0.0 <= min_ess < 1.0:
            raise ValueError(f"MomentMatchingUpdate: min_ess must be in [0, 1), got {min_ess!r}.")
        for name, value, low in [
            ("num_newton", num_newton, 0),
            ("num_chains", num_chains, 1),
            ("num_warmup", num_warmup, 0),
            ("max_tree_depth", max_tree_depth, 1),
            ("max_backtracks", max_backtracks, 0),
        ]:
            if not isinstance(value, int) or value < low:
                raise ValueError(
                    f"MomentMatchingUpdate: {name} must be an integer >= {low}, got {value!r}."
                )
        self.alpha, self.tilted, self.num_samples, self.proposal = (
            float(alpha),
            tilted,
            num_samples,
            proposal,
        )
        self.min_ess, self.num_newton, self.num_chains, self.num_warmup = (
            min_ess,
            num_newton,
            num_chains,
            num_warmup,
        )
        self.max_tree_depth, self.max_backtracks = max_tree_depth, max_backtracks

    def init_state(self, problem: ClientProblem) -> Any:
        """The client's persistent state (none for this update)."""
        return ()

    def bind(self, problem: ClientProblem) -> Callable:
        """Return the pure ``client_update(rng_key, client, cavity, q, state, hyper=()) ->
        ClientResult``."""
        family, alpha, max_backtracks = problem.family, self.alpha, self.max_backtracks
        # SiteFamilies, Gamma, Beta, Dirichlet: match sufficient statistics
        if not isinstance(family, Family):
            if self.tilted == "nuts" and not isinstance(family, MeanParamFamily):
                raise ValueError(
                    "MomentMatchingUpdate: tilted='nuts' needs a family with mean parameters and "
                    f"chain coordinates (pvi.families.MeanParamFamily); {family!r} has none: use "
                    "tilted='importance'."
                )
            nuts = (
                NUTSSettings(
                    self.num_chains, self.num_warmup, self.num_samples, self.max_tree_depth
                )
                if self.tilted == "nuts"
                else None
            )
            return bind_site_families(
                problem,
                alpha,
                self.num_samples,
                self.min_ess,
                _safe_step,
                max_backtracks,
                self.proposal,
                nuts,
            )

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
            log_tilted = lambda z: family.quadratic(cavity_alpha, z) + alpha * loglik(z)  # noqa: E731
            sample_key, fe_key = jax.random.split(rng_key)
            loc, chol_cov, laplace_q = self._proposal(family, q, cavity_alpha, log_tilted)
            mean, cov, low_ess = self._tilted_moments(log_tilted, loc, chol_cov, sample_key)
            target = family.from_moments(mean, family.from_dense(cov))
            delta, halvings, ok = _safe_step(family, q, target, alpha, low_ess, max_backtracks)
            clamped = low_ess + halvings
            # no halving gave a valid q: step towards the Laplace approximation instead
            if laplace_q is not None:
                fallback, extra, _ = _safe_step(family, q, laplace_q, alpha, False, max_backtracks)
                delta = jax.tree.map(lambda a, b: jnp.where(ok, a, b), delta, fallback)
                clamped = clamped + jnp.where(ok, 0, extra)
            q_new = q + delta
            zeta = family.to_dist(q_new).sample(fe_key, (64,))
            free_energy = local_free_energy(family, q_new, cavity, loglik, zeta)
            return ClientResult(
                delta, free_energy, state, clamped, inflation=variance_inflation(family, cov)
            )

        return client_update

    def _proposal(
        self, family: Family, q: NatParams, cavity_alpha: NatParams, log_tilted: Callable
    ) -> tuple:
        """``(loc, chol_cov, laplace_q)``: the proposal, and the Laplace approximation (``None`` for
        the cavity)."""
        if self.proposal == "cavity":
            loc, cov = family.moments(cavity_alpha)
            return loc, jnp.linalg.cholesky(family.to_dense(cov)), None
        fallback = family.dense_precision(cavity_alpha)
        loc, precision, chol_precision = laplace(
            log_tilted, family.loc_scale(q)[0], fallback, self.num_newton
        )
        inv = jax.scipy.linalg.solve_triangular(chol_precision, jnp.eye(loc.shape[-1]), lower=True)
        return loc, jnp.linalg.cholesky(inv.T @ inv), family.from_dense_precision(loc, precision)

    def _tilted_moments(
        self, log_tilted: Callable, loc: jax.Array, chol_cov: jax.Array, key: jax.Array
    ) -> tuple:
        """``(mean, cov, low_ess)`` of the tilted distribution: importance sampling or NUTS from the
        proposal."""
        if self.tilted == "nuts":
            mean, cov = nuts_moments(
                log_tilted,
                loc,
                chol_cov,
                key,
                self.num_chains,
                self.num_warmup,
                self.num_samples,
                self.max_tree_depth,
            )
            return mean, cov, jnp.asarray(False)
        half = jax.random.normal(key, (self.num_samples // 2, loc.shape[-1]))
        mean, cov, ess = importance_moments(
            log_tilted, loc, chol_cov, jnp.concatenate([half, -half])
        )
        return mean, cov, ess < self.min_ess * 2 * half.shape[0]


def _safe_step(
    family: Family,
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
