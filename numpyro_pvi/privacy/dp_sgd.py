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

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from numpyro.distributions import kl_divergence

from numpyro_pvi.families import NatParams
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult, LocalUpdate
from numpyro_pvi.local_updates.gradient import check_step_arguments, running_average
from numpyro_pvi.privacy import accounting as privacy
from numpyro_pvi.privacy.clipping import clipped_sum
from numpyro_pvi.state import Rejection


class DPState(NamedTuple):
    """A DP client's persistent state: ``releases``, how many updates it has released so far (merged
    or not).

    **Example:** ``int(result.state.client_states.releases[m])``.
    """

    releases: jax.Array
    inner: Any = ()


def check_dp_arguments(name: str, clip_norm: float, noise_multiplier: float) -> None:
    """Name a non-positive ``clip_norm`` or a negative ``noise_multiplier``.

    **Example:** ``check_dp_arguments("DPGradientUpdate", 1.0, -1.0)`` raises a ``ValueError``.
    """
    if not (isinstance(clip_norm, (int, float)) and 0 < clip_norm < float("inf")):
        raise ValueError(f"{name}: clip_norm must be positive and finite, got {clip_norm!r}.")
    if not (isinstance(noise_multiplier, (int, float)) and 0 <= noise_multiplier < float("inf")):
        raise ValueError(
            f"{name}: noise_multiplier must be non-negative and finite, got {noise_multiplier!r}."
        )


def gaussian_noise(rng_key: jax.Array, like: Any, sd: float) -> Any:
    """Independent ``Normal(0, sd)`` noise shaped like the pytree ``like``.

    **Example:** ``gaussian_noise(key, (loc, u), 0.5)``.
    """
    leaves, tree = jax.tree.flatten(like)
    keys = jax.random.split(rng_key, len(leaves))
    noise = [sd * jax.random.normal(key, leaf.shape, leaf.dtype) for key, leaf in zip(keys, leaves)]
    return jax.tree.unflatten(tree, noise)


def budget_gate(update: privacy.PrivateUpdate, budget: tuple[float, float] | None) -> Callable:
    """``allowed(size, releases) -> bool``: whether one more release keeps the client within
    ``budget``.

    A host callback to the accountant (under ``jit`` and ``vmap``); always true without a budget.

    **Example:** ``allowed = budget_gate(update, (1.0, 1e-5))``; ``allowed(client.size,
    state.releases)``.
    """
    if budget is None:
        return lambda size, releases: jnp.asarray(True)

    @functools.cache
    def fits(num_rows: int, num_releases: int) -> bool:
        return privacy.within_budget(update, budget, num_rows, num_releases)

    def host(size: Any, releases: Any) -> Any:
        size, releases = np.broadcast_arrays(np.asarray(size), np.asarray(releases))
        flat = [
            fits(int(n), int(r) + 1)
            for n, r in zip(size.ravel().tolist(), releases.ravel().tolist())
        ]
        return np.asarray(flat, bool).reshape(size.shape)

    def allowed(size: jax.Array, releases: jax.Array) -> jax.Array:
        return jax.pure_callback(
            host,
            jax.ShapeDtypeStruct(jnp.shape(size), bool),
            size,
            releases,
            vmap_method="expand_dims",
        )

    return allowed


def gated_result(
    allowed: jax.Array, delta: NatParams, free_energy: jax.Array, state: DPState, clamped: Any = 0
) -> ClientResult:
    """The client's result if ``allowed``; otherwise a zero delta with ``Rejection.BUDGET`` and no
    release counted.

    **Example:** ``return gated_result(allowed, q_new - q, -kl, state)``.
    """
    delta = jax.tree.map(lambda d: jnp.where(allowed, d, jnp.zeros_like(d)), delta)
    failure = jnp.where(allowed, 0, int(Rejection.BUDGET))
    return ClientResult(
        delta,
        free_energy,
        state._replace(releases=state.releases + allowed.astype(jnp.int32)),
        clamped,
        (),
        failure,
    )


class DPGradientUpdate(LocalUpdate):
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

    def rejected_state(self, old: DPState, new: DPState) -> DPState:
        """A release the server rejected still counts towards the budget (it was sent)."""
        return old._replace(releases=new.releases)

    def num_releases(self, client_states: DPState) -> jax.Array:
        """``(M,)`` each client's releases so far: the count its budget gate reads
        (``privacy_spent`` too)."""
        return client_states.releases

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
