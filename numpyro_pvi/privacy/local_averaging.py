"""``DPLocalAveraging``: a client releases the clipped, noised average of its shards' updates
(DP-PVI's ``lfa``).

The client assigns each real row to one of ``S = num_shards`` disjoint shards (independently,
uniformly, from the round's key), runs the wrapped local update on every shard at once (``jax.vmap``
over shard masks) with the shard's likelihood scaled by ``S`` (so each shard stands in for the whole
client), clips each shard's natural-parameter delta to ``clip_norm`` and releases their average plus
Gaussian noise.

Sensitivity: adding or removing one row changes one shard only; that shard's clipped delta moves by
at most ``2 * clip_norm`` (both ends lie in the ball of radius ``clip_norm``), so the average moves
by at most ``2 * clip_norm / S``. The noise sd is ``noise_multiplier`` times that sensitivity, and
one release is the Gaussian mechanism with ``noise_multiplier``
(:func:`numpyro_pvi.privacy.accounting.gaussian_event`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from numpyro.distributions import kl_divergence

from numpyro_pvi.families import NatParams
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult, LocalUpdate
from numpyro_pvi.privacy import accounting as privacy
from numpyro_pvi.privacy._release import (
    CountsReleases,
    DPState,
    budget_gate,
    check_dp_arguments,
    gated_result,
    gaussian_noise,
)
from numpyro_pvi.privacy.clipping import clip_rows


class DPLocalAveraging(CountsReleases, LocalUpdate):
    """Wrap a local update: fit it on ``num_shards`` disjoint shards, release the clipped, noised
    mean delta.

    Each shard's delta (a :class:`~numpyro_pvi.families.NatParams`, flattened over all its leaves:
    for :class:`~numpyro_pvi.SiteFamilies` ``eta1`` and every block's ``eta2``) is clipped to
    Euclidean norm ``clip_norm``; the released delta is their mean plus ``Normal(0, sd^2)`` per
    coordinate with ``sd = noise_multiplier * 2 * clip_norm / num_shards`` (``noise_multiplier``
    times the mean's add/remove-one-row sensitivity, see the module docstring). The wrapped update's
    ``free_energy`` is not released: the reported one is ``-KL(q + delta || cavity)``, a function of
    the release. The shards' rows, their keys and the noise come from the round's key: shard ``s``
    runs with ``jax.random.split(rng_key, num_shards + 1)[s]``, the last key assigns the rows and
    draws the noise.

    The wrapped update must keep no persistent client state (e.g. ``GradientUpdate``,
    ``NaturalGradientUpdate``, ``MomentMatchingUpdate`` on models without local latents). Any family
    the wrapped update supports works (:attr:`supports_factor_families`): with
    ``NaturalGradientUpdate(step_size=1.0)`` and a conjugate likelihood (e.g. ``pvi.Gamma()`` on
    Poisson counts) each shard's site is exact, so without noise and clipping the released delta is
    the whole client's.

    :param local_update: the update each shard runs (a
        :class:`~numpyro_pvi.local_updates.LocalUpdate`).
    :param int num_shards: ``S``, the number of disjoint shards of the client's rows.
    :param float clip_norm: the bound on each shard's natural-parameter delta.
    :param float noise_multiplier: the noise sd over the sensitivity ``2 * clip_norm / S``.
    :param privacy_budget: ``(epsilon, delta)`` each client may spend over the run, or ``None``.

    **Example:**

    .. doctest::

        >>> import optax, numpyro_pvi as pvi
        >>> inner = pvi.GradientUpdate(optax.adam(1e-2), num_steps=200)
        >>> update = pvi.DPLocalAveraging(inner, num_shards=5, clip_norm=10.0, noise_multiplier=2.0)
    """

    supports_local_latents = False
    supports_hyperparameters = False

    def __init__(
        self,
        local_update: LocalUpdate,
        *,
        num_shards: int,
        clip_norm: float,
        noise_multiplier: float,
        privacy_budget: tuple[float, float] | None = None,
    ) -> None:
        if not isinstance(local_update, LocalUpdate):
            raise TypeError(
                f"DPLocalAveraging: local_update must be a LocalUpdate, got {local_update!r}."
            )
        if isinstance(local_update, privacy.PrivateUpdate):
            raise TypeError(
                "DPLocalAveraging: wrap a non-private local update (e.g. pvi.GradientUpdate)."
            )
        if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1:
            raise ValueError(
                f"DPLocalAveraging: num_shards must be a positive integer, got {num_shards!r}."
            )
        check_dp_arguments("DPLocalAveraging", clip_norm, noise_multiplier)
        self.privacy_budget = privacy.check_budget(privacy_budget, "DPLocalAveraging")
        if self.privacy_budget is not None and noise_multiplier == 0:
            raise ValueError("DPLocalAveraging: a privacy_budget needs noise_multiplier > 0.")
        self.local_update, self.num_shards = local_update, num_shards
        self.clip_norm, self.noise_multiplier = float(clip_norm), float(noise_multiplier)

    @property
    def supports_factor_families(self) -> bool:
        """Whether the wrapped update supports every family (``SiteFamilies``, ``Gamma``...):
        averaging, clipping and noising a :class:`~numpyro_pvi.families.NatParams` delta work for
        any family."""
        return self.local_update.supports_factor_families

    @property
    def sensitivity(self) -> float:
        """``2 * clip_norm / num_shards``: how far one row can move the released mean delta."""
        return 2.0 * self.clip_norm / self.num_shards

    def dp_event(self, num_rows: int, num_releases: int) -> Any:
        """The ``DpEvent`` of ``num_releases`` releases (one Gaussian mechanism each, whatever
        ``num_rows``)."""
        return privacy.gaussian_event(self.noise_multiplier, num_releases)

    def init_state(self, problem: ClientProblem) -> DPState:
        """No release yet; the wrapped update's state (which must hold no arrays)."""
        inner = self.local_update.init_state(problem)
        if jax.tree.leaves(inner):
            raise ValueError(
                f"DPLocalAveraging: the wrapped {type(self.local_update).__name__} keeps a "
                "persistent client state, which the shards cannot share; wrap an update without "
                "one."
            )
        return DPState(jnp.zeros((), jnp.int32), inner)

    def bind(self, problem: ClientProblem) -> Callable:
        """Return the pure ``client_update(rng_key, client, cavity, q, state, hyper=()) ->
        ClientResult``."""
        family, num_shards = problem.family, self.num_shards
        scaled = dataclasses.replace(
            problem,
            log_likelihood=lambda zeta, client, hyper=(): (
                num_shards * problem.log_likelihood(zeta, client, hyper)
            ),
        )
        shard_update, allowed = (
            self.local_update.bind(scaled),
            budget_gate(self, self.privacy_budget),
        )
        clip_norm, sd = self.clip_norm, self.noise_multiplier * self.sensitivity

        def client_update(
            rng_key: jax.Array,
            client: Client,
            cavity: NatParams,
            q: NatParams,
            state: DPState,
            hyper: Any = (),
        ) -> ClientResult:
            keys = jax.random.split(rng_key, num_shards + 1)
            assign_key, noise_key = jax.random.split(keys[num_shards])
            shard_of_row = jax.random.randint(assign_key, client.mask.shape, 0, num_shards)

            def run(key: jax.Array, shard: jax.Array) -> ClientResult:
                mask = client.mask & (shard_of_row == shard)
                shard_client = Client(
                    client.arrays, mask, jnp.sum(mask).astype(jnp.asarray(client.size).dtype)
                )
                return shard_update(key, shard_client, cavity, q, state.inner, hyper)

            results = jax.vmap(run)(keys[:num_shards], jnp.arange(num_shards))
            mean = jax.tree.map(lambda d: jnp.mean(d, axis=0), clip_rows(results.delta, clip_norm))
            delta = jax.tree.map(jnp.add, mean, gaussian_noise(noise_key, mean, sd))
            q_new = jax.tree.map(jnp.add, q, delta)
            # noise may leave q invalid: the server's damping may still rescue it
            valid = family.is_valid(q_new)
            safe = jax.tree.map(lambda new, old: jnp.where(valid, new, old), q_new, q)
            free_energy = jnp.where(
                valid, -kl_divergence(family.to_dist(safe), family.to_dist(cavity)), 0.0
            )
            return gated_result(
                allowed(client.size, state.releases),
                delta,
                free_energy,
                state,
                jnp.sum(results.clamped),
            )

        return client_update
