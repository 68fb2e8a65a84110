"""A Flower deployment on 127.0.0.1: where a round's seconds go, and seconds per round with
``flower-supernode`` (a fresh ``flwr-clientapp`` process per message) and with
``python -m numpyro_pvi.flower.supernode`` (the ClientApp warm in the SuperNode's process), beside
the same app's round in Flower's simulation engine.

Starts ``flower-superlink`` and two SuperNodes on free ports (tests/fakes.py's
``LocalFederation``: the commands of docs/federated.md), writes the app of docs/federated.md
("Deployment": logistic regression, mean-field, ``GradientUpdate`` with ``--steps`` Adam steps, 2
sites of 100 rows) and each site's ``.npz`` in a temporary directory, runs ``flwr run`` for
``--rounds`` rounds and stops every process it started. Prints the server's seconds per round
(``strategy.history.time``: from sending the sites their cavities to merging their replies) and the
largest difference between the deployed ``q`` and the in-process run's (same seeds).

``--breakdown`` times, in a fresh process, what ``flwr-clientapp`` does for every message:
interpreter start, imports, loading the site's data and building its problem, tracing and compiling
its update, and the update itself.

    PYTHONPATH=. python benchmarks/flower_deploy.py          # everything, 3 rounds
    PYTHONPATH=. python benchmarks/flower_deploy.py --mode warm --rounds 6 --no-simulation
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import numpyro_pvi as pvi  # noqa: E402

from fakes import LocalFederation, write_flower_app  # noqa: E402
from models import make_logistic_data  # noqa: E402

SEED = 0

# what a fresh flwr-clientapp process does for a message, timed step by step
BREAKDOWN = """
import json, sys, time
start = time.perf_counter()
marks = {}
def mark(name):
    marks[name] = time.perf_counter() - start - sum(marks.values())
import flwr.supernode.runtime.run_clientapp
from flwr.app import Context, RecordDict
mark("import flwr (flwr-clientapp)")
import jax
mark("import jax")
import numpyro
mark("import numpyro")
import numpyro_pvi.flower
mark("import numpyro_pvi.flower")
sys.path.insert(0, sys.argv[1])
from pvi_app.client_app import app, FAMILY, LOCAL_UPDATE, model, load_data
mark("import the app")
from numpyro_pvi.flower import Site
site = Site(model, FAMILY, LOCAL_UPDATE, load_data)
context = Context(1, 1, {"partition-id": 0, "data-path": sys.argv[2]}, RecordDict(), {})
prep = site.prepare(context)
mark("load data, build the site's problem")
from numpyro_pvi.flower.client import _INFERENCES
q = _INFERENCES[1].init(jax.random.PRNGKey(0), prep.problem).q
state = LOCAL_UPDATE.init_state(prep.problem.client_problem)
key = jax.random.PRNGKey(1)
jax.block_until_ready(prep.update(key, prep.client, q, q, state, ()))
mark("first update (trace, compile, run)")
jax.block_until_ready(prep.update(key, prep.client, q, q, state, ()))
mark("the update, compiled")
print(json.dumps(marks))
"""


def sites():
    X, y = make_logistic_data()
    return [(X[:100], y[:100]), (X[100:200], y[100:200])]


def in_process(rounds, steps):
    """The app's run in process (vmap backend, same key and damping)."""
    import optax

    X, y = make_logistic_data()
    from models import logistic_model

    parts = [np.arange(0, 100), np.arange(100, 200)]
    inference = pvi.PVI(
        logistic_model,
        pvi.MeanFieldGaussian(),
        parts,
        pvi.GradientUpdate(optax.adam(0.05), num_steps=steps, num_particles=2),
        pvi.Synchronous(0.5),
        backend="vmap",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)
        return inference.run(
            jax.random.PRNGKey(SEED), rounds, X[:200], y=y[:200], progress_bar=False
        )


def deploy(mode, rounds, steps):
    with tempfile.TemporaryDirectory() as directory:
        app, paths, checkpoint = write_flower_app(directory, sites(), rounds, steps, seed=SEED)
        start = time.perf_counter()
        with LocalFederation(directory, paths, warm=mode == "warm") as federation:
            federation.run(app)
        whole = time.perf_counter() - start
        with open(os.path.join(directory, "round_times.json")) as f:
            times = json.load(f)
        return times, whole, pvi.load(checkpoint).q


def simulate(rounds, steps):
    """The same app's ServerApp and sites (data from memory) in Flower's simulation engine."""
    import ray.cloudpickle

    from numpyro_pvi.flower import client_app, run_simulation, server_app

    data = sites()
    with tempfile.TemporaryDirectory() as directory:
        app, _, _ = write_flower_app(directory, data, rounds, steps, seed=SEED)
        sys.path.insert(0, str(app))
        import pvi_app.server_app as server
        import pvi_app.task as task

        def load_data(context):
            X, y = data[int(context.node_config["partition-id"])]
            return (np.asarray(X),), {"y": np.asarray(y)}

        ray.cloudpickle.register_pickle_by_value(task)
        run_simulation(
            server_app(server.strategy, num_rounds=rounds),
            client_app(task.model, task.FAMILY, task.LOCAL_UPDATE, load_data),
            num_supernodes=2,
            backend_config={"init_args": {"num_cpus": 2}, "client_resources": {"num_cpus": 1}},
        )
        return server.strategy.history.time.tolist()


def breakdown(steps):
    with tempfile.TemporaryDirectory() as directory:
        app, paths, _ = write_flower_app(directory, sites(), 1, steps, seed=SEED)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        marks = {"interpreter start": time.perf_counter() - start}
        out = subprocess.run(
            [sys.executable, "-c", BREAKDOWN, str(app), str(paths[0])],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        ).stdout
        marks.update(json.loads(out.splitlines()[-1]))
    for name, seconds in marks.items():
        print(f"  {name:40s} {seconds:6.2f} s")
    print(f"  {'total':40s} {sum(marks.values()):6.2f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--mode", choices=["cold", "warm", "both"], default="both")
    parser.add_argument("--breakdown", action="store_true", help="only the fresh-process timings")
    parser.add_argument("--no-simulation", action="store_true")
    args = parser.parse_args()
    print(f"load average: {os.getloadavg()}, {os.cpu_count()} CPUs")
    if args.breakdown:
        print("A fresh flwr-clientapp process, step by step (one site, one message):")
        breakdown(args.steps)
        return
    reference = in_process(args.rounds, args.steps).state.q
    for mode in ["cold", "warm"] if args.mode == "both" else [args.mode]:
        times, whole, q = deploy(mode, args.rounds, args.steps)
        how = "numpyro_pvi.flower.supernode" if mode == "warm" else "flower-supernode"
        difference = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(reference))
        )
        print(
            f"deployment ({how}): s/round {np.round(times, 2).tolist()}; whole run with "
            f"start-up {whole:.1f} s; largest |q - q_in_process| {difference:.2g}"
        )
    if not args.no_simulation:
        times = simulate(args.rounds, args.steps)
        print(f"simulation engine (same app): s/round {np.round(times, 2).tolist()}")


if __name__ == "__main__":
    main()
