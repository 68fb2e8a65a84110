"""``RayBackend``: each client is a Ray actor that holds only its own data; clients run
concurrently.

The server sends a client its cavity and ``q`` and receives its delta. A client whose update raises,
exceeds ``timeout`` seconds or whose actor died is reported as a rejected update; a dead or
timed-out actor is restarted from the client's data. The actors hold the data of the problem they
were last given: when a round runs on other data (new arrays, :meth:`PVI.add_client`) or another
problem, the live actors are given the new data and update (their processes, which have imported
JAX, are kept); only dead, timed-out or surplus actors are killed.
"""

from __future__ import annotations

import gc
import hashlib
import shutil
import tempfile
import warnings
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.backends.base import ClientRunner, failed_result, stack, take
from numpyro_pvi.compilation import enable_compilation_cache, unroll_threefry_on_cpu
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult
from numpyro_pvi.state import Rejection


def unpad(client: Client, is_row: tuple) -> Client:
    """One client without its padding rows (a remote client computes on its own size)."""
    n = int(client.size)
    return Client(
        [a[:n] if row else a for a, row in zip(client.arrays, is_row)], client.mask[:n], client.size
    )


def digest(client: Client) -> str:
    """A fingerprint of a client's data (to check which data an actor holds)."""
    h = hashlib.sha1()
    for leaf in jax.tree.leaves(client):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


class ProgramCache(NamedTuple):
    """Where a client actor keeps its compiled programs (JAX's persistent compilation cache).

    :ivar path: the directory.
    :ivar node: the Ray node whose actors use it (``None``: every actor, the directory created where
        missing: the driver's own cache, :func:`~numpyro_pvi.enable_compilation_cache`).

    **Example:** ``RayBackend().program_cache()`` in a driver without a persistent cache is
    ``ProgramCache("/tmp/numpyro_pvi_programs_...", <the driver's node id>)``.
    """

    path: str
    node: str | None = None


def shape_signature(client: Client) -> tuple:
    """The shapes and dtypes of a client's arrays: clients with the same signature compile the same
    update program.

    **Example:** ``shape_signature(client)`` for a client of 75 rows of 2 features and a float32
    response is ``(((75, 2), "<f4"), ((75,), "<f4"), ((75,), "|b1"), ((), "<i4"))`` (with its
    mask and size).
    """
    return tuple((np.shape(leaf), np.result_type(leaf).str) for leaf in jax.tree.leaves(client))


def start_ray(ray: Any, num_cpus: int | None, **init_args: Any) -> None:
    """``ray.init(num_cpus=num_cpus, **init_args)`` for this process, without the alarms Ray's start
    raises beside JAX.

    Ray starts its daemons (GCS server, raylet, monitors) with ``subprocess.Popen(...,
    preexec_fn=...)``, which runs the interpreter's fork hooks: JAX's prints "os.fork() was called
    ... will likely lead to a deadlock", though the child only sets its signals and runs another
    program (no JAX, no thread of ours in it); and Ray leaves the ``/dev/null`` handles it opened
    for them to the garbage collector (``ResourceWarning``). Neither is about this process's state,
    so both are silenced during ``ray.init`` only; the actors are started by the raylet, not forked
    from this process. So is Ray's ``FutureWarning`` "Tip: In future versions of Ray, Ray will no
    longer override accelerator visible devices ...": a notice about a future default, not about
    this run (setting ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0`` instead would let every CPU actor see
    the GPUs, and JAX in each would reserve GPU memory).

    **Example:** ``start_ray(ray, 2)`` (what ``RayBackend(num_workers=2)`` does when Ray is not
    running).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
        warnings.filterwarnings("ignore", category=ResourceWarning)
        warnings.filterwarnings("ignore", r"Tip: In future versions of Ray", FutureWarning)
        ray.init(
            **{
                "num_cpus": num_cpus,
                "include_dashboard": False,
                "log_to_driver": False,
                **init_args,
            }
        )
        # some of those handles sit in reference cycles: collected later, they would warn outside
        # this window (measured: two from the API server's start, in a second Ray session of a
        # process)
        gc.collect()


class RayBackend:
    """Each client is a Ray actor holding its own data; the server only sends ``q`` and cavities.

    ``ray`` is an optional dependency (``pip install numpyro-pvi[ray]``). If Ray is not running,
    ``ray.init(num_cpus=num_workers)`` is called. A client whose update raises, exceeds ``timeout``
    seconds or whose actor died is reported as a rejected update; a dead or timed-out actor is
    restarted from the client's data and the client is tried again next time.

    :param int num_workers: CPUs (concurrently running clients) for ``ray.init`` when Ray is not
        running yet.
    :param float timeout: seconds to wait for one client update (``None``: no limit). It does not
        count the actor's compilation: a new or restarted actor first compiles its update (ahead of
        time, within ``compile_timeout``), and only then is its update timed.
    :param float cpus_per_client: the CPU share each actor reserves (several actors share a core);
        the clients' shares must fit in the Ray cluster's CPUs (else a ``ValueError`` at the first
        round: Ray would wait for CPUs to start the actors beyond them).
    :param float compile_timeout: seconds to wait for an actor's compilation (``None``: no limit),
        its wait for another actor's compilation of the same program included.

    Each actor compiles its client's update in its own process, once per shape of its client's
    data: the first actor of a shape compiles it, and the others on the driver's node wait for it
    and load it from a directory of this backend's (a private temporary directory, removed by
    :meth:`close`), so that ten clients of one size compile one program, not ten. With JAX's
    persistent compilation cache enabled in the driver
    (:func:`~numpyro_pvi.enable_compilation_cache`) when an actor is started or given a problem (at
    the problem's first round), the actors keep their programs in that directory instead (created
    on their node if missing), so that a later run's actors load them too.

    **Example:** ``pvi.PVI(..., backend=RayBackend(num_workers=2))``; ``backend.close()`` frees
    the actors' CPU shares when the inference is done.
    """

    name = "ray"
    jit_group = False

    def __init__(
        self,
        num_workers: int | None = None,
        timeout: float | None = None,
        cpus_per_client: float = 0.25,
        compile_timeout: float | None = None,
    ) -> None:
        try:
            import ray
        except ImportError as e:  # pragma: no cover - exercised only without ray
            raise ImportError("RayBackend needs Ray: pip install 'numpyro-pvi[ray]'") from e
        self.ray, self.num_workers, self.timeout, self.cpus_per_client = (
            ray,
            num_workers,
            timeout,
            cpus_per_client,
        )
        self.compile_timeout = compile_timeout
        self.runners: list[RayRunner] = []
        self._programs: ProgramCache | None = None  # the actors' private cache, made when needed
        self._remove_programs: weakref.finalize | None = None  # removes it (close, or collection)

    def prepare(self, local_update: Any, problem: ClientProblem) -> ClientRunner:
        if not self.ray.is_initialized():
            start_ray(self.ray, self.num_workers)
        # the actors of an earlier problem are given this problem's data and update at its first
        # round: a new actor's process first imports JAX (seconds of CPU each)
        idle = [actor for runner in self.runners for actor in runner.release()]
        runner = RayRunner(self, local_update, problem, idle)
        self.runners = [runner]
        return runner

    def program_cache(self) -> ProgramCache:
        """Where the actors keep their compiled programs: the driver's persistent cache if it has
        one (every node), else this backend's private directory on the driver's node (made by
        ``tempfile.mkdtemp``: only this user can write programs there; removed by :meth:`close`).

        **Example:** ``backend.program_cache().path``, the directory an actor of the driver's node
        loads another actor's program from.
        """
        if jax.config.jax_compilation_cache_dir is not None:
            return ProgramCache(jax.config.jax_compilation_cache_dir)
        if self._programs is None:
            path = tempfile.mkdtemp(prefix="numpyro_pvi_programs_")
            self._remove_programs = weakref.finalize(self, shutil.rmtree, path, ignore_errors=True)
            self._programs = ProgramCache(path, self.ray.get_runtime_context().get_node_id())
        return self._programs

    @property
    def actors(self) -> list:
        """The client actors of the current problem (started at its first round)."""
        return self.runners[-1].actors if self.runners else []

    def close(self) -> None:
        """Kill this backend's client actors: each holds its CPU share (``cpus_per_client``) until
        killed.

        The next update with this backend starts new actors from the clients' data.
        """
        for runner in self.runners:
            runner.close()
        if self._remove_programs is not None:
            self._remove_programs()  # runs once: not again when the backend is collected
            self._programs = self._remove_programs = None


class RayRunner:
    """The client runner of :class:`RayBackend` for one client problem (a
    :class:`~numpyro_pvi.backends.ConcurrentRunner`).

    Its actors hold the clients of the last ``clients`` it was called with; other clients are loaded
    into them. ``idle``: live actors of an earlier problem, loaded with this one's clients before
    any new actor is started.
    """

    def __init__(
        self, backend: RayBackend, local_update: Any, problem: ClientProblem, idle: list = ()
    ) -> None:
        self.backend, self.ray, self.timeout = backend, backend.ray, backend.timeout
        self.actor_class = self.ray.remote(num_cpus=backend.cpus_per_client)(ClientActor)
        self.local_update, self.problem = local_update, problem
        self.clients: Client | None = None  # the data the actors hold
        self.digests: list[str] = []
        self.actors: list = []
        # client -> the reference of its actor's compilation, until it is collected
        self.compiling: dict = {}
        self.compiled: set = set()  # clients whose actor has compiled its update
        # shape signature -> the reference of the first compilation of that program
        self.first_compiles: dict = {}
        self.idle = list(idle)
        # clients with a cancelled update: their actors are not given other data. A cancelled actor
        # call can leave the actor waiting for it (measured: "Timed out waiting for seq_no ...", 30
        # s, then the actor unavailable)
        self.abandoned: set = set()

    def _spawn(self, m: int) -> Any:
        """Start an actor for client ``m`` (keeping its programs in
        :meth:`RayBackend.program_cache`)."""
        self.compiled.discard(m)
        self.abandoned.discard(m)
        return self.actor_class.remote(
            self.local_update, self.problem, self._own(m), self.backend.program_cache()
        )

    def _load(self, actor: Any, m: int) -> Any:
        """Give a live actor client ``m``'s data and update; returns the reference to wait for."""
        self.compiled.discard(m)
        cache = self.backend.program_cache()
        return actor.load.remote(self.local_update, self.problem, self._own(m), cache)

    def _own(self, m: int) -> Client:
        return unpad(jax.device_get(take(self.clients, m)), self.problem.is_row)

    def sync(self, clients: Client) -> None:
        """Make the actors hold ``clients`` (start them, or give those whose data changed the new
        data)."""
        if clients is self.clients and self.actors:
            return
        num_actors = int(np.sum(np.asarray(clients.size) > 0))
        self._check_cpus(num_actors)
        self.clients = clients
        digests = [digest(self._own(m)) for m in range(num_actors)]
        started = []  # the references to wait for: new actors' pings and live actors' loads
        for m, old in enumerate(self.digests[: len(digests)]):
            if old != digests[m] and m in self.abandoned:
                self.ray.kill(self.actors[m], no_restart=True)
                self.actors[m] = self._spawn(m)
                started.append(self.actors[m].ping.remote())
            elif old != digests[m]:
                started.append(self._load(self.actors[m], m))
        for m in range(len(digests), len(self.actors)):
            self.ray.kill(self.actors[m], no_restart=True)
        self.actors = self.actors[: len(digests)]
        for m in range(len(self.actors), len(digests)):
            if self.idle:
                self.actors.append(self.idle.pop(0))
                started.append(self._load(self.actors[m], m))
            else:
                self.actors.append(self._spawn(m))
                started.append(self.actors[m].ping.remote())
        for actor in self.idle:  # more than this problem's clients
            self.ray.kill(actor, no_restart=True)
        self.idle, self.digests = [], digests
        try:
            # a load that failed (its arguments could not be unpickled) would leave the last
            # problem's update
            self.ray.get(started)
        except self.ray.exceptions.RayError as e:
            raise RuntimeError(
                "A Ray client actor failed to start. Its worker process must be able to import "
                "the model's module (define the model in __main__, or register its module with "
                f"ray.cloudpickle.register_pickle_by_value, or set a runtime_env): {e}"
            ) from e

    def _check_cpus(self, num_actors: int) -> None:
        """Name CPU shares the cluster cannot hold: Ray would wait, without a word, for CPUs to
        start the actors beyond them."""
        share = self.backend.cpus_per_client
        cpus = self.ray.cluster_resources().get("CPU", 0.0)
        if num_actors * share > cpus + 1e-9:
            raise ValueError(
                f"RayBackend: {num_actors} client actors of cpus_per_client={share} need "
                f"{num_actors * share:g} CPUs, but the Ray cluster has {cpus:g}: Ray would wait "
                f"for CPUs to start the others. Pass RayBackend(cpus_per_client="
                f"{cpus / num_actors:.3g}) or less (actors then share the cores), or start Ray "
                "with more CPUs (nodes) first."
            )

    def __call__(
        self,
        ids: Any,
        keys: Any,
        cavities: Any,
        q: Any,
        states: Any,
        clients: Client,
        hyper: Any = (),
    ) -> ClientResult:
        handles = [
            self.submit(int(m), keys[i], take(cavities, i), q, take(states, i), hyper, clients)
            for i, m in enumerate(ids)
        ]
        return stack(
            [
                self.result(int(m), h, take(cavities, i), take(states, i), hyper)
                for i, (m, h) in enumerate(zip(ids, handles))
            ]
        )

    def submit(
        self, m: int, key: jax.Array, cavity: Any, q: Any, state: Any, hyper: Any, clients: Client
    ) -> Any:
        """Start client ``m``'s update (after compiling it, if its actor has not yet); returns a Ray
        object reference.

        An actor runs its calls in order, so the update starts when the compilation ends. The first
        actor of a shape of data compiles; the others' compilations wait for it
        (:meth:`ClientActor.compile`), to load its program from the actors' cache.
        """
        self.sync(clients)
        inputs = jax.device_get((key, cavity, q, state, hyper))
        if m not in self.compiled:
            signature = shape_signature(self._own(m))
            first = self.first_compiles.get(signature)
            after = None if first is None else [first]
            self.compiling[m] = self.actors[m].compile.remote(*inputs, after=after)
            self.first_compiles.setdefault(signature, self.compiling[m])
            self.compiled.add(m)
        return self.actors[m].update.remote(*inputs)

    def result(self, m: int, handle: Any, cavity: Any, state: Any, hyper: Any = ()) -> ClientResult:
        """Client ``m``'s result, or a rejected one if it failed, timed out or its actor died."""
        ray = self.ray
        try:
            # the compilation is not timed by `timeout`, only by `compile_timeout`
            if m in self.compiling:
                ray.get(self.compiling.pop(m), timeout=self.backend.compile_timeout)
            return jax.tree.map(jnp.asarray, ray.get(handle, timeout=self.timeout))
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            ray.kill(self.actors[m], no_restart=True)
            self.actors[m] = self._spawn(m)  # restarted from the client's own data
            return failed_result(cavity, state, hyper, Rejection.TIMEOUT)
        except ray.exceptions.RayError:
            pass  # the update raised: reject it, keep the actor
        return failed_result(cavity, state, hyper, Rejection.RAISED)

    def wait_any(self, handles: dict) -> int:
        """The client whose pending update (``{client: handle}``) finishes first."""
        refs = list(handles.values())
        compiling = [self.compiling[m] for m in handles if m in self.compiling]
        if compiling:  # actors still compiling: their time does not count against `timeout`
            self.ray.wait(
                compiling, num_returns=len(compiling), timeout=self.backend.compile_timeout
            )
        done, _ = self.ray.wait(refs, num_returns=1, timeout=self.timeout)
        ref = done[0] if done else refs[0]  # on time-out, collect (and fail) the oldest
        return next(m for m, h in handles.items() if h is ref)

    def cancel(self, handles: dict) -> None:
        """Abandon pending updates: their results are never read (a running one finishes on its
        actor)."""
        for m, handle in handles.items():
            self.abandoned.add(m)
            try:
                self.ray.cancel(handle)
            except Exception:  # noqa: BLE001 - cancelling is best effort; the result is dropped either way
                pass

    def held_digests(self) -> list[str]:
        """What each actor holds (:func:`digest` of its data), asked of the actors themselves."""
        return self.ray.get([actor.digest.remote() for actor in self.actors])

    def release(self) -> list:
        """Hand over the live actors (to the runner of another problem) and hold none.

        The actors of clients with a cancelled update are killed instead.
        """
        actors = self.idle
        for m, actor in enumerate(self.actors):
            if m in self.abandoned:
                self.ray.kill(actor, no_restart=True)
            else:
                actors.append(actor)
        self.actors, self.idle, self.digests, self.clients = [], [], [], None
        self.compiling, self.compiled, self.abandoned = {}, set(), set()
        self.first_compiles = {}
        return actors

    def close(self) -> None:
        for actor in self.release():
            self.ray.kill(actor, no_restart=True)


class ClientActor:
    """A Ray actor: one client's data and its jitted ``client_update`` (built in the actor's
    process)."""

    def __init__(
        self,
        local_update: Any,
        problem: ClientProblem,
        client: Client,
        cache: ProgramCache | None = None,
    ) -> None:
        self.load(local_update, problem, client, cache)

    def load(
        self,
        local_update: Any,
        problem: ClientProblem,
        client: Client,
        cache: ProgramCache | None = None,
    ) -> bool:
        """Hold ``client`` and its update for ``problem`` instead (the process, with JAX imported,
        is kept); keep compiled programs in ``cache`` (:meth:`RayBackend.program_cache`) if it is
        for every node or for this actor's."""
        import ray

        # whether this actor loads other actors' programs (from a cache of its node)
        self.shares_programs = cache is not None and cache.node in (
            None,
            ray.get_runtime_context().get_node_id(),
        )
        if self.shares_programs:
            enable_compilation_cache(cache.path)
        # the driver's Threefry lowering (registered where the driver built its steps): the same
        # draws, compiled in a fraction of the time and run faster
        unroll_threefry_on_cpu()
        self.client = jax.tree.map(jnp.asarray, client)
        self.client_update = jax.jit(local_update.bind(problem))
        return True

    def compile(
        self,
        key: Any,
        cavity: Any,
        q: Any,
        state: Any,
        hyper: Any = (),
        after: list | None = None,
    ) -> bool:
        """Compile the update for inputs like these, ahead of time (nothing runs), once the
        compilations ``after`` (references, in a list: whether they succeed does not matter) have
        ended: another actor's compilation of the same program, which this one then loads from the
        actors' cache (an actor that uses no cache of its node does not wait)."""
        import ray

        if after and self.shares_programs:
            ray.wait(after, num_returns=len(after))
        self.client_update.lower(key, self.client, cavity, q, state, hyper).compile()
        return True

    def update(self, key: Any, cavity: Any, q: Any, state: Any, hyper: Any = ()) -> ClientResult:
        return jax.device_get(self.client_update(key, self.client, cavity, q, state, hyper))

    def digest(self) -> str:
        return digest(self.client)

    def ping(self) -> bool:
        return True
