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

The chains and the sampler's step size are the client's persistent state (never sent): at the end
of a visit the chains are re-expressed in the chain coordinates of the ``q`` it returned (the
paper's eq. 28: a chain moves with ``q``'s change between visits). A client's first visit starts at
a Laplace approximation of ``cavity * p(y_m | zeta)`` (or after natural-gradient steps, as the
family's estimator says) and its chains at ``N(0, I)`` in chain coordinates.

**One loop for every family.** The loop (:func:`run_inner`, :func:`inner_step`) is written once, in
the family's chain coordinates and mean parameters
(:class:`~numpyro_pvi.families.MeanParamFamily`); the estimate of the tilted mean parameters, the
mirror map back to natural parameters and the site clamp are the family's
:meth:`~numpyro_pvi.families.MeanParamFamily.chain_moments`: for one Gaussian the whitened moments
with the control variates above
(:class:`~numpyro_pvi.families.gaussian_chains.GaussianChains`), for the other families their mean
parameters with Stein features regressed under ``q``
(:class:`~numpyro_pvi.families.chain_moments.MeanParamChains`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.compilation import split_keys
from numpyro_pvi.families import FactorFamily, MeanParamFamily, NatParams
from numpyro_pvi.families.chain_moments import ChainMoments
from numpyro_pvi.families.gaussian import tilted_inflation, variance_inflation
from numpyro_pvi.local_updates._numerics import adapted_log_step, laplace, nuts_kernel, where_tree
from numpyro_pvi.local_updates._snep_settings import SNEPSettings
from numpyro_pvi.local_updates.base import (
    Client,
    ClientProblem,
    ClientResult,
    LocalUpdate,
    local_free_energy,
)


class SNEPState(NamedTuple):
    """A client's persistent SNEP state (never sent).

    :ivar chains: the chains ``(C, K)`` in the chain coordinates
        (:meth:`~numpyro_pvi.families.MeanParamFamily.chain_frame`) of the ``q`` the client's last
        visit returned (``K``: :meth:`~numpyro_pvi.families.MeanParamFamily.chain_dim`).
    :ivar log_step_size: the log of NUTS's step size.
    :ivar count: inner steps so far (for the step-size decay).
    :ivar visited: whether the client was visited (else the chains are drawn afresh).
    """

    chains: jax.Array
    log_step_size: jax.Array
    count: jax.Array
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
    EP run, about EP's own Monte Carlo error (``tests/local_updates/test_snep.py``).
    ``RoundInfo.clamped`` counts
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
    variates regressed under ``q``
    (:class:`~numpyro_pvi.families.chain_moments.MeanParamChains`). On the tests'
    models 3 rounds end within 0.005 posterior sd and 0.4 % in the sds of the exact posterior
    (Poisson-Gamma, Dirichlet-categorical) and, with ``SiteFamilies({"w": FullRankGaussian(), "tau":
    Gamma()})`` and one client, within 0.013 sd and 1 % of EP's fixed point
    (``tests/local_updates/test_snep_blocks.py``). ``site_variance`` (a Gaussian site's clamp) is a
    ``ValueError``
    there.

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> update = pvi.SNEPUpdate(0.05, num_steps=200, refresh_every=10, num_chains=8)
    """

    # SiteFamilies, Gamma, Beta, Dirichlet: the same loop with the family's ChainMoments
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

    def init_state(self, problem: ClientProblem) -> SNEPState:
        """Unvisited: chains at 0 (drawn on the first visit), an initial sampler step size of 0.5.

        ``NotImplementedError`` for a family without mean parameters, ``ValueError`` for
        ``site_variance`` with a family that has no site clamp.
        """
        family = _chain_family(problem.family)
        family.chain_moments(self.settings.control_variates, self.settings.site_variance)
        # built in NumPy and sent (eager JAX operations compile one program each in a fresh process)
        state = SNEPState(
            np.zeros(
                (self.settings.num_chains, family.chain_dim(problem.dim)), jnp.result_type(float)
            ),
            np.log(np.asarray(0.5, jnp.result_type(float))),
            np.zeros((), np.int32),
            np.zeros((), bool),
        )
        return jax.device_put(state)

    def bind(self, problem: ClientProblem) -> Callable:
        """Return the pure ``client_update(rng_key, client, cavity, q, state, hyper=()) ->
        ClientResult`` (one loop for every family; the estimator is the family's
        :meth:`~numpyro_pvi.families.MeanParamFamily.chain_moments`)."""
        family = _chain_family(problem.family)
        chain_moments = family.chain_moments(
            self.settings.control_variates, self.settings.site_variance
        )
        return partial(_client_update, self.settings, problem, family, chain_moments)


def _chain_family(family: FactorFamily) -> MeanParamFamily:
    """``family`` as a :class:`~numpyro_pvi.families.MeanParamFamily`
    (``NotImplementedError`` if it has no mean parameters)."""
    chain_family = family.mean_param_family()
    if chain_family is None:
        raise NotImplementedError(
            "SNEPUpdate needs a family with mean parameters (a Gaussian family, SiteFamilies, "
            f"Gamma, Beta or Dirichlet), not {family!r}."
        )
    return chain_family


class SNEPVisit(NamedTuple):
    """What every inner step of one client visit shares.

    :ivar family: the family (a :class:`~numpyro_pvi.families.MeanParamFamily`).
    :ivar moments: its :class:`~numpyro_pvi.families.chain_moments.ChainMoments`.
    :ivar cavity: the client's cavity.
    :ivar frame: the chains' coordinates (the local ``q`` at the start of the visit).
    :ivar coefficients: the control variates' constants for that ``q``.
    :ivar loglik: ``theta -> log p(y_m | theta)``.
    :ivar count: the client's inner steps before this visit (for the step-size decay).
    """

    family: Any
    moments: ChainMoments
    cavity: NatParams
    frame: Any
    coefficients: Any
    loglik: Callable
    count: jax.Array


class SNEPCarry(NamedTuple):
    """The inner loop's carry (mean parameters in the visit's
    :class:`~numpyro_pvi.families.chain_moments.ChainMoments` representation).

    :ivar mean: the local ``q``'s mean parameters.
    :ivar nat: the local ``q``.
    :ivar previous: the previous step's estimate of the tilted mean parameters (a control-variate
        centre).
    :ivar theta_aux: the auxiliary natural parameter ``theta'`` (the local ``q`` when last
        refreshed).
    :ivar chains: the chains ``(C, K)`` in chain coordinates.
    :ivar log_step: the log of NUTS's step size.
    :ivar weight: how many iterates the Polyak-Ruppert average holds so far.
    :ivar sum_mean: the sum of their mean parameters.
    :ivar clamped: the steps that fell back on the plain average (or kept the previous iterate)
        and the site clamps, so far.

    **Example:** at EP's fixed point (``q`` is the tilted distribution, here Gaussian) the control
    variates are exact, so the inner steps leave ``q`` where it is.

    .. doctest::

        >>> import jax, jax.numpy as jnp, numpyro_pvi as pvi
        >>> from numpyro_pvi.local_updates.snep import SNEPVisit, averaged_site, run_inner
        >>> family = pvi.MeanFieldGaussian()
        >>> cavity = family.from_loc_scale(jnp.zeros(2), jnp.ones(2))
        >>> loglik = lambda z: -0.5 * jnp.sum((z - 1.0) ** 2)  # the tilted: N(0.5, 0.5)
        >>> q = family.from_moments(jnp.full(2, 0.5), jnp.full(2, 0.5))
        >>> settings = pvi.SNEPUpdate(num_steps=20, num_chains=4, max_tree_depth=3).settings
        >>> moments = family.chain_moments(control_variates=True, site_variance=None)
        >>> frame = family.chain_frame(q)
        >>> visit = SNEPVisit(family, moments, cavity, frame, (), loglik, jnp.zeros((), jnp.int32))
        >>> carry = run_inner(
        ...     settings, visit, q, jnp.zeros((4, 2)), jnp.log(0.5), jax.random.PRNGKey(0)
        ... )
        >>> carry.chains.shape, int(carry.weight)  # the last half of the 20 iterates are averaged
        ((4, 2), 10)
        >>> site, clamped = averaged_site(visit, carry)
        >>> bool(jnp.allclose((cavity + site).eta1, q.eta1, atol=1e-4)), int(clamped)
        (True, 0)
    """

    mean: NatParams
    nat: NatParams
    previous: NatParams
    theta_aux: NatParams
    chains: jax.Array
    log_step: jax.Array
    weight: jax.Array
    sum_mean: NatParams
    clamped: jax.Array


def nuts_transition(visit: SNEPVisit, alpha: float, max_tree_depth: int) -> Callable:
    """``(key, u, tau, step_size) -> (u, grad log p(u), accept prob)``: one NUTS transition of the
    tilted ``exp(tau . T(theta)) p(y_m | theta)^alpha`` in chain coordinates (where a unit mass
    matrix fits), the log Jacobian included. :class:`SNEPCarry` has an example."""
    family = visit.family

    def potential_gen(tau: NatParams) -> Callable:
        def potential(u: jax.Array) -> jax.Array:
            theta, log_det = family.from_chain(visit.frame, u)
            return -(family.log_factor(tau, theta) + alpha * visit.loglik(theta) + log_det)

        return potential

    return nuts_kernel(potential_gen, max_tree_depth)


def _mirror_step(
    visit: SNEPVisit, carry: SNEPCarry, estimate: NatParams, eps: Any
) -> tuple[NatParams, NatParams, jax.Array]:
    """``m <- (1 - eps) m + eps estimate``, its natural parameters and whether they are valid and
    hold ``m``."""
    target = carry.mean * (1.0 - eps) + estimate * eps
    nat, ok = visit.moments.from_mean_params(visit.frame, target, carry.nat)
    return target, nat, ok


def inner_step(
    settings: SNEPSettings,
    visit: SNEPVisit,
    transition: Callable,
    carry: SNEPCarry,
    xs: tuple[jax.Array, jax.Array],
) -> tuple[SNEPCarry, None]:
    """One NUTS transition of every chain and the mirror step ``m <- (1 - eps) m + eps E_hat[T]``.

    ``E_hat[T]`` is the family's Stein-corrected estimate; where it is not in the mean domain, or
    its step has no valid member, the chains' plain average is used, and where that has none
    either the previous iterate is kept (both counted). The ``lax.scan`` body of :func:`run_inner`
    (``xs``: the step's index and key); :class:`SNEPCarry` has an example.
    """
    moments, (i, key) = visit.moments, xs
    tau = carry.theta_aux - (carry.nat - visit.cavity) * settings.alpha
    keys = jax.random.split(key, carry.chains.shape[0])
    u, grad, accept = jax.vmap(transition, in_axes=(0, 0, None, None))(
        keys, carry.chains, tau, jnp.exp(carry.log_step)
    )
    eps = settings.step_size_at(visit.count + i)
    tilted = moments.tilted_mean_params(
        visit.frame, visit.coefficients, u, grad, carry.mean, carry.previous
    )
    estimate = where_tree(tilted.in_domain, tilted.estimate, tilted.plain)
    mean, nat, ok = _mirror_step(visit, carry, estimate, eps)
    plain_mean, plain_nat, plain_ok = _mirror_step(visit, carry, tilted.plain, eps)
    fell_back = ~tilted.in_domain | ~ok
    mean, nat = where_tree(ok, mean, plain_mean), where_tree(ok, nat, plain_nat)
    ok = ok | plain_ok
    mean, nat = where_tree(ok, mean, carry.mean), where_tree(ok, nat, carry.nat)
    # the site clamp (site_variance), in natural parameters
    nat, was_clamped = moments.project(visit.cavity, nat)
    mean = where_tree(was_clamped, moments.mean_params(visit.frame, nat), mean)
    theta_aux = where_tree((i + 1) % settings.refresh_every == 0, nat, carry.theta_aux)
    # Polyak-Ruppert: the mean parameters' running sum
    w = (i >= settings.first_averaged).astype(u.dtype)
    return SNEPCarry(
        mean,
        nat,
        estimate,
        theta_aux,
        u,
        adapted_log_step(carry.log_step, accept),
        carry.weight + w,
        carry.sum_mean + mean * w,
        carry.clamped + fell_back + was_clamped,
    ), None


def run_inner(
    settings: SNEPSettings,
    visit: SNEPVisit,
    q: NatParams,
    chains: jax.Array,
    log_step: jax.Array,
    rng_key: jax.Array,
) -> SNEPCarry:
    """``settings.num_steps`` inner steps from the local ``q`` and the chains (in chain
    coordinates of ``visit.frame``). :class:`SNEPCarry` has an example."""
    mean = visit.moments.mean_params(visit.frame, q)
    carry = SNEPCarry(
        mean, q, mean, q, chains, log_step, jnp.zeros(()), mean * 0.0, jnp.zeros((), jnp.int32)
    )
    step = partial(
        inner_step,
        settings,
        visit,
        nuts_transition(visit, settings.alpha, settings.max_tree_depth),
    )
    xs = (jnp.arange(settings.num_steps), split_keys(rng_key, settings.num_steps))
    carry, _ = jax.lax.scan(step, carry, xs)
    return carry


def averaged_site(visit: SNEPVisit, carry: SNEPCarry) -> tuple[NatParams, jax.Array]:
    """The site of the Polyak-Ruppert average of the mean parameters (the last iterate's if it has
    no valid member, counted), clamped as every step's, and the visit's clamp count.
    :class:`SNEPCarry` has an example."""
    mean = carry.sum_mean * (1.0 / carry.weight)
    nat, averaged = visit.moments.from_mean_params(visit.frame, mean, carry.nat)
    nat, was_clamped = visit.moments.project(visit.cavity, where_tree(averaged, nat, carry.nat))
    return nat - visit.cavity, carry.clamped + (~averaged) + was_clamped


def _laplace_q(
    family: FactorFamily, cavity: NatParams, q: NatParams, loglik: Callable, num_newton: int
) -> tuple[NatParams, jax.Array]:
    """The family's Laplace approximation of ``cavity * p(y_m | zeta)`` by Newton from ``q``'s mode
    (``q`` if not valid), and the variance inflation its dense covariance has beyond the family's
    form (``ClientResult.inflation``: a deterministic estimate, where the chains' few draws would be
    noisy).

    A first visit starts there when the family's estimator asks for it
    (:attr:`~numpyro_pvi.families.chain_moments.ChainMoments.laplace_start`; for mean field: with
    the Laplace approximation's marginal variances).
    """

    def log_tilted(x: jax.Array) -> jax.Array:
        zeta, log_cavity = family.laplace_log_density(cavity, x)
        return log_cavity + loglik(zeta)

    mode, precision, chol = laplace(
        log_tilted, family.laplace_start(q), family.laplace_precision(q), num_newton
    )
    lap_q = family.from_laplace(mode, precision)
    inflation = variance_inflation(
        family, jax.scipy.linalg.cho_solve((chol, True), jnp.eye(mode.shape[-1]))
    )
    return where_tree(family.is_valid(lap_q), lap_q, q), inflation


def natural_gradient_start(
    family: FactorFamily,
    cavity: NatParams,
    q: NatParams,
    loglik: Callable,
    rng_key: jax.Array,
    num_steps: int,
    pairs: int = 64,
) -> NatParams:
    """A first visit's start where the family's estimator does not start at the Laplace
    approximation: ``num_steps`` natural-gradient (CVI) steps ``q <- cavity * site(q)``, the
    client's site :meth:`~numpyro_pvi.families.FactorFamily.site_from_draws` at ``2 pairs`` draws
    of ``q`` (one step is exact for a conjugate likelihood). A step whose ``q`` is not valid is
    skipped."""

    def step(current: NatParams, key: jax.Array) -> tuple[NatParams, None]:
        zeta = family.draw(current, key, pairs)
        values, grads = jax.vmap(jax.value_and_grad(loglik))(zeta)
        new = cavity + family.site_from_draws(current, zeta, values, grads, None)
        return where_tree(family.is_valid(new), new, current), None

    start, _ = jax.lax.scan(step, q, split_keys(rng_key, num_steps))
    return start


def _client_update(
    settings: SNEPSettings,
    problem: ClientProblem,
    family: Any,
    moments: ChainMoments,
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
    loglik = lambda theta: problem.log_likelihood(theta, client)  # noqa: E731
    start_key, loop_key, fe_key = jax.random.split(rng_key, 3)
    start_key, chain_key = jax.random.split(start_key)
    t_old = q - cavity
    # a first visit starts at the Laplace approximation or after natural-gradient steps
    if moments.laplace_start:
        start, inflation = _laplace_q(family, cavity, q, loglik, settings.num_newton)
    else:
        start = natural_gradient_start(family, cavity, q, loglik, start_key, settings.num_newton)
    q_local = where_tree(state.visited, q, start)
    chains = jnp.where(
        state.visited, state.chains, jax.random.normal(chain_key, state.chains.shape)
    )
    frame = family.chain_frame(q_local)
    visit = SNEPVisit(
        family,
        moments,
        cavity,
        frame,
        moments.coefficients(frame, q_local),
        loglik,
        state.count,
    )
    carry = run_inner(settings, visit, q_local, chains, state.log_step_size, loop_key)
    site, clamped = averaged_site(visit, carry)

    # the chains in the coordinates of the new q, which the next visit keeps (the paper's eq. 28:
    # a chain moves with q's change between visits)
    q_new = cavity + site
    new_frame = family.chain_frame(where_tree(family.is_valid(q_new), q_new, q_local))
    chains = jax.vmap(lambda u: family.to_chain(new_frame, family.from_chain(frame, u)[0]))(
        carry.chains
    )
    finite = family.is_valid(q_new) & jnp.all(jnp.isfinite(chains)) & jnp.isfinite(carry.log_step)
    site = where_tree(finite, site, t_old)
    new_state = SNEPState(
        jnp.where(finite, chains, state.chains),
        jnp.where(finite, carry.log_step, state.log_step_size),
        state.count + settings.num_steps,
        finite | state.visited,
    )
    q_new = cavity + site
    free_energy = local_free_energy(family, q_new, cavity, loglik, family.draw(q_new, fe_key, 32))
    if not moments.laplace_start:
        # the tilted's, as EP's (power EP), from importance draws of q
        cavity_alpha = cavity * settings.alpha + q_new * (1.0 - settings.alpha)
        inflation = tilted_inflation(
            family, q_new, cavity_alpha, loglik, settings.alpha, jax.random.fold_in(fe_key, 1)
        )
    return ClientResult(
        site - t_old, free_energy, new_state, clamped + (~finite), inflation=inflation
    )
