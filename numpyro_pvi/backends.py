"""Backends: where the clients of a group run.

* ``"vmap"`` (default): a group's clients run in one ``jax.vmap`` under one ``jax.jit`` together with
  the gather of their (padded, masked) data and the server's merge: one compiled call per round,
  compiled once, whatever the round.
* ``"loop"``: a Python loop over clients, each a call of one jitted ``client_update``.

Both hand every client the same per-client random key, so they give the same result.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# client_update(rng_key, client, cavity, q, state): q is shared, the rest is per client.
IN_AXES = (0, 0, 0, None, 0)


class VmapBackend:
    """All clients of a group in one ``jax.vmap``; the whole group step is jitted."""

    name = "vmap"
    jit_group = True

    def map(self, client_update: Callable) -> Callable:
        return jax.vmap(client_update, in_axes=IN_AXES)


class LoopBackend:
    """Clients one at a time in a Python loop over one jitted ``client_update``."""

    name = "loop"
    jit_group = False

    def map(self, client_update: Callable) -> Callable:
        single = jax.jit(client_update)

        def looped(keys: jax.Array, clients, cavities, q, states):  # noqa: ANN001, ANN202
            take = lambda tree, m: jax.tree.map(lambda x: x[m], tree)  # noqa: E731
            outs = [single(keys[m], take(clients, m), take(cavities, m), q, take(states, m))
                    for m in range(keys.shape[0])]
            return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

        return looped


BACKENDS = {"vmap": VmapBackend, "loop": LoopBackend}


def get_backend(backend: str | object) -> object:
    """A backend instance from its name or an instance."""
    if isinstance(backend, str):
        if backend not in BACKENDS:
            raise ValueError(f"Unknown backend {backend!r}; choose one of {sorted(BACKENDS)} or pass an instance.")
        return BACKENDS[backend]()
    if not hasattr(backend, "map"):
        raise TypeError(f"backend must be a name {sorted(BACKENDS)} or an object with a `map` method, got {backend!r}.")
    return backend
