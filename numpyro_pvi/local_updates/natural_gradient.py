"""``NaturalGradientUpdate``: Khan & Lin's conjugate-computation VI (CVI) as the PVI client step.

CVI is mirror descent in mean parameters: with the cavity fixed, client ``m``'s factor moves towards
the natural-gradient site of its expected log-likelihood,

``t_m <- (1 - beta) t_m + beta grad_mu E_q[log p(y_m | theta)]``,  ``q = cavity * t_m``,

whose Gaussian form is ``eta2 = E_q[H] / 2``, ``eta1 = E_q[g] - E_q[H] mu`` (Bonnet / Price). With
``step_size=1`` on a Gaussian likelihood one step is exact. Expectations use antithetic draws and
``jax.hessian`` (Stein's lemma from gradients above ``max_hessian_dim``); a step that would leave
``q`` improper is halved (counted in ``RoundInfo.clamped``) and, if that fails, not taken.

Hyperparameters are supported (the client returns ``E_q[d log p(y_m | theta) / d hyper]`` at its new
``q``); local latent variables are not (use ``GradientUpdate``).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.families import NatParams, expected_site
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult, local_free_energy


class NaturalGradientUpdate:
    """Natural-gradient (CVI) local steps on the client's factor (Khan & Lin 2017; Bui et al. 2018, Prop. 5).

    :param float step_size: ``beta`` in ``(0, 1]``; 1 is the fixed-point (EP-like) update.
    :param int num_steps: natural-gradient steps per client visit.
    :param int num_particles: Monte Carlo draws for the expectations (made even: antithetic pairs).
    :param int max_backtracks: halvings of ``beta`` tried when a step would make ``q`` improper.
    :param int max_hessian_dim: largest ``D`` for which Hessians are computed; above it, Stein's lemma.

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> update = pvi.NaturalGradientUpdate(step_size=0.5, num_steps=5, num_particles=32)
    """

    supports_hyperparameters = True

    def __init__(self, step_size: float = 1.0, num_steps: int = 1, num_particles: int = 16, max_backtracks: int = 5,
                 max_hessian_dim: int = 64) -> None:
        if not 0.0 < step_size <= 1.0:
            raise ValueError(f"NaturalGradientUpdate: step_size must be in (0, 1], got {step_size!r}.")
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"NaturalGradientUpdate: num_steps must be a positive integer, got {num_steps!r}.")
        if not isinstance(num_particles, int) or num_particles < 2:
            raise ValueError(f"NaturalGradientUpdate: num_particles must be an integer >= 2, got {num_particles!r}.")
        self.step_size, self.num_steps, self.max_backtracks = step_size, num_steps, max_backtracks
        self.num_pairs, self.max_hessian_dim = num_particles // 2, max_hessian_dim

    def init_state(self, problem: ClientProblem) -> Any:
        """The client's persistent state (none for this update)."""
        return ()

    def bind(self, problem: ClientProblem) -> Callable:
        """Return the pure ``client_update(rng_key, client, cavity, q, state, hyper=()) -> ClientResult``."""
        family, beta, pairs = problem.family, self.step_size, self.num_pairs
        use_hessian = problem.dim <= self.max_hessian_dim
        max_backtracks = self.max_backtracks

        has_hyper = problem.has_hyper

        def client_update(rng_key: jax.Array, client: Client, cavity: NatParams, q: NatParams,
                          state: Any, hyper: Any = ()) -> ClientResult:
            loglik = lambda z: problem.log_likelihood(z, client, hyper)  # noqa: E731
            grad = jax.vmap(jax.grad(loglik))
            hessian = jax.vmap(jax.hessian(loglik)) if use_hessian else None

            def step(carry: tuple, key: jax.Array) -> tuple:
                t, clamped = carry
                half = jax.random.normal(key, (pairs, problem.dim))
                target = expected_site(family, cavity + t, jnp.concatenate([half, -half]), grad, hessian)
                direction = target - t

                def propose(size: jax.Array) -> tuple[NatParams, jax.Array]:
                    return t + size * direction, family.is_valid(cavity + t + size * direction)

                out = backtrack(propose, beta, max_halvings=max_backtracks)  # no valid step: t unchanged
                new = jax.tree.map(lambda a, b: jnp.where(out.valid, a, b), out.value, t)
                return (new, clamped + out.halvings), None

            t_old = q - cavity
            (t_new, clamped), _ = jax.lax.scan(step, (t_old, 0), jax.random.split(rng_key, self.num_steps))
            q_new = cavity + t_new
            # the local free energy E_q[log p(y_m | theta)] - KL(q || cavity) at the new q
            half = family.to_dist(q_new).sample(jax.random.fold_in(rng_key, 1), (pairs,))
            zeta = jnp.concatenate([half, 2 * family.loc_scale(q_new)[0] - half])  # antithetic: z and 2 mu - z
            free_energy = local_free_energy(family, q_new, cavity, loglik, zeta)
            hyper_grad = ()
            if has_hyper:  # d F_m / d hyper = E_q[d log p(y_m | theta, hyper) / d hyper] at the new q
                expected = lambda h: jnp.mean(jax.vmap(lambda z: problem.log_likelihood(z, client, h))(zeta))  # noqa: E731
                hyper_grad = jax.grad(expected)(hyper)
            return ClientResult(t_new - t_old, free_energy, state, clamped, hyper_grad)

        return client_update
