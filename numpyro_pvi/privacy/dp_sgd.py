"""``DPGradientUpdate``: the client's local free energy optimised by DP-SGD (Heikkilä et al. 2023,
``dpsgd``).

Each step Poisson-subsamples the client's real rows at rate ``q = batch_size / n_m`` (a mask over
the padded rows, so the shapes are fixed and the update ``jit``\\ s and ``vmap``\\ s over clients),
takes the per-row gradients of the data term ``E_q[log p(y_i | zeta)]`` with ``jax.vmap``, clips
each to ``clip_norm``, sums them and adds Gaussian noise of sd ``noise_multiplier * clip_norm``; the
sum is scaled by ``1 / q`` (the DP-SGD average times ``n_m``) to estimate the data term's gradient.
The KL to the cavity touches no data and is added without noise. The per-row clipping goes through
the reparameterised draws (:mod:`numpyro_pvi.privacy.clipping`); the privacy accounting is
in
:mod:`numpyro_pvi.privacy.accounting`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from numpyro.distributions import kl_divergence

from numpyro_pvi.families import NatParams
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult, LocalUpdate
from numpyro_pvi.local_updates.gradient import check_step_arguments, running_average
from numpyro_pvi.privacy import accounting as privacy
from numpyro_pvi.privacy._release import (
    CountsReleases,
    DPState,
    budget_gate,
    check_dp_arguments,
    gated_result,
    gaussian_noise,
)
from numpyro_pvi.privacy.clipping import clipped_sum


class DPGradientUpdate(CountsReleases, LocalUpdate):
    """Optimise the local free energy by DP-SGD: per-row clipped, noised gradients of the data term.

    Like :class:`~numpyro_pvi.GradientUpdate` (same guide parameterisation, optax optimiser, Polyak
    averaging over the last ``average_fraction`` of the steps), but every step's data gradient is
    the DP-SGD estimate: rows Poisson-sampled at rate ``q = min(1, batch_size / n_m)``, each row's
    gradient (``jax.vmap``) clipped to ``clip_norm``, summed, ``Normal(0, (noise_multiplier *
    clip_norm)^2)`` added per coordinate, divided by ``q``. The KL to the cavity (no data) is exact.
    One release per client visit: ``num_steps`` subsampled Gaussian mechanisms
    (:func:`numpyro_pvi.privacy.accounting.dp_sgd_event`).

    Every family: a Gaussian one optimises ``(loc, u)``; any other
    (:class:`~numpyro_pvi.SiteFamilies`, ``Gamma``, ``Beta``, ``Dirichlet``) the unconstrained
    values of its guide's ``numpyro.param`` sites, with the guide's reparameterised draws
    (:meth:`~numpyro_pvi.families.FactorFamily.reparameterised`); the clipping, the noise and the
    accounting are the same.

    The cost of a step is one per-row gradient in ``zeta`` for every padded row (Poisson sampling
    under fixed shapes), whatever ``batch_size``, plus one ordinary backward pass for the clipped
    sum (:func:`~numpyro_pvi.privacy.clipping.clipped_sum`); a ``batch_size`` of at least
    the padded rows takes every row without drawing (rate 1). The reported ``free_energy`` is
    ``-KL(q_new || cavity)`` only: the data term would leak, and is not released. With
    ``privacy_budget=(epsilon, delta)``, a client whose next release would spend more returns a zero
    delta and :attr:`Rejection.BUDGET <numpyro_pvi.state.Rejection>`. Models with local latent
    variables or hyperparameters are not supported.

    :param optimizer: an ``optax.GradientTransformation``.
    :param int num_steps: DP-SGD steps per client visit.
    :param int batch_size: expected rows per step (sampling rate ``batch_size / n_m``).
    :param float clip_norm: ``C``, the bound on each row's gradient norm.
    :param float noise_multiplier: ``sigma``: the noise sd is ``sigma * C``.
    :param int num_particles: draws of ``zeta`` per step (shared by the rows).
    :param float average_fraction: Polyak-average the parameters over this last fraction of the
        steps.
    :param privacy_budget: ``(epsilon, delta)`` each client may spend over the run, or ``None``.

    **Example:**

    .. doctest::

        >>> import optax, numpyro_pvi as pvi
        >>> update = pvi.DPGradientUpdate(
        ...     optax.adam(1e-2),
        ...     num_steps=100,
        ...     batch_size=20,
        ...     clip_norm=5.0,
        ...     noise_multiplier=1.0,
        ...     privacy_budget=(2.0, 1e-5),
        ... )
    """

    supports_local_latents = False
    supports_hyperparameters = False
    supports_factor_families = True

    def __init__(
        self,
        optimizer: optax.GradientTransformation,
        *,
        num_steps: int,
        batch_size: int,
        clip_norm: float,
        noise_multiplier: float,
        num_particles: int = 1,
        average_fraction: float = 0.5,
        privacy_budget: tuple[float, float] | None = None,
    ) -> None:
        check_step_arguments("DPGradientUpdate", num_steps, num_particles, average_fraction)
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(
                "DPGradientUpdate: optimizer must be an optax.GradientTransformation, got "
                f"{optimizer!r}."
            )
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(
                f"DPGradientUpdate: batch_size must be a positive integer, got {batch_size!r}."
            )
        check_dp_arguments("DPGradientUpdate", clip_norm, noise_multiplier)
        self.privacy_budget = privacy.check_budget(privacy_budget, "DPGradientUpdate")
        if self.privacy_budget is not None and noise_multiplier == 0:
            raise ValueError(
                "DPGradientUpdate: a privacy_budget needs noise_multiplier > 0 (no noise spends "
                "an infinite epsilon)."
            )
        self.optimizer, self.num_steps, self.batch_size = optimizer, num_steps, batch_size
        self.clip_norm, self.noise_multiplier = float(clip_norm), float(noise_multiplier)
        self.num_particles = num_particles
        self.num_average = max(1, int(round(average_fraction * num_steps)))

    def sampling_rate(self, num_rows: int) -> float:
        """``min(1, batch_size / num_rows)``: the Poisson sampling rate for a client of ``num_rows``
        rows."""
        return min(1.0, self.batch_size / max(int(num_rows), 1))

    def dp_event(self, num_rows: int, num_releases: int) -> Any:
        """The ``DpEvent`` of ``num_releases`` releases of a client of ``num_rows`` rows."""
        return privacy.dp_sgd_event(
            self.sampling_rate(num_rows), self.noise_multiplier, self.num_steps * num_releases
        )

    def init_state(self, problem: ClientProblem) -> DPState:
        """No release yet."""
        return DPState(jnp.zeros((), jnp.int32))

    def bind(self, problem: ClientProblem) -> Callable:
        """Return the pure ``client_update(rng_key, client, cavity, q, state, hyper=()) ->
        ClientResult``."""
        optimizer, parameters = self.optimizer, problem.family.reparameterised(problem.dim)
        num_steps, num_average, allowed = (
            self.num_steps,
            self.num_average,
            budget_gate(self, self.privacy_budget),
        )
        data_gradient = self.data_gradient(problem)

        def client_update(
            rng_key: jax.Array,
            client: Client,
            cavity: NatParams,
            q: NatParams,
            state: DPState,
            hyper: Any = (),
        ) -> ClientResult:
            cavity_dist, params = parameters.cavity_distribution(cavity), parameters.init(q)
            rate = jnp.minimum(1.0, self.batch_size / jnp.maximum(client.size, 1))

            def kl(params: Any) -> jax.Array:
                return kl_divergence(parameters.distribution(params), cavity_dist)

            def step(carry: tuple, xs: tuple) -> tuple:
                params, opt_state, average = carry
                i, key = xs
                grad = jax.tree.map(
                    jnp.subtract, jax.grad(kl)(params), data_gradient(key, params, client, rate)
                )
                updates, opt_state = optimizer.update(grad, opt_state, params)
                params = optax.apply_updates(params, updates)
                return (
                    params,
                    opt_state,
                    running_average(average, params, i, num_steps, num_average),
                ), None

            xs = (jnp.arange(num_steps), jax.random.split(rng_key, num_steps))
            (_, _, average), _ = jax.lax.scan(step, (params, optimizer.init(params), params), xs)
            return gated_result(
                allowed(client.size, state.releases),
                parameters.nat(average) - q,
                -kl(average),
                state,
            )

        return client_update

    def data_gradient(self, problem: ClientProblem) -> Callable:
        """``(key, params, client, rate) -> gradient``: one DP-SGD estimate of the data term's
        gradient.

        **Example:** ``grad = update.data_gradient(problem)(key, (loc, u), client, 0.1)``.
        """
        dim, clip_norm, sd = problem.dim, self.clip_norm, self.noise_multiplier * self.clip_norm
        parameters = problem.family.reparameterised(problem.dim)

        def gradient(rng_key: jax.Array, params: Any, client: Client, rate: jax.Array) -> Any:
            sample_key, draw_key, noise_key = jax.random.split(rng_key, 3)
            # rate 1 (n_m <= padded rows <= batch): every real row
            if self.batch_size >= client.mask.shape[0]:
                chosen = client.mask
            else:
                chosen = client.mask & (jax.random.uniform(sample_key, client.mask.shape) < rate)
            eps = parameters.noise(draw_key, self.num_particles, dim)
            summed = clipped_sum(problem, params, eps, client, chosen, clip_norm)
            noise = gaussian_noise(noise_key, summed, sd)
            return jax.tree.map(lambda s, n: (s + n) / rate, summed, noise)

        return gradient
