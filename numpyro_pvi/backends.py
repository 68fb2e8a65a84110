"""Backends: where the clients of a group run.

* ``"vmap"`` (default): a group's clients run in one ``jax.vmap`` under one ``jax.jit`` together with
  the gather of their (padded, masked) data and the server's merge: one compiled call per round,
  compiled once, whatever the round.
* ``"loop"``: a Python loop over clients, each a call of one jitted ``client_update``; a client that
  raises is reported as a failed (rejected) update.
* :class:`RayBackend` (``"ray"``): each client is a Ray actor that holds only its own data; the server
  sends it ``q`` and its cavity and receives its delta. Failures, time-outs and dead actors (restarted
  from the client's data) are reported as rejected updates; ``Asynchronous`` merges each client's
  update as soon as it arrives (``ray.wait``).

A backend has ``jit_group`` and ``prepare(local_update, problem, data) -> run`` where
``run(ids, keys, cavities, q, states, data, hyper=()) -> ClientResult`` (stacked over ``ids``); ``hyper``
(the hyperparameters, ``()`` if none) is shared by all clients.
Every backend hands a client the same random key, so all give the same result for the same seed.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult

# client_update(rng_key, client, cavity, q, state, hyper): q and hyper are shared, the rest is per client.
IN_AXES = (0, 0, 0, None, 0, None)


def gather(data: tuple, ids: jax.Array) -> Client:
    """The clients ``ids`` of padded ``data = (arrays, mask, sizes)``."""
    arrays, mask, sizes = data
    return Client([a[ids] for a in arrays], mask[ids], sizes[ids])


def take(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda x: x[i], tree)


def stack(trees: list) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unpad(client: Client, is_row: tuple) -> Client:
    """One client without its padding rows (a remote client computes on its own size)."""
    n = int(client.size)
    return Client([a[:n] if row else a for a, row in zip(client.arrays, is_row)], client.mask[:n], client.size)


def failed_result(cavity: Any, state: Any, hyper: Any = ()) -> ClientResult:
    """What a failed client reports: a non-finite delta, which the server rejects."""
    nan_like = lambda tree: jax.tree.map(lambda x: jnp.full(jnp.shape(x), jnp.nan, jnp.result_type(x)), tree)  # noqa: E731
    return ClientResult(nan_like(cavity), jnp.asarray(jnp.nan), state, jnp.asarray(0), nan_like(hyper))


class VmapBackend:
    """All clients of a group in one ``jax.vmap``; the whole group step is jitted.

    With several JAX devices (e.g. ``numpyro.set_host_device_count(2)`` to use 2 CPU cores), a group
    whose size divides evenly is split across them along the client axis (XLA SPMD partitioning).

    **Example:** ``pvi.PVI(..., backend="vmap")`` (the default) or ``backend=pvi.VmapBackend()``.
    """

    name = "vmap"
    jit_group = True

    def prepare(self, local_update: Any, problem: ClientProblem, data: tuple) -> Callable:
        client_update = local_update.bind(problem)
        batched = jax.vmap(client_update, in_axes=IN_AXES)
        num_devices = jax.device_count()
        mesh = jax.make_mesh((num_devices,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
        by_client = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("clients"))

        def run(ids, keys, cavities, q, states, data, hyper=()):  # noqa: ANN001, ANN202
            inputs = (keys, gather(data, ids), cavities, states)
            if len(ids) == 1:  # one client (Sequential, M = 1): unbatched, as XLA's batched matmuls are slower
                keys, client, cavity, state = take(inputs, 0)
                return stack([client_update(keys, client, cavity, q, state, hyper)])
            if num_devices > 1 and len(ids) % num_devices == 0:
                inputs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, by_client), inputs)
            keys, clients, cavities, states = inputs
            return batched(keys, clients, cavities, q, states, hyper)

        return run


class LoopBackend:
    """Clients one at a time in a Python loop over one jitted ``client_update``.

    A client that raises is reported as a rejected update; the round goes on.

    **Example:** ``pvi.PVI(..., backend="loop")`` or ``backend=pvi.LoopBackend()``.
    """

    name = "loop"
    jit_group = False

    def prepare(self, local_update: Any, problem: ClientProblem, data: tuple) -> Callable:
        single = jax.jit(local_update.bind(problem))

        def run(ids, keys, cavities, q, states, data, hyper=()):  # noqa: ANN001, ANN202
            clients, results = gather(data, ids), []
            for i in range(len(ids)):
                cavity, state = take(cavities, i), take(states, i)
                try:
                    results.append(jax.block_until_ready(single(keys[i], take(clients, i), cavity, q, state, hyper)))
                except Exception:  # noqa: BLE001 - a failing client is rejected, the run goes on
                    results.append(failed_result(cavity, state, hyper))
            return stack(results)

        return run


class RayBackend:
    """Each client is a Ray actor holding its own data; the server only sends ``q`` and cavities.

    ``ray`` is an optional dependency (``pip install numpyro-pvi[ray]``). If Ray is not running,
    ``ray.init(num_cpus=num_workers)`` is called. A client whose update raises, exceeds ``timeout``
    seconds or whose actor died is reported as a rejected update; a dead or timed-out actor is
    restarted from the client's data and the client is tried again next time.

    :param int num_workers: CPUs (concurrently running clients) for ``ray.init`` when Ray is not running yet.
    :param float timeout: seconds to wait for one client update (``None``: no limit).
    :param float cpus_per_client: the CPU share each actor reserves (several actors share a core).

    **Example:** ``pvi.PVI(..., backend=pvi.RayBackend(num_workers=2))``; ``backend.close()`` frees the
    actors' CPU shares when the inference is done.
    """

    name = "ray"
    jit_group = False

    def __init__(self, num_workers: int | None = None, timeout: float | None = None,
                 cpus_per_client: float = 0.25) -> None:
        try:
            import ray
        except ImportError as e:  # pragma: no cover - exercised only without ray
            raise ImportError("RayBackend needs Ray: pip install 'numpyro-pvi[ray]'") from e
        self.ray, self.num_workers, self.timeout, self.cpus_per_client = ray, num_workers, timeout, cpus_per_client
        self.actors: list = []

    def prepare(self, local_update: Any, problem: ClientProblem, data: tuple) -> Callable:
        ray = self.ray
        if not ray.is_initialized():
            ray.init(num_cpus=self.num_workers, include_dashboard=False, log_to_driver=False)
        actor_class = ray.remote(num_cpus=self.cpus_per_client)(ClientActor)
        clients = [unpad(jax.device_get(take(gather(data, np.arange(len(data[1]))), m)), problem.is_row)
                   for m in range(len(data[1]))]
        self._spawn = lambda m: actor_class.remote(local_update, problem, clients[m])
        self._num_clients = len(clients)
        try:
            ray.get([actor.ping.remote() for actor in self._live_actors()])
        except ray.exceptions.RayError as e:
            raise RuntimeError("A Ray client actor failed to start. Its worker process must be able to import the "
                               "model's module (define the model in __main__, or register its module with "
                               f"ray.cloudpickle.register_pickle_by_value, or set a runtime_env): {e}") from e

        def run(ids, keys, cavities, q, states, data, hyper=()):  # noqa: ANN001, ANN202
            futures = [self.submit(int(m), keys[i], take(cavities, i), q, take(states, i), hyper)
                       for i, m in enumerate(ids)]
            return stack([self.result(int(m), f, take(cavities, i), take(states, i), hyper)
                          for i, (m, f) in enumerate(zip(ids, futures))])

        return run

    def _live_actors(self) -> list:
        """The client actors, (re)started after :meth:`close`."""
        if not self.actors:
            self.actors = [self._spawn(m) for m in range(self._num_clients)]
        return self.actors

    def submit(self, m: int, key: jax.Array, cavity: Any, q: Any, state: Any, hyper: Any = ()) -> Any:
        """Start client ``m``'s update; returns a Ray object reference."""
        return self._live_actors()[m].update.remote(*jax.device_get((key, cavity, q, state, hyper)))

    def result(self, m: int, future: Any, cavity: Any, state: Any, hyper: Any = ()) -> ClientResult:
        """Client ``m``'s result, or a rejected one if it failed, timed out or its actor died."""
        ray = self.ray
        try:
            return jax.tree.map(jnp.asarray, ray.get(future, timeout=self.timeout))
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            ray.kill(self.actors[m], no_restart=True)
            self.actors[m] = self._spawn(m)  # restarted from the client's own data
        except ray.exceptions.RayError:
            pass  # the update raised: reject it, keep the actor
        return failed_result(cavity, state, hyper)

    def close(self) -> None:
        """Kill this backend's client actors: each holds its CPU share (``cpus_per_client``) until killed.

        The next update with this backend starts new actors from the clients' data.
        """
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.actors = []

    def wait_any(self, futures: dict) -> int:
        """The client whose pending update (``{client: future}``) finishes first."""
        refs = list(futures.values())
        done, _ = self.ray.wait(refs, num_returns=1, timeout=self.timeout)
        ref = done[0] if done else refs[0]  # on time-out, collect (and fail) the oldest
        return next(m for m, f in futures.items() if f is ref)


class ClientActor:
    """A Ray actor: one client's data and its jitted ``client_update`` (built in the actor's process)."""

    def __init__(self, local_update: Any, problem: ClientProblem, client: Client) -> None:
        self.client = jax.tree.map(jnp.asarray, client)
        self.client_update = jax.jit(local_update.bind(problem))

    def update(self, key: Any, cavity: Any, q: Any, state: Any, hyper: Any = ()) -> ClientResult:
        return jax.device_get(self.client_update(key, self.client, cavity, q, state, hyper))

    def ping(self) -> bool:
        return True


BACKENDS = {"vmap": VmapBackend, "loop": LoopBackend, "ray": RayBackend}


def get_backend(backend: str | object) -> object:
    """A backend instance from its name or an instance."""
    if isinstance(backend, str):
        if backend not in BACKENDS:
            raise ValueError(f"Unknown backend {backend!r}; choose one of {sorted(BACKENDS)} or pass an instance.")
        return BACKENDS[backend]()
    if not hasattr(backend, "prepare"):
        raise TypeError(f"backend must be a name {sorted(BACKENDS)} or an object with a `prepare` method, "
                        f"got {backend!r}.")
    return backend
