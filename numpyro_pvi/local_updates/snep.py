"""``SNEPUpdate``: stochastic natural-gradient EP (Hasenclever et al. 2017) as the PVI client step.

SNEP solves the power-EP fixed-point equations by a double loop. With the auxiliary natural
parameter ``theta'`` (the local ``q = cavity * t_m`` when last refreshed), each inner step moves
``num_chains`` persistent NUTS chains by one transition that leaves the tilted distribution

``p_m(zeta) ∝ exp((theta' - alpha t_m)^T s(zeta)) p(y_m | zeta)^alpha``  (``alpha = 1 / beta`` of
the paper)

invariant, ``s(zeta) = (zeta, zeta zeta^T)``, and takes a stochastic mirror-descent step on the
convex dual of eq. 16, whose gradient in ``t_m`` is ``E_q[s] - E_{p_m}[s]``. Every
``refresh_every`` inner steps ``theta'`` is refreshed to ``q`` (eq. 23). The step is zero exactly
when the tilted moments equal ``q``'s: the fixed points are those of power EP (EP for ``alpha =
1``).

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
  control variates, ``E_p[zeta] = E_p[zeta + Sigma grad log p(zeta)]`` and ``E_p[(zeta - c)(zeta -
  c)^T] = Sigma + E_p[sym((zeta - c + Sigma grad log p)(zeta - c)^T)]``, with ``Sigma`` the current
  ``q``'s covariance and ``c`` the previous step's mean estimate: unbiased for any ``Sigma``, exact
  when ``p_m`` is Gaussian with covariance ``Sigma`` (nearly so at the fixed point); the gradients
  come with every NUTS state. This is the MCMC analogue of ``MomentMatchingUpdate``'s
  importance-sampling control variate. A step whose covariance estimate is not positive definite
  uses the chains' plain moments (counted in ``RoundInfo.clamped``).
* **Averaging.** The visit returns the Polyak-Ruppert average (in mean parameters) of the iterates
  of its last ``average_fraction`` of inner steps, not the last iterate.

The chains and the sampler's step size are the client's persistent state (never sent): between
visits the chains are carried to the new local ``q`` by the affine map of the paper's eq. 28. A
client's first visit starts at a Laplace approximation of ``cavity * p(y_m | zeta)`` and its chains
at draws from it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from numpyro_pvi.families import Family, NatParams
from numpyro_pvi.families.gaussian import variance_inflation
from numpyro_pvi.local_updates._numerics import laplace
from numpyro_pvi.local_updates._snep_settings import SNEPSettings
from numpyro_pvi.local_updates.base import (
    Client,
    ClientProblem,
    ClientResult,
    LocalUpdate,
    local_free_energy,
)
from numpyro_pvi.local_updates.snep_blocks import bind_blocks, init_block_state
from numpyro_pvi.local_updates.snep_inner import SNEPVisit, averaged_site, run_inner


class SNEPState(NamedTuple):
    """A client's persistent SNEP state: chains ``(C, D)``, the local ``q`` they were drawn for,
    sampler step size."""

    chains: jax.Array
    q_local: NatParams
    log_step_size: jax.Array
    count: jax.Array  # inner steps so far (for the step-size decay)
    visited: jax.Array


def _is_interval(value: Any) -> bool:
    """Whether ``value`` is a pair ``(low, high)`` of real numbers with ``0 < low < high``."""
    return (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        and 0.0 < value[0] < value[1]
    )


class SNEPUpdate(LocalUpdate):
    """Stochastic natural-gradient EP local steps with persistent MCMC (Hasenclever et al. 2017).

    Converges to EP's (``alpha = 1``) or power EP's fixed point: on the tests' logistic regression
    (4 clients, 3 rounds) within 0.005 posterior sd in the means and 0.4 % in the sds of a precise
    EP run, about EP's own Monte Carlo error (``tests/test_snep.py``). ``RoundInfo.clamped`` counts
    the steps that fell back on plain moments and the site clamps.

    :param float step_size: ``eps`` in ``(0, 1)``, the step in ``q``'s mean parameters: ``E_q[s] <-
        (1 - eps) E_q[s] + eps E_tilted[s]``. Near the fixed point the error shrinks by a factor of
        about ``1 - (1 + alpha) eps`` per inner step (``1 - alpha eps`` when ``refresh_every = 1``),
        whatever the number of clients.
    :param int num_steps: inner (MCMC + mirror-descent) steps per client visit (the paper's
        ``N_sync``).
    :param int refresh_every: inner steps between refreshes of the auxiliary ``theta'`` (the
        paper's ``N_outer``).
    :param float alpha: the power-EP power ``1 / beta`` in ``(0, 1]``; 1 is EP.
    :param int num_chains: persistent NUTS chains per client; each inner step averages their states.
    :param float average_fraction: the fraction of each visit's last inner steps whose iterates are
        averaged (Polyak-Ruppert) into the returned site, in ``[0, 1)`` (0: the last iterate), as
        ``GradientUpdate``'s.
    :param bool control_variates: estimate the tilted moments with zero-variance control variates
        (default); ``False`` uses the chains' plain sample moments, as the paper (far noisier).
    :param tuple site_variance: optional ``(v_min, v_max)``: clamp the site's covariance eigenvalues
        (its precision's into ``[1 / v_max, 1 / v_min]``) after every step, as the paper's
        projection; ``None`` (default) leaves sites free, as EP. Gaussian families only (a
        ``ValueError`` with the others).
    :param float step_decay: if set, ``eps_t = eps / (1 + t / step_decay)^0.6`` over the client's
        inner steps ``t`` (Robbins-Monro); default constant.
    :param int max_tree_depth: NUTS maximum tree depth of each transition.
    :param int num_newton: Newton steps of the first visit's Laplace approximation (Gaussian
        families; natural-gradient steps for the others).

    **Other families.** With :class:`~numpyro_pvi.SiteFamilies`, ``Gamma``, ``Beta`` or
    ``Dirichlet`` the same double loop runs in the mean parameters ``E_q[T]`` of each block's
    sufficient statistics, with chains in the blocks' unconstrained coordinates and Stein control
    variates regressed under ``q`` (:mod:`numpyro_pvi.local_updates.snep_blocks`). On the tests'
    models 3 rounds end within 0.005 posterior sd and 0.4 % in the sds of the exact posterior
    (Poisson-Gamma, Dirichlet-categorical) and, with ``SiteFamilies({"w": FullRankGaussian(), "tau":
    Gamma()})`` and one client, within 0.013 sd and 1 % of EP's fixed point
    (``tests/test_snep_blocks.py``). ``site_variance`` (a Gaussian site's clamp) is a ``ValueError``
    there.

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> update = pvi.SNEPUpdate(0.05, num_steps=200, refresh_every=10, num_chains=8)
    """

    # SiteFamilies, Gamma, Beta, Dirichlet: SNEP in mean parameters (snep_blocks)
    supports_factor_families = True

    def __init__(
        self,
        step_size: float = 0.05,
        *,
        num_steps: int = 200,
        refresh_every: int = 10,
        alpha: float = 1.0,
        num_chains: int = 8,
        average_fraction: float = 0.5,
        control_variates: bool = True,
        site_variance: tuple | None = None,
        step_decay: float | None = None,
        max_tree_depth: int = 5,
        num_newton: int = 10,
    ) -> None:
        if not (isinstance(step_size, (int, float)) and 0.0 < step_size < 1.0):
            raise ValueError(f"SNEPUpdate: step_size must be in (0, 1), got {step_size!r}.")
        if not (isinstance(alpha, (int, float)) and 0.0 < alpha <= 1.0):
            raise ValueError(f"SNEPUpdate: alpha must be in (0, 1], got {alpha!r}.")
        for name, value, low in [
            ("num_steps", num_steps, 1),
            ("refresh_every", refresh_every, 1),
            ("num_chains", num_chains, 1),
            ("max_tree_depth", max_tree_depth, 1),
            ("num_newton", num_newton, 0),
        ]:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"SNEPUpdate: {name} must be an integer >= {low}, got {value!r}.")
        if not (isinstance(average_fraction, (int, float)) and 0.0 <= average_fraction < 1.0):
            raise ValueError(
                f"SNEPUpdate: average_fraction must be in [0, 1), got {average_fraction!r}."
            )
        if site_variance is not None and not _is_interval(site_variance):
            raise ValueError(
                "SNEPUpdate: site_variance must be None or a pair (v_min, v_max) of numbers with "
                f"0 < v_min < v_max, got {site_variance!r}."
            )
        if step_decay is not None and not (isinstance(step_decay, (int, float)) and step_decay > 0):
            raise ValueError(
                f"SNEPUpdate: step_decay must be positive or None, got {step_decay!r}."
            )
        self.site_variance = None if site_variance is None else tuple(site_variance)
        #: what the inner loops read: a value (the first inner step whose iterate enters the
        #: Polyak-Ruppert average is ``first_averaged``)
        self.settings = SNEPSettings(
            step_size=float(step_size),
            num_steps=num_steps,
            refresh_every=refresh_every,
            alpha=float(alpha),
            num_chains=num_chains,
            first_averaged=min(int(round(num_steps * (1.0 - average_fraction))), num_steps - 1),
            control_variates=bool(control_variates),
            site_variance=self.site_variance,
            step_decay=step_decay,
            max_tree_depth=max_tree_depth,
            num_newton=num_newton,
        )
        self.step_size, self.num_steps, self.alpha = float(step_size), num_steps, float(alpha)
        self.num_chains, self.average_fraction = num_chains, float(average_fraction)

    def init_state(self, problem: ClientProblem) -> SNEPState | Any:
        """Unvisited: chains at 0 (replaced on the first visit), an initial sampler step size of
        0.5."""
        if not isinstance(problem.family, Family):
            return init_block_state(self.settings, problem)
        return SNEPState(
            jnp.zeros((self.num_chains, problem.dim)),
            problem.family.zeros(problem.dim),
            jnp.log(jnp.asarray(0.5)),
            jnp.zeros((), jnp.int32),
            jnp.zeros((), bool),
        )

    def bind(self, problem: ClientProblem) -> Callable:
        """Return the pure ``client_update(rng_key, client, cavity, q, state, hyper=()) ->
        ClientResult``.

        A family that is not one Gaussian gets the mean-parameter path
        (:func:`~numpyro_pvi.local_updates.snep_blocks.bind_blocks`).
        """
        if not isinstance(problem.family, Family):
            return bind_blocks(self.settings, problem)
        return partial(_client_update, self.settings, problem)


def _client_update(
    settings: SNEPSettings,
    problem: ClientProblem,
    rng_key: jax.Array,
    client: Client,
    cavity: NatParams,
    q: NatParams,
    state: SNEPState,
    hyper: Any = (),
) -> ClientResult:
    """One SNEP client visit: ``settings.num_steps`` inner steps, then the averaged site
    (:meth:`SNEPUpdate.bind`)."""
    del hyper  # SNEP does not support hyperparameters; the argument is the shared interface's
    family = problem.family
    loglik = lambda z: problem.log_likelihood(z, client)  # noqa: E731
    chain_key, loop_key, fe_key = jax.random.split(rng_key, 3)
    t_old = q - cavity
    lap_q, inflation = _laplace_q(family, cavity, q, loglik, settings.num_newton)
    q_local = jax.tree.map(lambda a, b: jnp.where(state.visited, a, b), q, lap_q)
    loc, scale = family.loc_scale(q_local)
    visit = SNEPVisit(family, cavity, loc, scale, loglik, state.count)
    carry = run_inner(
        settings,
        visit,
        q_local,
        _carried_chains(family, state, q_local, chain_key),
        state.log_step_size,
        loop_key,
    )
    site, clamped = averaged_site(settings, visit, carry)

    finite = (
        family.is_valid(cavity + site)
        & jnp.all(jnp.isfinite(carry.chains))
        & jnp.isfinite(carry.log_step)
    )
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    site = jax.tree.map(keep, site, t_old)
    new_state = SNEPState(
        keep(family.unwhiten(loc, scale, carry.chains), state.chains),
        jax.tree.map(keep, cavity + site, q),
        keep(carry.log_step, state.log_step_size),
        state.count + settings.num_steps,
        finite | state.visited,
    )
    q_new = cavity + site
    zeta = family.to_dist(q_new).sample(fe_key, (64,))
    free_energy = local_free_energy(family, q_new, cavity, loglik, zeta)
    return ClientResult(
        site - t_old, free_energy, new_state, clamped + (~finite), inflation=inflation
    )


def _laplace_q(
    family: Family, cavity: NatParams, q: NatParams, loglik: Callable, num_newton: int
) -> tuple[NatParams, jax.Array]:
    """The family's Laplace approximation of ``cavity * p(y_m | zeta)`` from ``q``'s mean (``q`` if
    not valid), and the variance inflation its dense covariance has beyond the family's form
    (``ClientResult.inflation``: a deterministic estimate, where the chains' few draws would be
    noisy).

    A first visit starts there (for mean field: with the Laplace approximation's marginal
    variances).
    """
    log_tilted = lambda z: family.quadratic(cavity, z) + loglik(z)  # noqa: E731
    mode, precision, chol = laplace(
        log_tilted, family.loc_scale(q)[0], family.dense_precision(q), num_newton
    )
    lap_q = family.from_dense_precision(mode, precision)
    inflation = variance_inflation(
        family, jax.scipy.linalg.cho_solve((chol, True), jnp.eye(mode.shape[-1]))
    )
    return jax.tree.map(lambda a, b: jnp.where(family.is_valid(lap_q), a, b), lap_q, q), inflation


def _carried_chains(
    family: Family, state: SNEPState, q_local: NatParams, rng_key: jax.Array
) -> jax.Array:
    """The chains in the coordinates whitened by ``q_local``: carried from the ``q`` they were drawn
    for (eq. 28).

    A chain ``zeta = loc_old + L_old u`` keeps its ``u``, so it moves to ``loc_new + L_new u``.
    Unvisited clients (or an invalid old ``q``) draw ``u`` afresh from ``N(0, I)``.
    """
    prev_ok = state.visited & family.is_valid(state.q_local)
    prev_nat = jax.tree.map(lambda a, b: jnp.where(prev_ok, a, b), state.q_local, q_local)
    white = family.whiten(*family.loc_scale(prev_nat), state.chains)
    return jnp.where(prev_ok, white, jax.random.normal(rng_key, state.chains.shape))
