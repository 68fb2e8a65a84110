"""SNEP's inner loop: persistent NUTS chains on the tilted distribution and mirror-descent steps in
``q``'s moments.

One client visit of :class:`~numpyro_pvi.SNEPUpdate` runs :func:`run_inner`: a ``lax.scan`` of
:func:`inner_step` over a :class:`SNEPCarry`. Moments are kept in the coordinates ``u`` whitened by
the local ``q`` at the start of the visit, ``zeta = loc + L u`` (:class:`SNEPVisit`), as a ``(D,)``
mean and a covariance in the family's form; every family-specific operation is a
:class:`~numpyro_pvi.families.Family` method.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from numpyro_pvi.families import Family, NatParams
from numpyro_pvi.local_updates._numerics import adapted_log_step, nuts_kernel
from numpyro_pvi.local_updates._snep_settings import SNEPSettings


class SNEPVisit(NamedTuple):
    """What every inner step of one client visit shares.

    :ivar family: the :class:`~numpyro_pvi.families.Family`.
    :ivar cavity: the client's cavity.
    :ivar loc: the whitening's shift: the local ``q``'s mean at the start of the visit.
    :ivar scale: the whitening's scale ``L`` (``zeta = loc + L u``): that ``q``'s guide scale.
    :ivar loglik: ``zeta -> log p(y_m | zeta)``.
    :ivar count: the client's inner steps before this visit (for the step-size decay).
    """

    family: Family
    cavity: NatParams
    loc: jax.Array
    scale: jax.Array
    loglik: Callable
    count: jax.Array

    def to_nat(self, mean: jax.Array, cov: jax.Array) -> NatParams:
        """Natural parameters (in ``zeta``) of the Gaussian with whitened moments ``(mean,
        cov)``."""
        return self.family.whitened_to_nat(self.loc, self.scale, mean, cov)


class SNEPCarry(NamedTuple):
    """The inner loop's carry (whitened moments; ``cov`` and ``sum_second`` in the family's form).

    :ivar mean: the local ``q``'s mean.
    :ivar cov: the local ``q``'s covariance.
    :ivar centre: the previous step's tilted-mean estimate, the control variates' centre.
    :ivar theta_aux: the auxiliary natural parameter ``theta'`` (the local ``q`` when last
        refreshed).
    :ivar chains: the chains' states ``(C, D)``.
    :ivar log_step: the log of NUTS's step size.
    :ivar weight: how many iterates the Polyak-Ruppert average holds so far.
    :ivar sum_mean: the sum of their means.
    :ivar sum_second: the sum of their second moments ``cov + mean mean^T``.
    :ivar clamped: fallbacks on plain moments and site clamps so far.

    **Example:** at EP's fixed point (``q`` is the tilted distribution, here Gaussian) the control
    variates are exact, so the inner steps leave ``q`` where it is.

    .. doctest::

        >>> import jax, jax.numpy as jnp, numpyro_pvi as pvi
        >>> from numpyro_pvi.local_updates.snep_inner import SNEPVisit, averaged_site, run_inner
        >>> family = pvi.MeanFieldGaussian()
        >>> cavity = family.from_loc_scale(jnp.zeros(2), jnp.ones(2))
        >>> loglik = lambda z: (
        ...     -0.5 * jnp.sum((z - 1.0) ** 2)
        ... )  # the tilted distribution is N(0.5, 0.5)
        >>> q = family.from_moments(jnp.full(2, 0.5), jnp.full(2, 0.5))
        >>> visit = SNEPVisit(
        ...     family, cavity, *family.loc_scale(q), loglik, jnp.zeros((), jnp.int32)
        ... )
        >>> settings = pvi.SNEPUpdate(num_steps=20, num_chains=4, max_tree_depth=3).settings
        >>> carry = run_inner(
        ...     settings, visit, q, jnp.zeros((4, 2)), jnp.log(0.5), jax.random.PRNGKey(0)
        ... )
        >>> carry.chains.shape, int(carry.weight)  # the last half of the 20 iterates are averaged
        ((4, 2), 10)
        >>> site, clamped = averaged_site(settings, visit, carry)
        >>> bool(jnp.allclose((cavity + site).eta1, q.eta1, atol=1e-4)), int(clamped)
        (True, 0)
    """

    mean: jax.Array
    cov: jax.Array
    centre: jax.Array
    theta_aux: NatParams
    chains: jax.Array
    log_step: jax.Array
    weight: jax.Array
    sum_mean: jax.Array
    sum_second: jax.Array
    clamped: jax.Array


def nuts_transition(visit: SNEPVisit, alpha: float, max_tree_depth: int) -> Callable:
    """``(key, u, tau, step_size) -> (u, grad log p(u), accept prob)``: one NUTS transition in
    ``u``.

    The target is the tilted ``exp(tau . s(zeta)) p(y_m | zeta)^alpha`` in the whitened coordinates
    (where a unit mass matrix fits). :class:`SNEPCarry` has an example of the inner loop.
    """
    family = visit.family

    def potential_gen(tau: NatParams) -> Callable:
        def potential(u: jax.Array) -> jax.Array:
            zeta = family.unwhiten(visit.loc, visit.scale, u)
            return -(family.quadratic(tau, zeta) + alpha * visit.loglik(zeta))

        return potential

    return nuts_kernel(potential_gen, max_tree_depth)


def tilted_moments(
    family: Family,
    u: jax.Array,
    grad: jax.Array,
    cov_q: jax.Array,
    centre: jax.Array,
    control_variates: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Estimates of the tilted mean and covariance from the chains ``u`` (``grad``: of log p there).

    With control variates: ``E_p[grad log p] = 0`` and ``E_p[grad log p (u - c)^T] = -I`` for a
    ``c`` that does not depend on ``u`` (the previous step's estimate of the mean), with the
    coefficients (``q``'s covariance ``cov_q``) that make the estimates exact when ``p`` is Gaussian
    with covariance ``cov_q`` (the mean at once, the covariance once ``c`` is ``p``'s mean). An
    estimate that is not positive definite falls back on the plain moments.

    :return: ``(mean, cov, fell_back)``.

    **Example:** chains of ``N(1, 1)`` (``grad log p = 1 - u``) with ``cov_q = 1``: exact whatever
    the draws.

    .. doctest::

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> from numpyro_pvi.local_updates.snep_inner import tilted_moments
        >>> u = jnp.array([[0.0], [3.0], [-1.0]])
        >>> tilted_moments(pvi.MeanFieldGaussian(), u, 1.0 - u, jnp.ones(1), jnp.ones(1), True)
        (Array([1.], dtype=float32), Array([1.], dtype=float32), Array(False, dtype=bool))
    """
    n = u.shape[0]
    mean = jnp.mean(u, axis=0)
    centred = u - mean
    cov = family.outer_sum(centred, centred) / n
    if not control_variates:
        return mean, cov, jnp.zeros((), bool)
    shift = family.matvec(cov_q, grad)
    cv_mean = jnp.mean(u + shift, axis=0)
    centred = u - centre
    second = cov_q + family.sym(family.outer_sum(centred + shift, centred)) / n
    cv_cov = family.sym(second - family.outer(cv_mean - centre, cv_mean - centre))
    ok = family.min_eig(cv_cov) > 0.0  # else fall back on the plain moments (a valid covariance)
    return jnp.where(ok, cv_mean, mean), jnp.where(ok, cv_cov, cov), ~ok


def _clamp_site(
    family: Family, site: NatParams, site_variance: tuple
) -> tuple[NatParams, jax.Array]:
    """The site with its precision's eigenvalues clipped to ``[1 / v_max, 1 / v_min]``; whether they
    were."""
    v_min, v_max = site_variance
    return family.clamp_precision(site, 1.0 / v_max, 1.0 / v_min)


def _project(
    visit: SNEPVisit, site_variance: tuple | None, mean: jax.Array, cov: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The whitened moments of ``q`` with its site clamped (if ``site_variance``), and whether the
    clamp acted."""
    if site_variance is None:
        return mean, cov, jnp.zeros((), bool)
    site, clamped = _clamp_site(visit.family, visit.to_nat(mean, cov) - visit.cavity, site_variance)
    mean_c, cov_c = visit.family.nat_to_whitened(visit.loc, visit.scale, visit.cavity + site)
    return jnp.where(clamped, mean_c, mean), jnp.where(clamped, cov_c, cov), clamped


def inner_step(
    settings: SNEPSettings,
    visit: SNEPVisit,
    transition: Callable,
    carry: SNEPCarry,
    xs: tuple[jax.Array, jax.Array],
) -> tuple[SNEPCarry, None]:
    """One NUTS transition of every chain and one mirror-descent step ``E_q[s] <- (1 - eps) E_q[s] +
    eps E_p[s]``.

    The ``lax.scan`` body of :func:`run_inner` (``xs``: the step's index and key);
    :class:`SNEPCarry` has an example.
    """
    family, (i, key) = visit.family, xs
    tau = carry.theta_aux - settings.alpha * (visit.to_nat(carry.mean, carry.cov) - visit.cavity)
    keys = jax.random.split(key, carry.chains.shape[0])
    step_size = jnp.exp(carry.log_step)
    u, grad, accept = jax.vmap(transition, in_axes=(0, 0, None, None))(
        keys, carry.chains, tau, step_size
    )
    log_step = adapted_log_step(carry.log_step, accept)
    eps = settings.step_size_at(visit.count + i)
    mean, cov, fell_back = tilted_moments(
        family, u, grad, carry.cov, carry.centre, settings.control_variates
    )
    a, b = family.mix_moments(carry.mean, carry.cov, mean, cov, eps)
    a, b, was_clamped = _project(visit, settings.site_variance, a, b)
    refresh = (i + 1) % settings.refresh_every == 0
    theta_aux = jax.tree.map(
        lambda new, old: jnp.where(refresh, new, old), visit.to_nat(a, b), carry.theta_aux
    )
    # Polyak-Ruppert: the mean parameters' running sums
    w = (i >= settings.first_averaged).astype(a.dtype)
    return SNEPCarry(
        a,
        b,
        mean,
        theta_aux,
        u,
        log_step,
        carry.weight + w,
        carry.sum_mean + w * a,
        carry.sum_second + w * (b + family.outer(a, a)),
        carry.clamped + fell_back + was_clamped,
    ), None


def run_inner(
    settings: SNEPSettings,
    visit: SNEPVisit,
    q_local: NatParams,
    chains: jax.Array,
    log_step: jax.Array,
    rng_key: jax.Array,
) -> SNEPCarry:
    """``settings.num_steps`` inner steps from the local ``q`` (whitened: mean 0, covariance I) and
    the chains.

    :class:`SNEPCarry` has an example.
    """
    dim = visit.loc.shape[-1]
    eye = visit.family.identity(dim)
    carry = SNEPCarry(
        jnp.zeros(dim),
        eye,
        jnp.zeros(dim),
        q_local,
        chains,
        log_step,
        jnp.zeros(()),
        jnp.zeros(dim),
        jnp.zeros_like(eye),
        jnp.zeros((), jnp.int32),
    )
    step = partial(
        inner_step, settings, visit, nuts_transition(visit, settings.alpha, settings.max_tree_depth)
    )
    xs = (jnp.arange(settings.num_steps), jax.random.split(rng_key, settings.num_steps))
    carry, _ = jax.lax.scan(step, carry, xs)
    return carry


def averaged_site(
    settings: SNEPSettings, visit: SNEPVisit, carry: SNEPCarry
) -> tuple[NatParams, Any]:
    """The site of the Polyak-Ruppert average (the moments of the averaged iterates' mixture), and
    the clamp count.

    With ``site_variance`` the averaged site is clamped in natural parameters (no round trip).
    :class:`SNEPCarry` has an example.
    """
    family = visit.family
    a = carry.sum_mean / carry.weight
    site = (
        visit.to_nat(a, family.sym(carry.sum_second / carry.weight - family.outer(a, a)))
        - visit.cavity
    )
    clamped = carry.clamped
    if settings.site_variance is not None:
        site, was_clamped = _clamp_site(family, site, settings.site_variance)
        clamped = clamped + was_clamped
    return site, clamped
