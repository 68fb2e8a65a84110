"""``NaturalGradientUpdate``: Khan & Lin's conjugate-computation VI (CVI) as the PVI client step.

CVI is mirror descent in mean parameters: with the cavity fixed, client ``m``'s factor moves towards
the natural-gradient site of its expected log-likelihood,

``t_m <- (1 - beta) t_m + beta grad_mu E_q[log p(y_m | theta)]``,  ``q = cavity * t_m``,

whose Gaussian form is ``eta2 = E_q[H] / 2``, ``eta1 = E_q[g] - E_q[H] mu`` (Bonnet / Price). With
``step_size=1`` on a Gaussian likelihood one step is exact. Expectations use antithetic draws and
``jax.hessian`` (Stein's lemma from gradients above ``max_hessian_dim``). A step is halved (counted
in ``RoundInfo.clamped``) until ``q`` is proper and its estimated local free energy is finite and
has not fallen by more than ``tolerance`` (from a wide prior a step can give a proper ``q`` far out
in a tail where, e.g., ``exp`` overflows); if no halving passes, or the client's Laplace site beats
the step's local free energy by more than ``tolerance`` (from a wide prior an accepted step can
collapse q's variance at a wrong mean), the Laplace site is taken if it passes, else no step.

One ``client_update`` serves every family: the draws, the site from them and the Laplace site (the
joint mode and curvature of ``cavity * p(y_m | theta)`` by Newton in the family's unconstrained
coordinates: ``zeta`` for a Gaussian, ``log theta`` for a ``Gamma`` block...) are the family's
(:class:`~numpyro_pvi.families.FactorFamily`).

Hyperparameters are supported (the client returns ``E_q[d log p(y_m | theta) / d hyper]`` at its new
``q``); local latent variables are not (use ``GradientUpdate``).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.families import FactorFamily, NatParams
from numpyro_pvi.local_updates._numerics import laplace_site
from numpyro_pvi.local_updates.base import (
    Client,
    ClientProblem,
    ClientResult,
    LocalUpdate,
    free_energy_from_values,
    local_free_energy,
)
from numpyro_pvi.local_updates.gradient import check_hyper_particles


class NaturalGradientUpdate(LocalUpdate):
    """Natural-gradient (CVI) local steps on the client's factor (Khan & Lin 2017; Bui et al. 2018,
    Prop. 5).

    Each step is halved until ``q`` is valid and its local free energy ``F_m(q)`` (estimated with
    the step's own draws, so old and new ``q`` are compared with common random numbers) is finite
    and no more than ``tolerance`` below the current one; if no halving passes, or the client's
    Laplace site (the mode and curvature of ``cavity * p(y_m | theta)``) beats the step's ``F_m`` by
    more than ``tolerance``, the Laplace site is taken if it passes (counted in
    ``RoundInfo.clamped``), else no step.

    :param float step_size: ``beta`` in ``(0, 1]``; 1 is the fixed-point (EP-like) update.
    :param int num_steps: natural-gradient steps per client visit.
    :param int num_particles: Monte Carlo draws for the expectations (made even: antithetic pairs).
    :param int max_backtracks: halvings of ``beta`` tried when a step would make ``q`` improper or
        lower its local free energy.
    :param int max_hessian_dim: largest ``D`` for which Hessians are computed; above it, Stein's
        lemma (and no Laplace fallback).
    :param float tolerance: the drop in the estimated local free energy (nats) a step may make, for
        Monte Carlo noise; ``inf`` checks only validity and finiteness.
    :param bool laplace_fallback: whether a step with no acceptable halving falls back to the
        Laplace site.
    :param int num_newton: at most this many Newton steps for the Laplace site.
    :param int num_hyper_particles: antithetic draws of ``q`` for the hyperparameters' gradient (the
        step's ``num_particles`` draws if those are more): the server steps on the sum of the
        clients' estimates once a round, so their noise is what is left near the optimum (16 draws:
        an sd of 0.86 on the noise-scale model of ``tests/test_hyperparameters.py``, 1.3 % of its
        noise scale; 256: 0.22).

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> update = pvi.NaturalGradientUpdate(step_size=0.5, num_steps=5, num_particles=32)
    """

    supports_hyperparameters = True
    supports_factor_families = True

    def __init__(
        self,
        step_size: float = 1.0,
        num_steps: int = 1,
        num_particles: int = 16,
        max_backtracks: int = 5,
        max_hessian_dim: int = 64,
        tolerance: float = 1.0,
        laplace_fallback: bool = True,
        num_newton: int = 20,
        num_hyper_particles: int = 256,
    ) -> None:
        if not 0.0 < step_size <= 1.0:
            raise ValueError(
                f"NaturalGradientUpdate: step_size must be in (0, 1], got {step_size!r}."
            )
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(
                f"NaturalGradientUpdate: num_steps must be a positive integer, got {num_steps!r}."
            )
        if not isinstance(num_particles, int) or num_particles < 2:
            raise ValueError(
                "NaturalGradientUpdate: num_particles must be an integer >= 2, got "
                f"{num_particles!r}."
            )
        if not tolerance >= 0.0:
            raise ValueError(f"NaturalGradientUpdate: tolerance must be >= 0, got {tolerance!r}.")
        if not isinstance(num_newton, int) or num_newton < 0:
            raise ValueError(
                f"NaturalGradientUpdate: num_newton must be an integer >= 0, got {num_newton!r}."
            )
        self.step_size, self.num_steps, self.max_backtracks = step_size, num_steps, max_backtracks
        self.num_pairs, self.max_hessian_dim = num_particles // 2, max_hessian_dim
        self.tolerance, self.laplace_fallback, self.num_newton = (
            float(tolerance),
            laplace_fallback,
            num_newton,
        )
        check_hyper_particles("NaturalGradientUpdate", num_hyper_particles, 2)
        self.num_hyper_pairs = num_hyper_particles // 2

    def init_state(self, problem: ClientProblem) -> Any:
        """The client's persistent state (none for this update)."""
        return ()

    def bind(self, problem: ClientProblem) -> Callable:
        """Return the pure ``client_update(rng_key, client, cavity, q, state, hyper=()) ->
        ClientResult``.

        One update for every family: the draws (:meth:`~numpyro_pvi.families.FactorFamily.draw`),
        the site (:meth:`~numpyro_pvi.families.FactorFamily.site_from_draws`) and the Laplace site
        (the ``laplace_*`` members and :meth:`~numpyro_pvi.families.FactorFamily.from_laplace`) are
        the family's."""
        family, pairs = problem.family, self.num_pairs
        use_hessian = problem.dim <= self.max_hessian_dim
        fallback = self.laplace_fallback and use_hessian and self.num_newton > 0

        def client_update(
            rng_key: jax.Array,
            client: Client,
            cavity: NatParams,
            q: NatParams,
            state: Any,
            hyper: Any = (),
        ) -> ClientResult:
            loglik = lambda z: problem.log_likelihood(z, client, hyper)  # noqa: E731
            hessian = jax.vmap(jax.hessian(loglik)) if use_hessian else None
            fallback_site = (
                laplace_site(family, cavity, q, loglik, self.num_newton) if fallback else None
            )
            step = self._step(family, cavity, loglik, hessian, fallback_site, pairs)
            t_old = q - cavity
            (t_new, clamped), _ = jax.lax.scan(
                step, (t_old, 0), jax.random.split(rng_key, self.num_steps)
            )
            q_new = cavity + t_new
            # the local free energy E_q[log p(y_m | theta)] - KL(q || cavity) at the new q
            zeta = family.draw(q_new, jax.random.fold_in(rng_key, 1), pairs)
            free_energy = local_free_energy(family, q_new, cavity, loglik, zeta)
            hyper_grad = ()
            # d F_m / d hyper = E_q[d log p(y_m | theta, hyper) / d hyper] at the new q
            if problem.has_hyper:
                hyper_grad = self._hyper_grad(
                    problem, family, q_new, zeta, jax.random.fold_in(rng_key, 2), client, hyper
                )
            return ClientResult(t_new - t_old, free_energy, state, clamped, hyper_grad)

        return client_update

    def _step(
        self,
        family: FactorFamily,
        cavity: NatParams,
        loglik: Callable,
        hessian: Callable | None,
        fallback_site: NatParams | None,
        pairs: int,
    ) -> Callable:
        """One natural-gradient step ``(t, clamped), key -> (t_new, clamped + corrections)`` for
        ``lax.scan``.

        Every ``F_m`` is estimated from ``family.draw(q, key, pairs)`` with the step's ``key``
        (common random numbers: for a Gaussian, the same standard-normal points under each
        ``q``)."""
        beta, max_backtracks, tolerance = self.step_size, self.max_backtracks, self.tolerance
        value_and_grad = jax.vmap(jax.value_and_grad(loglik))

        def step(carry: tuple, key: jax.Array) -> tuple:
            t, clamped = carry
            q_now = cavity + t
            zeta = family.draw(q_now, key, pairs)
            values, grads = value_and_grad(zeta)
            target = family.site_from_draws(
                q_now, zeta, values, grads, None if hessian is None else hessian(zeta)
            )
            free_energy = lambda site: _draws_free_energy(family, cavity, site, loglik, key, pairs)  # noqa: E731
            # F_m at the (valid) current q from the draws above: free_energy(t) would draw them
            # again with the same key (a second sampler in the compiled step)
            current = free_energy_from_values(family, q_now, cavity, values)
            floor = jnp.where(jnp.isfinite(current), current - tolerance, -jnp.inf)

            def propose(size: jax.Array) -> tuple[tuple, jax.Array]:
                new = t + size * (target - t)
                value = free_energy(new)  # NaN where q is invalid
                return (new, value), jnp.isfinite(value) & (value >= floor)

            # none acceptable: t unchanged
            out = backtrack(propose, beta, max_halvings=max_backtracks)
            new = jax.tree.map(lambda a, b: jnp.where(out.valid, a, b), out.value[0], t)
            if fallback_site is None:
                return (new, clamped + out.halvings), None
            # The Laplace site when no halving passes, or when it beats the step by more than
            # ``tolerance``: from a wide q the site of a log link sees exp(huge) curvature and
            # collapses q's variance at a wrong mean, a step that still raises F_m (issue 23,
            # problem 3), or every step is refused and q stays at the prior (a Gamma block from a
            # wide prior). Counted as one clamp.
            laplace_value = free_energy(fallback_site)
            better = laplace_value > jnp.where(out.valid, out.value[1], current) + tolerance
            use = (~out.valid | better) & jnp.isfinite(laplace_value) & (laplace_value >= floor)
            new = jax.tree.map(lambda a, b: jnp.where(use, a, b), fallback_site, new)
            return (new, clamped + out.halvings + (use & out.valid)), None

        return step

    def _hyper_grad(
        self,
        problem: ClientProblem,
        family: FactorFamily,
        q_new: NatParams,
        zeta: jax.Array,
        rng_key: jax.Array,
        client: Client,
        hyper: Any,
    ) -> Any:
        """``E_q[d log p(y_m | theta, hyper) / d hyper]`` at ``q_new``: from the free energy's draws
        ``zeta``, or from ``num_hyper_particles`` fresh (antithetic) draws if they are more."""
        if 2 * self.num_hyper_pairs > zeta.shape[0]:
            zeta = family.draw(q_new, rng_key, self.num_hyper_pairs)
        expected = lambda h: jnp.mean(  # noqa: E731
            jax.vmap(lambda z: problem.log_likelihood(z, client, h))(zeta)
        )
        return jax.grad(expected)(hyper)


def _draws_free_energy(
    family: FactorFamily,
    cavity: NatParams,
    site: NatParams,
    loglik: Callable,
    key: jax.Array,
    pairs: int,
) -> jax.Array:
    """``F_m`` at ``q = cavity * site`` from ``q``'s draws with ``key`` (NaN if ``q`` is
    invalid)."""
    q = cavity + site
    valid = family.is_valid(q)
    safe = jax.tree.map(lambda a, b: jnp.where(valid, a, b), q, cavity)
    value = local_free_energy(family, safe, cavity, loglik, family.draw(safe, key, pairs))
    return jnp.where(valid, value, jnp.nan)
