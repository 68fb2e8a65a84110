"""``SNEPUpdate``: stochastic natural-gradient EP (Hasenclever et al. 2017) as the PVI client step.

SNEP solves the power-EP fixed-point equations by a double loop. With the auxiliary natural
parameter ``theta'`` (the local ``q = cavity * t_m`` when last refreshed), each inner step moves
``num_chains`` persistent NUTS chains by one transition that leaves the tilted distribution

``p_m(zeta) ∝ exp((theta' - alpha t_m)^T s(zeta)) p(y_m | zeta)^alpha``  (``alpha = 1 / beta`` of the paper)

invariant, ``s(zeta) = (zeta, zeta zeta^T)``, and takes a stochastic mirror-descent step on the
convex dual of eq. 16, whose gradient in ``t_m`` is ``E_q[s] - E_{p_m}[s]``. Every ``num_outer``
inner steps ``theta'`` is refreshed to ``q`` (eq. 23). The step is zero exactly when the tilted
moments equal ``q``'s: the fixed points are those of power EP (EP for ``alpha = 1``).

Three choices differ from the paper's eq. 22; without them full PVI runs ended 0.2-0.3 posterior
sd and 7-17 % (in sd) from EP's fixed point, with them within 0.005 sd and 0.4 % (EP's own Monte
Carlo error; ``docs/local_updates/snep.md`` has the measurements):

* **Mirror map.** The step is taken in the mean parameters of ``q = cavity * t_m`` (mirror map
  ``A(eta_cavity + lambda_m)``, the natural gradient under ``q``'s Fisher metric), not of the site
  ``t_m`` alone: ``E_q[s] <- (1 - eps) E_q[s] + eps E_{p_m}[s]``. Same objective and fixed points,
  but the rate no longer shrinks as ``eps (Lambda_m / Lambda_q)^2`` with the site's share of the
  precision, ``q`` stays positive definite for any ``eps < 1`` (a mixture of Gaussians' moments),
  and no site-variance clamp is needed.
* **Control variates.** ``E_{p_m}[s]`` is estimated from the chains with zero-variance (Stein)
  control variates, ``E_p[zeta] = E_p[zeta + Sigma grad log p(zeta)]`` and
  ``E_p[(zeta - c)(zeta - c)^T] = Sigma + E_p[sym((zeta - c + Sigma grad log p)(zeta - c)^T)]``, with
  ``Sigma`` the current ``q``'s covariance and ``c`` the previous step's mean estimate: unbiased for
  any ``Sigma``, exact when ``p_m`` is Gaussian with covariance ``Sigma`` (nearly so at the fixed
  point); the gradients come with every NUTS state. This is the MCMC analogue of
  ``MomentMatchingUpdate``'s importance-sampling control variate. A step whose covariance estimate
  is not positive definite uses the chains' plain moments (counted in ``RoundInfo.clamped``).
* **Averaging.** The visit returns the Polyak-Ruppert average (in mean parameters) of the iterates
  of its last ``average`` fraction of inner steps, not the last iterate.

The chains and the sampler's step size are the client's persistent state (never sent): between
visits the chains are carried to the new local ``q`` by the affine map of the paper's eq. 28. A
client's first visit starts at a Laplace approximation of ``cavity * p(y_m | zeta)`` and its chains
at draws from it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular
from numpyro.infer.hmc import hmc

from numpyro_pvi.families import FullRankGaussian, NatParams
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult, local_free_energy
from numpyro_pvi.local_updates.moment_matching import full_precision, laplace, quadratic


class SNEPState(NamedTuple):
    """A client's persistent SNEP state: chains ``(C, D)``, the local ``q`` they were drawn for, sampler step size."""

    chains: jax.Array
    q_local: NatParams
    log_step_size: jax.Array
    count: jax.Array  # inner steps so far (for the step-size decay)
    visited: jax.Array


class SNEPUpdate:
    """Stochastic natural-gradient EP local steps with persistent MCMC (Hasenclever et al. 2017).

    Converges to EP's (``alpha = 1``) or power EP's fixed point: on the tests' logistic regression
    (4 clients, 3 rounds) within 0.005 posterior sd in the means and 0.4 % in the sds of a precise
    EP run, about EP's own Monte Carlo error (``tests/test_snep.py``). ``RoundInfo.clamped`` counts
    the steps that fell back on plain moments and the site clamps.

    :param float step_size: ``eps`` in ``(0, 1)``, the step in ``q``'s mean parameters:
        ``E_q[s] <- (1 - eps) E_q[s] + eps E_tilted[s]``. Near the fixed point the error shrinks by a
        factor of about ``1 - (1 + alpha) eps`` per inner step (``1 - alpha eps`` when ``num_outer = 1``),
        whatever the number of clients.
    :param int num_inner: inner (MCMC + mirror-descent) steps per client visit (the paper's ``N_sync``).
    :param int num_outer: inner steps between refreshes of the auxiliary ``theta'`` (the paper's ``N_outer``).
    :param float alpha: the power-EP power ``1 / beta`` in ``(0, 1]``; 1 is EP.
    :param int num_chains: persistent NUTS chains per client; each inner step averages their states.
    :param float average: the fraction of each visit's last inner steps whose iterates are averaged
        (Polyak-Ruppert) into the returned site, in ``(0, 1]``.
    :param bool control_variates: estimate the tilted moments with zero-variance control variates
        (default); ``False`` uses the chains' plain sample moments, as the paper (far noisier).
    :param tuple site_variance: optional ``(v_min, v_max)``: clamp the site's covariance eigenvalues (its
        precision's into ``[1 / v_max, 1 / v_min]``) after every step, as the paper's projection;
        ``None`` (default) leaves sites free, as EP.
    :param float step_decay: if set, ``eps_t = eps / (1 + t / step_decay)^0.6`` over the client's inner steps
        ``t`` (Robbins-Monro); default constant.
    :param int max_tree_depth: NUTS maximum tree depth of each transition.
    :param int num_newton: Newton steps of the first visit's Laplace approximation.

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> update = pvi.SNEPUpdate(step_size=0.05, num_inner=200, num_outer=10, num_chains=8)
    """

    def __init__(self, step_size: float = 0.05, num_inner: int = 200, num_outer: int = 10, alpha: float = 1.0,
                 num_chains: int = 8, average: float = 0.5, control_variates: bool = True,
                 site_variance: tuple | None = None, step_decay: float | None = None, max_tree_depth: int = 5,
                 num_newton: int = 10) -> None:
        if not (isinstance(step_size, (int, float)) and 0.0 < step_size < 1.0):
            raise ValueError(f"SNEPUpdate: step_size must be in (0, 1), got {step_size!r}.")
        if not (isinstance(alpha, (int, float)) and 0.0 < alpha <= 1.0):
            raise ValueError(f"SNEPUpdate: alpha must be in (0, 1], got {alpha!r}.")
        for name, value, low in [("num_inner", num_inner, 1), ("num_outer", num_outer, 1),
                                 ("num_chains", num_chains, 1), ("max_tree_depth", max_tree_depth, 1),
                                 ("num_newton", num_newton, 0)]:
            if not isinstance(value, int) or value < low:
                raise ValueError(f"SNEPUpdate: {name} must be an integer >= {low}, got {value!r}.")
        if not (isinstance(average, (int, float)) and 0.0 < average <= 1.0):
            raise ValueError(f"SNEPUpdate: average must be in (0, 1], got {average!r}.")
        if site_variance is not None and (len(site_variance) != 2 or not 0.0 < site_variance[0] < site_variance[1]):
            raise ValueError(f"SNEPUpdate: site_variance must be None or (v_min, v_max) with 0 < v_min < v_max, "
                             f"got {site_variance!r}.")
        if step_decay is not None and not step_decay > 0:
            raise ValueError(f"SNEPUpdate: step_decay must be positive or None, got {step_decay!r}.")
        self.step_size, self.num_inner, self.num_outer, self.alpha = float(step_size), num_inner, num_outer, alpha
        self.num_chains, self.average, self.control_variates = num_chains, float(average), bool(control_variates)
        self.site_variance = None if site_variance is None else tuple(site_variance)
        self.step_decay, self.max_tree_depth, self.num_newton = step_decay, max_tree_depth, num_newton

    def init_state(self, problem: ClientProblem) -> SNEPState:
        """Unvisited: chains at 0 (replaced on the first visit), an initial sampler step size of 0.5."""
        return SNEPState(jnp.zeros((self.num_chains, problem.dim)), problem.family.zeros(problem.dim),
                         jnp.log(jnp.asarray(0.5)), jnp.zeros((), jnp.int32), jnp.zeros((), bool))

    def bind(self, problem: ClientProblem) -> Callable:
        """Return the pure ``client_update(rng_key, client, cavity, q, state, hyper=()) -> ClientResult``."""
        family, alpha, dim = problem.family, self.alpha, problem.dim
        full = isinstance(family, FullRankGaussian)
        eps0, decay, num_outer, num_inner = self.step_size, self.step_decay, self.num_outer, self.num_inner
        first_averaged = min(int(round(num_inner * (1.0 - self.average))), num_inner - 1)
        control_variates, site_variance = self.control_variates, self.site_variance

        # Moments are kept in the coordinates u whitened by the local q at the start of the visit,
        # zeta = loc + chol u: a (D,) mean and a (D, D) covariance (its (D,) diagonal for mean field).
        def outer(a: jax.Array, b: jax.Array) -> jax.Array:
            return jnp.outer(a, b) if full else a * b

        def sym(a: jax.Array) -> jax.Array:
            return 0.5 * (a + a.T) if full else a

        def min_eig(cov: jax.Array) -> jax.Array:
            return jnp.min(jnp.linalg.eigvalsh(cov) if full else cov)

        def cholesky_cov(nat: NatParams) -> tuple[jax.Array, jax.Array]:
            loc, scale = family.loc_scale(nat)
            return loc, (scale if full else jnp.diag(scale))

        def mixture(a: jax.Array, b: jax.Array, mean: jax.Array, cov: jax.Array, eps: jax.Array) -> tuple:
            """Moments of ``(1 - eps) N(a, b) + eps N(mean, cov)``: the step ``(1 - eps) E_q[s] + eps E_p[s]``."""
            d = a - mean
            return (1.0 - eps) * a + eps * mean, sym((1.0 - eps) * b + eps * cov + eps * (1.0 - eps) * outer(d, d))

        def clamp_site(site: NatParams) -> tuple[NatParams, jax.Array]:
            """The site with its precision's eigenvalues clipped to ``[1 / v_max, 1 / v_min]``; whether they were."""
            v_min, v_max = site_variance
            precision = full_precision(site) if full else -2.0 * site.eta2
            if full:
                values, vectors = jnp.linalg.eigh(precision)
                clipped = jnp.clip(values, 1.0 / v_max, 1.0 / v_min)
                new = (vectors * clipped) @ vectors.T
                return NatParams(site.eta1, -0.25 * (new + new.T)), jnp.any(clipped != values)
            clipped = jnp.clip(precision, 1.0 / v_max, 1.0 / v_min)
            return NatParams(site.eta1, -0.5 * clipped), jnp.any(clipped != precision)

        def client_update(rng_key: jax.Array, client: Client, cavity: NatParams, q: NatParams,
                          state: SNEPState, hyper: Any = ()) -> ClientResult:
            del hyper  # SNEP does not support hyperparameters; the argument is the shared interface's
            loglik = lambda z: problem.log_likelihood(z, client)  # noqa: E731
            chain_key, loop_key, fe_key = jax.random.split(rng_key, 3)
            t_old = q - cavity

            # first visit: q at a Laplace approximation of cavity * likelihood; chains drawn from it
            log_tilted1 = lambda z: quadratic(cavity, z) + loglik(z)  # noqa: E731
            mode, precision, _ = laplace(log_tilted1, family.loc_scale(q)[0], full_precision(q), self.num_newton)
            lap_precision = precision if full else 1.0 / jnp.diagonal(jnp.linalg.inv(precision))  # marginal variances
            lap_q = family.from_mean_precision(mode, lap_precision)
            lap_q = jax.tree.map(lambda a, b: jnp.where(family.is_valid(lap_q), a, b), lap_q, q)
            visited = state.visited
            q_local = jax.tree.map(lambda a, b: jnp.where(visited, a, b), q, lap_q)

            loc, chol = cholesky_cov(q_local)
            chol_inv = solve_triangular(chol, jnp.eye(dim), lower=True)

            def to_nat(a: jax.Array, b: jax.Array) -> NatParams:
                """Natural parameters (in zeta) of the Gaussian with whitened mean ``a`` and covariance ``b``."""
                if full:
                    inv = jnp.linalg.inv(b)
                    prec = chol_inv.T @ (0.5 * (inv + inv.T)) @ chol_inv
                    return family.from_mean_precision(loc + chol @ a, 0.5 * (prec + prec.T))
                d = jnp.diagonal(chol)
                return family.from_mean_precision(loc + d * a, 1.0 / (b * d**2))

            def from_nat(nat: NatParams) -> tuple[jax.Array, jax.Array]:
                mean, scale = family.loc_scale(nat)
                if full:
                    white = chol_inv @ scale
                    return chol_inv @ (mean - loc), white @ white.T
                d = jnp.diagonal(chol)
                return (mean - loc) / d, (scale / d) ** 2

            def project(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
                """``q`` with its site clamped (if ``site_variance``), and whether the clamp acted."""
                if site_variance is None:
                    return a, b, jnp.zeros((), bool)
                site, clamped = clamp_site(to_nat(a, b) - cavity)
                a_c, b_c = from_nat(cavity + site)
                return jnp.where(clamped, a_c, a), jnp.where(clamped, b_c, b), clamped

            # chains: carried from the q they were drawn for to the new local q (eq. 28), or drawn afresh
            prev_ok = visited & family.is_valid(state.q_local)
            prev_nat = jax.tree.map(lambda a, b: jnp.where(prev_ok, a, b), state.q_local, q_local)
            loc_old, chol_old = cholesky_cov(prev_nat)
            white = solve_triangular(chol_old, (state.chains - loc_old).T, lower=True).T
            u0 = jnp.where(prev_ok, white, jax.random.normal(chain_key, state.chains.shape))

            # NUTS on the tilted distribution in the whitened coordinates (a unit mass matrix fits)
            def potential_gen(tau: NatParams) -> Callable:
                return lambda u: -(quadratic(tau, loc + chol @ u) + alpha * loglik(loc + chol @ u))

            init_kernel, sample_kernel = hmc(potential_fn_gen=potential_gen, algo="NUTS")

            def transition(key: jax.Array, u: jax.Array, tau: NatParams, step_size: jax.Array) -> tuple:
                hmc_state = init_kernel(u, 0, step_size=step_size, adapt_step_size=False, adapt_mass_matrix=False,
                                        max_tree_depth=self.max_tree_depth, model_args=(tau,), rng_key=key)
                hmc_state = sample_kernel(hmc_state, model_args=(tau,))
                return hmc_state.z, -hmc_state.z_grad, hmc_state.mean_accept_prob

            def tilted_moments(u: jax.Array, grad: jax.Array, b: jax.Array, centre: jax.Array) -> tuple:
                """Estimates of the tilted mean and covariance from the chains ``u`` (``grad``: of log p there).

                With control variates: ``E_p[grad log p] = 0`` and ``E_p[grad log p (u - c)^T] = -I`` for a ``c``
                that does not depend on ``u`` (the previous step's estimate of the mean), with the coefficients
                (``q``'s covariance ``b``) that make the estimates exact when ``p`` is Gaussian with covariance ``b``
                (the mean at once, the covariance once ``c`` is ``p``'s mean).
                """
                n = u.shape[0]
                mean = jnp.mean(u, axis=0)
                centred = u - mean
                cov = centred.T @ centred / n if full else jnp.mean(centred**2, axis=0)
                if not control_variates:
                    return mean, cov, jnp.zeros((), bool)
                shift = grad @ b.T if full else grad * b
                cv_mean = jnp.mean(u + shift, axis=0)
                centred = u - centre
                second = b + (sym((centred + shift).T @ centred) / n if full else
                              jnp.mean((centred + shift) * centred, axis=0))
                cv_cov = sym(second - outer(cv_mean - centre, cv_mean - centre))
                ok = min_eig(cv_cov) > 0.0  # else fall back on the plain moments (a valid covariance)
                return jnp.where(ok, cv_mean, mean), jnp.where(ok, cv_cov, cov), ~ok

            def inner(carry: tuple, xs: tuple) -> tuple:
                (a, b), centre, theta_aux, u, log_step, totals, clamped = carry
                i, key = xs
                tau = theta_aux - alpha * (to_nat(a, b) - cavity)
                keys = jax.random.split(key, u.shape[0])
                u, grad, accept = jax.vmap(transition, in_axes=(0, 0, None, None))(keys, u, tau, jnp.exp(log_step))
                log_step = log_step + 0.1 * (jnp.mean(accept) - 0.8)  # Robbins-Monro towards 80 % acceptance
                t = (state.count + i).astype(jnp.result_type(float))
                eps = eps0 if decay is None else eps0 / (1.0 + t / decay) ** 0.6
                mean, cov, fell_back = tilted_moments(u, grad, b, centre)
                a, b = mixture(a, b, mean, cov, eps)
                a, b, was_clamped = project(a, b)
                clamped = clamped + fell_back + was_clamped
                refresh = (i + 1) % num_outer == 0
                theta_aux = jax.tree.map(lambda new, old: jnp.where(refresh, new, old), to_nat(a, b), theta_aux)
                w = (i >= first_averaged).astype(a.dtype)  # Polyak-Ruppert: the mean parameters' running sums
                totals = (totals[0] + w, totals[1] + w * a, totals[2] + w * (b + outer(a, a)))
                return ((a, b), mean, theta_aux, u, log_step, totals, clamped), None

            eye = jnp.eye(dim) if full else jnp.ones(dim)
            totals = (jnp.zeros(()), jnp.zeros(dim), jnp.zeros_like(eye))
            carry = ((jnp.zeros(dim), eye), jnp.zeros(dim), q_local, u0, state.log_step_size, totals,
                     jnp.zeros((), jnp.int32))
            xs = (jnp.arange(num_inner), jax.random.split(loop_key, num_inner))
            (_, _, _, u, log_step, totals, clamped), _ = jax.lax.scan(inner, carry, xs)
            a = totals[1] / totals[0]
            site = to_nat(a, sym(totals[2] / totals[0] - outer(a, a))) - cavity
            if site_variance is not None:  # the averaged site, clamped in natural parameters (no round trip)
                site, was_clamped = clamp_site(site)
                clamped = clamped + was_clamped

            finite = family.is_valid(cavity + site) & jnp.all(jnp.isfinite(u)) & jnp.isfinite(log_step)
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            site = jax.tree.map(keep, site, t_old)
            new_state = SNEPState(keep(loc + u @ chol.T, state.chains), jax.tree.map(keep, cavity + site, q),
                                  keep(log_step, state.log_step_size), state.count + num_inner,
                                  finite | state.visited)
            q_new = cavity + site
            zeta = family.to_dist(q_new).sample(fe_key, (64,))
            free_energy = local_free_energy(family, q_new, cavity, loglik, zeta)
            return ClientResult(site - t_old, free_energy, new_state, clamped + (~finite))

        return client_update
