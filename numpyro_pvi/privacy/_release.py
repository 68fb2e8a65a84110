"""What the DP updates share: the release count in the client's state (:class:`DPState`,
:class:`CountsReleases`), the argument checks, the Gaussian noise and the budget gate.

:class:`~numpyro_pvi.DPGradientUpdate` and :class:`~numpyro_pvi.DPLocalAveraging` both release one
update per client visit and count it, merged or not, towards the client's budget.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.families import NatParams
from numpyro_pvi.local_updates.base import ClientResult
from numpyro_pvi.privacy import accounting as privacy
from numpyro_pvi.state import Rejection


class DPState(NamedTuple):
    """A DP client's persistent state: ``releases``, how many updates it has released so far (merged
    or not).

    **Example:** ``int(result.state.client_states.releases[m])``.
    """

    releases: jax.Array
    inner: Any = ()


class CountsReleases:
    """The release count of a DP update whose client state is a :class:`DPState`: the
    :class:`~numpyro_pvi.privacy.PrivateUpdate` ``num_releases`` and the ``rejected_state`` of
    :class:`~numpyro_pvi.local_updates.CountsRejectedUpdates`, written once for every DP update.

    **Example:** ``class DPLocalAveraging(CountsReleases, LocalUpdate): ...``;
    ``update.num_releases(result.state.client_states)``.
    """

    def rejected_state(self, old: DPState, new: DPState) -> DPState:
        """A release the server rejected still counts towards the budget (it was sent)."""
        return old._replace(releases=new.releases)

    def num_releases(self, client_states: DPState) -> jax.Array:
        """``(M,)`` each client's releases so far: the count its budget gate reads
        (``privacy_spent`` too)."""
        return client_states.releases


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
