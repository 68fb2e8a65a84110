"""The in-process backends: ``"vmap"`` (:class:`VmapBackend`) and ``"loop"``
(:class:`LoopBackend`)."""

from __future__ import annotations

from typing import Any

import jax

# client_update(rng_key, client, cavity, q, state, hyper): q and hyper are shared, the rest is per
# client.
from numpyro_pvi.backends.base import IN_AXES, ClientRunner, failed_result, stack, take
from numpyro_pvi.local_updates.base import ClientProblem


class VmapBackend:
    """All clients of a group in one ``jax.vmap``; the whole group step is jitted.

    With several JAX devices (e.g. ``numpyro.set_host_device_count(2)`` to use 2 CPU cores), a group
    whose size divides evenly is split across them along the client axis (XLA SPMD partitioning).

    **Example:** ``pvi.PVI(..., backend="vmap")`` (the default) or
    ``backend=pvi.backends.VmapBackend()``.
    """

    name = "vmap"
    jit_group = True

    def prepare(self, local_update: Any, problem: ClientProblem) -> ClientRunner:
        client_update = local_update.bind(problem)
        batched = jax.vmap(client_update, in_axes=IN_AXES)
        num_devices = jax.device_count()
        mesh = jax.make_mesh((num_devices,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
        by_client = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("clients"))

        def run(ids, keys, cavities, q, states, clients, hyper=()):  # noqa: ANN001, ANN202
            inputs = (keys, take(clients, ids), cavities, states)
            # one client (Sequential, M = 1): unbatched, as XLA's batched matmuls are slower
            if len(ids) == 1:
                keys, client, cavity, state = take(inputs, 0)
                return stack([client_update(keys, client, cavity, q, state, hyper)])
            if num_devices > 1 and len(ids) % num_devices == 0:
                inputs = jax.tree.map(
                    lambda x: jax.lax.with_sharding_constraint(x, by_client), inputs
                )
            keys, group, cavities, states = inputs
            return batched(keys, group, cavities, q, states, hyper)

        return run


class LoopBackend:
    """Clients one at a time in a Python loop over one jitted ``client_update``.

    A client that raises is reported as a rejected update; the round goes on.

    **Example:** ``pvi.PVI(..., backend="loop")`` or ``backend=pvi.backends.LoopBackend()``.
    """

    name = "loop"
    jit_group = False

    def prepare(self, local_update: Any, problem: ClientProblem) -> ClientRunner:
        single = jax.jit(local_update.bind(problem))

        def run(ids, keys, cavities, q, states, clients, hyper=()):  # noqa: ANN001, ANN202
            results = []
            for i, m in enumerate(ids):
                cavity, state = take(cavities, i), take(states, i)
                try:
                    results.append(
                        jax.block_until_ready(
                            single(keys[i], take(clients, m), cavity, q, state, hyper)
                        )
                    )
                except Exception:  # noqa: BLE001 - a failing client is rejected, the run goes on
                    results.append(failed_result(cavity, state, hyper))
            return stack(results)

        return run
