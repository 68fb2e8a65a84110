"""Backends: where the clients of a group run.

* ``"vmap"`` (default): a group's clients run in one ``jax.vmap`` under one ``jax.jit`` together
  with the gather of their (padded, masked) data and the server's merge: one compiled call per
  round.
* ``"loop"``: a Python loop over clients, each a call of one jitted ``client_update``; a client that
  raises is reported as a failed (rejected) update.
* :class:`~numpyro_pvi.ray_backend.RayBackend` (``"ray"``, :mod:`numpyro_pvi.ray_backend`): each
  client is a Ray actor that holds only its own data, and clients run truly concurrently.

The contracts are written as protocols: a :class:`Backend` ``prepare``\\ s a :data:`ClientRunner`
for a local update and a client problem (no data: the clients' data are an argument of every call);
a runner that can also run single clients in the background is a :class:`ConcurrentRunner`, which
asynchronous servers use to merge each update as it arrives. Every backend hands a client the same
random key, so all give the same result for the same seed.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult
from numpyro_pvi.state import Rejection

# client_update(rng_key, client, cavity, q, state, hyper): q and hyper are shared, the rest is per
# client.
IN_AXES = (0, 0, 0, None, 0, None)

ClientRunner = Callable[..., ClientResult]
"""``run(ids, keys, cavities, q, states, clients, hyper) -> ClientResult`` stacked over ``ids``:
clients ``ids`` of the stacked ``clients`` update from their ``cavities`` and ``states`` (stacked
over ``ids``)."""


@runtime_checkable
class Backend(Protocol):
    """Where clients run: ``prepare(local_update, problem) -> ClientRunner``.

    ``jit_group`` says whether the runner can be traced inside ``jax.jit`` with the server's merge.
    """

    jit_group: bool

    def prepare(self, local_update: Any, problem: ClientProblem) -> ClientRunner: ...


@runtime_checkable
class ConcurrentRunner(Protocol):
    """A runner whose clients also run one by one in the background (``Asynchronous`` merges as they
    arrive).

    ``submit`` starts client ``m`` and returns a handle; ``wait_any`` blocks until one of the
    handles (``{client: handle}``) is done and returns its client; ``result`` collects it (a failed
    client gives a non-finite delta, which the merge rejects); ``cancel`` abandons handles whose
    results will never be read.
    """

    def __call__(
        self,
        ids: Any,
        keys: Any,
        cavities: Any,
        q: Any,
        states: Any,
        clients: Client,
        hyper: Any = (),
    ) -> ClientResult: ...

    def submit(
        self, m: int, key: jax.Array, cavity: Any, q: Any, state: Any, hyper: Any, clients: Client
    ) -> Any: ...

    def wait_any(self, handles: dict) -> int: ...

    def result(
        self, m: int, handle: Any, cavity: Any, state: Any, hyper: Any = ()
    ) -> ClientResult: ...

    def cancel(self, handles: dict) -> None: ...


def take(tree: Any, i: int) -> Any:
    """Entry ``i`` of every leaf of ``tree``."""
    return jax.tree.map(lambda x: x[i], tree)


def stack(trees: list) -> Any:
    """Stack pytrees of the same structure along a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def failed_result(
    cavity: Any, state: Any, hyper: Any = (), failure: Rejection = Rejection.RAISED
) -> ClientResult:
    """What a failed client reports: a non-finite delta, which the server rejects, and why
    (``failure``)."""
    nan_like = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jnp.full(jnp.shape(x), jnp.nan, jnp.result_type(x)), tree
    )
    return ClientResult(
        nan_like(cavity),
        jnp.asarray(jnp.nan),
        state,
        jnp.asarray(0),
        nan_like(hyper),
        jnp.asarray(int(failure)),
    )


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


BACKENDS = {"vmap": VmapBackend, "loop": LoopBackend}


def get_backend(backend: str | Backend) -> Backend:
    """A backend instance from its name (``"vmap"``, ``"loop"``, ``"ray"``) or an instance."""
    if isinstance(backend, str):
        if backend == "ray":
            from numpyro_pvi.ray_backend import RayBackend

            return RayBackend()
        if backend not in BACKENDS:
            raise ValueError(
                f"Unknown backend {backend!r}; choose one of {sorted(BACKENDS) + ['ray']} or pass "
                "an instance."
            )
        return BACKENDS[backend]()
    if not isinstance(backend, Backend):
        raise TypeError(
            f"backend must be a name {sorted(BACKENDS) + ['ray']} or a pvi.backends.Backend (an "
            f"object with `jit_group` and `prepare(local_update, problem)`), got {backend!r}."
        )
    return backend
