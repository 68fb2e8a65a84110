"""Fake local updates (closed form, float64 checks of the server algebra and the backends) and
shared checks."""

import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import numpyro_pvi as pvi
from numpyro_pvi.families import NatParams

from models import NOISE


def assert_checkpoint_resumes(inference, result, path):
    """Save ``result``, load it back (identical state) and take one more round from both: identical
    ``q``."""
    pvi.save(result, path)
    loaded = pvi.load(path, inference.config, result.problem)
    for a, b in zip(jax.tree.leaves(result.state), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(a, b)
    resumed, _ = inference.update(loaded, result.problem)
    direct, _ = inference.update(result.state, result.problem)
    for a, b in zip(jax.tree.leaves(resumed.q), jax.tree.leaves(direct.q)):
        np.testing.assert_array_equal(a, b)


UNEQUAL = [np.arange(0, 40), np.arange(40, 130), np.arange(130, 150), np.arange(150, 300)]


# a DP-SGD update small enough to compile in seconds (10 rows a site, 10 steps of 5 rows;
# tests/flower/)
SMALL_DP_UPDATE = pvi.DPGradientUpdate(
    optax.adam(0.05), num_steps=10, batch_size=5, clip_norm=1.0, noise_multiplier=1.0
)


class ExactLinearUpdate(pvi.local_updates.LocalUpdate):
    """The exact local optimum for `linear_model`: q_new = cavity x the client's Gaussian
    likelihood."""

    def init_state(self, problem):
        return ()

    def bind(self, problem):
        def client_update(rng_key, client, cavity, q, state, hyper=()):
            X, y = client.arrays  # leaves of ((X,), {"y": y})
            Xm = X * client.mask[:, None]
            likelihood = NatParams(Xm.T @ y / NOISE**2, -0.5 * Xm.T @ X / NOISE**2)
            return pvi.local_updates.ClientResult(cavity + likelihood - q, jnp.zeros(()), state)

        return client_update


class PoisonedUpdate(ExactLinearUpdate):
    """Returns NaN for the client holding `bad_size` rows."""

    def __init__(self, bad_size):
        self.bad_size = bad_size

    def bind(self, problem):
        exact = super().bind(problem)

        def client_update(rng_key, client, cavity, q, state, hyper=()):
            result = exact(rng_key, client, cavity, q, state)
            poison = jnp.where(client.size == self.bad_size, jnp.nan, 0.0)
            return result._replace(delta=jax.tree.map(lambda d: d + poison, result.delta))

        return client_update


class FaultyUpdate(ExactLinearUpdate):
    """The client holding `size` rows raises (mode="raise") or takes `seconds` longer
    (mode="sleep")."""

    def __init__(self, size, mode, seconds=0.0):
        self.size, self.mode, self.seconds = size, mode, seconds

    def bind(self, problem):
        exact = super().bind(problem)
        size, mode, seconds = self.size, self.mode, self.seconds

        def host(n):
            if int(n) == size:
                if mode == "raise":
                    raise RuntimeError("client failure injected by the test")
                time.sleep(seconds)
            return np.float32(0.0)

        def client_update(rng_key, client, cavity, q, state, hyper=()):
            zero = jax.pure_callback(host, jax.ShapeDtypeStruct((), jnp.float32), client.size)
            result = exact(rng_key, client, cavity, q, state)
            return result._replace(free_energy=result.free_energy + zero)

        return client_update


# ---------------------------------------------------------------- a Flower deployment on 127.0.0.1

# the Flower app of docs/federated.md ("Deployment"), with the local update's steps, the rounds, the
# server's key and the checkpoint's path filled in
FLOWER_APP = {
    "pyproject.toml": """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "pvi-app"
version = "1.0.0"
dependencies = ["numpyro-pvi[flower]"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "numpyro-pvi-tests"

[tool.flwr.app.components]
serverapp = "pvi_app.server_app:app"
clientapp = "pvi_app.client_app:app"

[tool.flwr.app.config]
num-server-rounds = {num_rounds}
""",
    "pvi_app/__init__.py": "",
    "pvi_app/task.py": """\
import numpyro, numpyro.distributions as dist, optax
import numpyro_pvi as pvi


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


FAMILY = pvi.MeanFieldGaussian()
LOCAL_UPDATE = pvi.GradientUpdate(optax.adam(0.05), num_steps={num_steps}, num_particles=2)
""",
    "pvi_app/server_app.py": """\
import json

from jax import random

import numpyro_pvi as pvi
from numpyro_pvi.flower import PVIStrategy, server_app
from pvi_app.task import FAMILY

strategy = PVIStrategy(
    FAMILY, num_clients={num_clients}, rng_key=random.PRNGKey({seed}), server=pvi.Synchronous(0.5)
)
app = server_app(strategy, timeout={timeout}, checkpoint={checkpoint!r})


@app.lifespan()
def record_round_times(context):  # the tests' addition: the server's seconds per round
    yield
    with open({round_times!r}, "w") as f:
        json.dump(strategy.history.time.tolist(), f)
""",
    "pvi_app/client_app.py": """\
import numpy as np
from numpyro_pvi.flower import client_app
from pvi_app.task import FAMILY, LOCAL_UPDATE, model


def load_data(context):
    site = np.load(context.node_config["data-path"])
    return (site["X"],), {{"y": site["y"]}}


app = client_app(model, FAMILY, LOCAL_UPDATE, load_data)
""",
}


def write_flower_app(directory, sites, num_rounds, num_steps, seed, timeout=120):
    """Write :data:`FLOWER_APP` under ``directory/app`` and each site's ``(X, y)`` to
    ``directory/site<m>.npz``; returns ``(app_dir, data_paths, checkpoint_path)``. The server
    writes ``q`` to ``checkpoint_path`` and its seconds per round (``strategy.history.time``) to
    ``directory/round_times.json``."""
    from pathlib import Path

    directory = Path(directory)
    app, checkpoint = directory / "app", directory / "q.npz"
    fill = dict(
        num_rounds=num_rounds,
        num_steps=num_steps,
        num_clients=len(sites),
        seed=seed,
        timeout=timeout,
        checkpoint=str(checkpoint),
        round_times=str(directory / "round_times.json"),
    )
    for name, text in FLOWER_APP.items():
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text(text.format(**fill))
    paths = []
    for m, (X, y) in enumerate(sites):
        paths.append(directory / f"site{m}.npz")
        np.savez(paths[-1], X=np.asarray(X), y=np.asarray(y))
    return app, paths, checkpoint


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalFederation:
    """A SuperLink and one SuperNode per site on 127.0.0.1, started as ``docs/federated.md``
    says, each in its own process group; leaving the ``with`` block stops every process it
    started (SIGTERM, then SIGKILL after ``grace`` seconds).

    ``warm=True`` starts the SuperNodes with ``python -m numpyro_pvi.flower.supernode`` (the
    ClientApp warm in the SuperNode's process); ``warm=False`` with ``flower-supernode``, which
    starts a ``flwr-clientapp`` process per message (Flower's default).
    """

    def __init__(self, directory, data_paths, warm=True, grace=10.0):
        import os
        from pathlib import Path

        self.directory, self.data_paths = Path(directory), data_paths
        self.warm, self.grace, self.processes = warm, grace, []
        self.pids = []  # every process started, each the leader of its own process group
        root = str(Path(__file__).resolve().parents[1])  # this checkout's numpyro_pvi
        home = self.directory / "flwr_home"
        home.mkdir(exist_ok=True)
        self.port = _free_port()
        (home / "config.toml").write_text(
            '[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        self.env = {
            **os.environ,
            "FLWR_HOME": str(home),
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            "JAX_PLATFORMS": "cpu",
        }

    def _start(self, name, command):
        import subprocess

        log = open(self.directory / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        self.processes.append(process)
        self.pids.append(process.pid)
        return process

    def _wait_for_port(self, port, timeout=60.0):
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"Nothing listens on 127.0.0.1:{port} after {timeout} s.")

    def __enter__(self):
        import sys

        try:
            self._start(
                "superlink",
                ["flower-superlink", "--insecure", "--disable-runtime-dependency-installation"]
                + ["--port", str(self.port)],
            )
            self._wait_for_port(self.port)
            for m, path in enumerate(self.data_paths):
                port = _free_port()
                supernode = (
                    [sys.executable, "-m", "numpyro_pvi.flower.supernode"]
                    if self.warm
                    else ["flower-supernode"]
                )
                self._start(
                    f"supernode{m}",
                    [*supernode, "--insecure", "--superlink", f"127.0.0.1:{self.port}"]
                    + ["--port", str(port)]
                    + ["--node-config", f'partition-id={m} data-path="{path}"'],
                )
        except BaseException:
            self.stop()
            raise
        return self

    def run(self, app_dir, timeout=300.0):
        """``flwr run app_dir local --stream``; returns its output as ``(seconds since the start,
        line)`` pairs. Raises if it fails or outlasts ``timeout``."""
        import os
        import signal
        import subprocess
        import threading

        start, lines = time.perf_counter(), []
        process = subprocess.Popen(
            ["flwr", "run", str(app_dir), "local", "--stream"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            text=True,
        )
        self.processes.append(process)
        self.pids.append(process.pid)
        timer = threading.Timer(timeout, lambda: os.killpg(process.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in process.stdout:
                lines.append((time.perf_counter() - start, line.rstrip()))
            code = process.wait()
        finally:
            timer.cancel()
        if code != 0:
            tail = "\n".join(line for _, line in lines[-30:])
            raise RuntimeError(f"flwr run exited with {code} (after {timeout} s: killed):\n{tail}")
        return lines

    def stop(self):
        import os
        import signal

        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + self.grace
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: killed below
                pass
            try:  # the group too: what the process started (superexec, clientapps)
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        self.processes = []

    def __exit__(self, *exc):
        self.stop()


# ---------------------------------------------------------------------- one client visit
def first_client(problem):
    """Client 0's data (its slot of the problem's stacked clients)."""
    return jax.tree.map(lambda a: a[0], problem.clients)


def one_visit(model, family, update, *args, **kwargs):
    """``(key -> q_new, laid-out family)``: one client of every row (``kwargs["y"]``) visited once
    from the prior (cavity = q = prior), as in the first round of PVI with one client."""
    rows = np.arange(kwargs["y"].shape[0])
    problem = pvi.PVI(model, family, [rows], update, pvi.Sequential()).build(*args, **kwargs)
    cp, client, q = problem.client_problem, first_client(problem), problem.prior
    bound = update.bind(cp)
    return lambda key: q + bound(key, client, q, q, update.init_state(cp)).delta, problem.family


def conjugate_update():
    """DP-SGD without noise or clipping for the conjugate tests (and their spread,
    benchmarks/dp_generic.py)."""
    return pvi.DPGradientUpdate(
        optax.adam(0.05, b2=0.99),
        num_steps=3000,
        batch_size=30,
        clip_norm=1e6,
        noise_multiplier=0.0,
        num_particles=4,
    )


class NoMeanParamsGaussian(pvi.MeanFieldGaussian):
    """A mean-field Gaussian that declares no mean parameters (``mean_param_family()`` is ``None``):
    SNEP and EP's ``NUTSMoments`` must refuse it by the contract's answer, not by its class."""

    def mean_param_family(self) -> None:
        return None


LOCAL_RUNS = itertools.count(1000)  # the LocalGrids' Flower run ids


class LocalGrid:
    """Flower's ``Grid`` in this process, without Ray: node ``100 + m`` is a site (``hello`` /
    ``train``, e.g. a :class:`Site`) with ``partition-id`` ``m``, answering its messages in the
    order they were pushed when the server pulls; ``hidden`` nodes connect once the sites have
    answered ``reveal_after`` training messages; ``run_id`` shares a run (and the sites' compiled
    updates) with another grid, ``node_config(m)`` adds to site ``m``'s node config, and the
    messages ``(node, message type)`` in ``silent`` are never answered. The other
    message types (``factors="sites"``) go to
    :data:`numpyro_pvi.flower.site_factors.SITE_ACTIONS`."""

    def __init__(
        self, site, num_nodes, hidden=(), reveal_after=0, run_id=None, node_config=None, silent=()
    ):
        from flwr.app import Context, RecordDict

        self.site, self.hidden, self.reveal_after, self.answered = (
            site,
            set(hidden),
            reveal_after,
            0,
        )
        # a run of its own (unless given: the sites cache what they build per (run, node))
        run_id = next(LOCAL_RUNS) if run_id is None else run_id
        # node_config(m): more of site m's node config
        extra = (lambda m: {}) if node_config is None else node_config
        self.contexts = {
            100 + m: Context(run_id, 100 + m, {"partition-id": m, **extra(m)}, RecordDict(), {})
            for m in range(num_nodes)
        }
        self.queue, self.replies, self.pushed = [], {}, []
        self.silent = set(silent)

    def get_node_ids(self):
        if self.answered >= self.reveal_after:
            self.hidden = set()
        return [n for n in self.contexts if n not in self.hidden]

    def push_messages(self, messages):
        import uuid

        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            self.queue.append(message)
            self.pushed.append(message)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        while self.queue:
            message = self.queue.pop(0)
            context = self.contexts[message.metadata.dst_node_id]
            kind = message.metadata.message_type
            if (message.metadata.dst_node_id, kind) in self.silent:
                continue
            if kind == "query":
                reply = self.site.hello(message, context)
            elif kind == "train":
                reply = self.site.train(message, context)
                self.answered += 1
            else:  # factors="sites": the site's other exchanges
                from numpyro_pvi.flower.site_factors import SITE_ACTIONS, UPDATE

                reply = SITE_ACTIONS[kind](self.site, message, context)
                self.answered += kind == UPDATE
            if reply is not None:
                self.replies[message.metadata.message_id] = reply
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    def send_and_receive(self, messages, timeout=None):
        return self.pull_messages(self.push_messages(messages))
