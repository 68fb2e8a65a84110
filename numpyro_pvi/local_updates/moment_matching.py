"""``MomentMatchingUpdate``: EP and power EP as the PVI client step (Minka 2004; Bui et al. 2018, §3.2).

Client ``m`` forms the tilted distribution ``p_m(zeta) ∝ q_alpha(zeta) p(y_m | zeta)^alpha`` with the
power-EP cavity ``q_alpha = q / t_m^alpha``, estimates its mean and covariance (its diagonal for
``MeanFieldGaussian``: the family's own form), matches a Gaussian ``q_tilde`` to them and moves its factor by
``delta = (eta(q_tilde) - eta(q)) / alpha``; with ``alpha = 1`` this is EP (``q_new = q_tilde``).

The tilted moments come from importance sampling (default) or NUTS. Both start from a Laplace
approximation of the tilted distribution (a few damped Newton steps from ``q``'s mean): it is the
importance proposal, and NUTS runs in its whitened coordinates. Importance sampling uses the
proposal's exact moments as a control variate, so it is exact when the tilted distribution is
Gaussian (a conjugate likelihood) and cheap when it is nearly so. A step that would make ``q``
improper is halved (counted in ``RoundInfo.clamped``), as is a step from weights with a low
effective sample size; if no halving helps, the step is not taken.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.scipy.linalg import cho_solve
from numpyro.infer.hmc import hmc

from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.families import Family, NatParams
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult, local_free_energy


def laplace(log_density: Callable, start: jax.Array, fallback: jax.Array, num_newton: int) -> tuple:
    """Mode and ``(D, D)`` precision of ``log_density`` by ``num_newton`` damped Newton steps from ``start``.

    Where the Hessian is not negative definite (a non-log-concave density) the step uses the
    positive-definite ``fallback`` precision instead, and so does the returned precision. Every step
    is halved until the density does not decrease (at most 10 times; then it is not taken).
    """
    value_grad, hessian = jax.value_and_grad(log_density), jax.hessian(log_density)

    def curvature(z: jax.Array) -> tuple[jax.Array, jax.Array]:
        precision = -hessian(z)
        precision = 0.5 * (precision + precision.T)
        chol = jnp.linalg.cholesky(precision)
        ok = jnp.all(jnp.isfinite(chol))
        return jnp.where(ok, precision, fallback), jnp.where(ok, chol, jnp.linalg.cholesky(fallback))

    def newton(z: jax.Array, _: Any) -> tuple:
        value, grad = value_grad(z)
        _, chol = curvature(z)
        direction = cho_solve((chol, True), grad)

        def propose(step: jax.Array) -> tuple[jax.Array, jax.Array]:
            new = z + step * direction
            return new, log_density(new) >= value

        out = backtrack(propose, 1.0, max_halvings=10)
        return jnp.where(out.valid & jnp.all(jnp.isfinite(direction)), out.value, z), None

    mode, _ = jax.lax.scan(newton, start, None, length=num_newton)
    precision, chol = curvature(mode)
    return mode, precision, chol


def importance_moments(log_density: Callable, loc: jax.Array, chol_cov: jax.Array, eps: jax.Array) -> tuple:
    """Self-normalised importance estimates of the mean and covariance, proposal ``N(loc, L L^T)``.

    The proposal's exact moments are the control variate: ``E_p[f] ~ E_g[f] + sum_i (w_i - 1/S) f(z_i)``,
    exact (up to rounding) when ``p`` is the proposal. ``eps`` ``(S, D)`` are standard-normal points.

    :return: ``(mean, cov, ess)``, the effective sample size ``1 / sum_i w_i^2`` of the normalised weights.
    """
    num = eps.shape[0]
    zeta = loc + eps @ chol_cov.T
    log_proposal = -0.5 * jnp.sum(eps**2, axis=-1)  # up to a constant, which the normalisation removes
    log_w = jax.vmap(log_density)(zeta) - log_proposal
    log_w = jnp.where(jnp.isnan(log_w), -jnp.inf, log_w)
    w = jax.nn.softmax(log_w)
    excess = w - 1.0 / num
    centred = zeta - loc
    shift = excess @ centred
    second = chol_cov @ chol_cov.T + (centred * excess[:, None]).T @ centred
    cov = second - jnp.outer(shift, shift)
    return loc + shift, 0.5 * (cov + cov.T), 1.0 / jnp.sum(w**2)


def nuts_moments(log_density: Callable, loc: jax.Array, chol_cov: jax.Array, rng_key: jax.Array, num_chains: int,
                 num_warmup: int, num_samples: int, max_tree_depth: int) -> tuple[jax.Array, jax.Array]:
    """Mean and covariance from NUTS chains in the coordinates ``zeta = loc + L u`` (a unit mass matrix fits).

    NumPyro's functional ``hmc(potential_fn, algo="NUTS")`` kernels run in ``lax.scan``: step-size
    adaptation over the warm-up, the mass matrix fixed at the identity in ``u``.
    """
    potential = lambda u: -log_density(loc + chol_cov @ u)  # noqa: E731
    init_kernel, sample_kernel = hmc(potential_fn=potential, algo="NUTS")

    def chain(key: jax.Array) -> jax.Array:
        init_key, start_key = jax.random.split(key)
        u0 = 0.1 * jax.random.normal(start_key, loc.shape)
        state = init_kernel(u0, num_warmup, step_size=0.5, adapt_mass_matrix=False,
                            max_tree_depth=max_tree_depth, rng_key=init_key)
        state, _ = jax.lax.scan(lambda s, _: (sample_kernel(s), None), state, None, length=num_warmup)
        _, us = jax.lax.scan(lambda s, _: (sample_kernel(s),) * 2, state, None, length=num_samples)
        return us.z

    u = jax.vmap(chain)(jax.random.split(rng_key, num_chains)).reshape(-1, loc.shape[0])
    zeta = loc + u @ chol_cov.T
    mean = jnp.mean(zeta, axis=0)
    centred = zeta - mean
    return mean, centred.T @ centred / (zeta.shape[0] - 1)


class MomentMatchingUpdate:
    """EP / power-EP local steps: match ``q`` to the client's tilted distribution (Minka 2004; Bui et al. 2018).

    The tilted distribution is ``q_alpha(zeta) p(y_m | zeta)^alpha`` with ``q_alpha = q / t_m^alpha``; its
    moments are estimated, a Gaussian ``q_tilde`` matched to them, and the factor moves by
    ``(eta(q_tilde) - eta(q)) / alpha``. ``alpha = 1`` is EP; ``alpha < 1`` (power EP) smooths the
    likelihood and keeps the tilted distribution closer to ``q``. With ``Synchronous`` and
    ``tilted="nuts"`` this is distributed EP as in ep-stan (Vehtari et al. 2020).

    :param float alpha: the power, in ``(0, 1]``.
    :param str tilted: ``"importance"`` (self-normalised importance sampling from a Laplace approximation of
        the tilted distribution, with its moments as control variates; cheap, exact for Gaussian
        likelihoods) or ``"nuts"`` (NumPyro's NUTS in the Laplace approximation's whitened coordinates).
    :param int num_samples: importance draws (made even: antithetic pairs), or NUTS draws per chain.
    :param str proposal: ``"laplace"`` (default) or ``"cavity"`` (importance sampling from ``q_alpha`` itself,
        which is only adequate when one client's likelihood moves ``q`` little).
    :param float min_ess: the step is halved (and counted as clamped) when the importance weights' effective
        sample size is below this fraction of ``num_samples``.
    :param int num_newton: Newton steps for the Laplace approximation.
    :param int num_chains: NUTS chains per client.
    :param int num_warmup: NUTS warm-up steps per chain.
    :param int max_tree_depth: NUTS maximum tree depth.
    :param int max_backtracks: halvings of the step tried when it would make ``q`` improper.

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> ep = pvi.MomentMatchingUpdate(alpha=1.0, tilted="importance", num_samples=512)
        >>> power_ep = pvi.MomentMatchingUpdate(alpha=0.5, tilted="nuts", num_samples=500, num_warmup=300)
    """

    def __init__(self, alpha: float = 1.0, tilted: str = "importance", num_samples: int | None = None,
                 proposal: str = "laplace", min_ess: float = 0.1, num_newton: int = 10, num_chains: int = 2,
                 num_warmup: int = 300, max_tree_depth: int = 6, max_backtracks: int = 5) -> None:
        if not (isinstance(alpha, (int, float)) and 0.0 < alpha <= 1.0):
            raise ValueError(f"MomentMatchingUpdate: alpha must be in (0, 1], got {alpha!r}.")
        if tilted not in ("importance", "nuts"):
            raise ValueError(f"MomentMatchingUpdate: tilted must be 'importance' or 'nuts', got {tilted!r}.")
        if proposal not in ("laplace", "cavity"):
            raise ValueError(f"MomentMatchingUpdate: proposal must be 'laplace' or 'cavity', got {proposal!r}.")
        num_samples = (1024 if tilted == "importance" else 500) if num_samples is None else num_samples
        if not isinstance(num_samples, int) or num_samples < 2:
            raise ValueError(f"MomentMatchingUpdate: num_samples must be an integer >= 2, got {num_samples!r}.")
        if not 0.0 <= min_ess < 1.0:
            raise ValueError(f"MomentMatchingUpdate: min_ess must be in [0, 1), got {min_ess!r}.")
        for name, value, low in [("num_newton", num_newton, 0), ("num_chains", num_chains, 1),
                                 ("num_warmup", num_warmup, 0), ("max_tree_depth", max_tree_depth, 1),
                                 ("max_backtracks", max_backtracks, 0)]:
            if not isinstance(value, int) or value < low:
                raise ValueError(f"MomentMatchingUpdate: {name} must be an integer >= {low}, got {value!r}.")
        self.alpha, self.tilted, self.num_samples, self.proposal = float(alpha), tilted, num_samples, proposal
        self.min_ess, self.num_newton, self.num_chains, self.num_warmup = min_ess, num_newton, num_chains, num_warmup
        self.max_tree_depth, self.max_backtracks = max_tree_depth, max_backtracks

    def init_state(self, problem: ClientProblem) -> Any:
        """The client's persistent state (none for this update)."""
        return ()

    def bind(self, problem: ClientProblem) -> Callable:
        """Return the pure ``client_update(rng_key, client, cavity, q, state, hyper=()) -> ClientResult``."""
        family, alpha, max_backtracks = problem.family, self.alpha, self.max_backtracks

        def client_update(rng_key: jax.Array, client: Client, cavity: NatParams, q: NatParams,
                          state: Any, hyper: Any = ()) -> ClientResult:
            loglik = lambda z: problem.log_likelihood(z, client, hyper)  # noqa: E731
            cavity_alpha = alpha * cavity + (1.0 - alpha) * q  # q / t_m^alpha: valid, a convex combination
            log_tilted = lambda z: family.quadratic(cavity_alpha, z) + alpha * loglik(z)  # noqa: E731
            sample_key, fe_key = jax.random.split(rng_key)
            clamped = 0
            if self.proposal == "laplace":
                fallback = family.dense_precision(cavity_alpha)
                loc, _, chol_precision = laplace(log_tilted, family.loc_scale(q)[0], fallback, self.num_newton)
                inv = jax.scipy.linalg.solve_triangular(chol_precision, jnp.eye(problem.dim), lower=True)
                chol_cov = jnp.linalg.cholesky(inv.T @ inv)
            else:
                loc, cov = family.moments(cavity_alpha)
                chol_cov = jnp.linalg.cholesky(family.to_dense(cov))
            if self.tilted == "importance":
                half = jax.random.normal(sample_key, (self.num_samples // 2, problem.dim))
                mean, cov, ess = importance_moments(log_tilted, loc, chol_cov, jnp.concatenate([half, -half]))
                low_ess = ess < self.min_ess * 2 * half.shape[0]
                clamped = clamped + low_ess
            else:
                mean, cov = nuts_moments(log_tilted, loc, chol_cov, sample_key, self.num_chains, self.num_warmup,
                                         self.num_samples, self.max_tree_depth)
                low_ess = False
            delta, halvings = _safe_step(family, q, family.from_moments(mean, family.from_dense(cov)), alpha,
                                         low_ess, max_backtracks)
            clamped = clamped + halvings
            q_new = q + delta
            zeta = family.to_dist(q_new).sample(fe_key, (64,))
            free_energy = local_free_energy(family, q_new, cavity, loglik, zeta)
            return ClientResult(delta, free_energy, state, clamped)

        return client_update


def _safe_step(family: Family, q: NatParams, target: NatParams, alpha: float, low_ess: jax.Array | bool,
               max_backtracks: int) -> tuple[NatParams, jax.Array]:
    """The step ``(target - q) / alpha``, halved until ``q`` stays valid, and the number of halvings.

    A low effective sample size starts at half the step (that halving is counted apart). At most
    ``max_backtracks`` halvings in all; if none gives a valid ``q`` the step is not taken (and counts
    ``max_backtracks + 1`` halvings, less the one for a low effective sample size).
    """
    delta = (target - q) * (1.0 / alpha)
    start = jnp.where(low_ess, 1, 0)

    def propose(step: jax.Array) -> tuple[NatParams, jax.Array]:
        return step * delta, family.is_valid(q + step * delta)

    out = backtrack(propose, 1.0, max_halvings=max_backtracks - start, start=start)
    ok = out.valid & (start <= max_backtracks)  # max_backtracks=0 allows no halving, not even for a low ESS
    return jax.tree.map(lambda d: jnp.where(ok, d, 0.0), out.value), out.halvings
