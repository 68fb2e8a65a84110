"""PVI over Flower's simulation engine vs in process: seconds per round and bytes on the wire.

The set-up of ``tests/flower/test_flower.py`` (its model and data from ``tests/models.py``: 4
sites, a
regression with a local intercept per group, mean-field, ``GradientUpdate`` with 30 Adam steps),
run for ``--rounds`` synchronous and then sequential rounds in one Flower simulation (one Ray actor
holds the 4 virtual sites), and the same rounds in process with the ``vmap`` backend. Prints each
run's per-round seconds (the first round includes compilation), the bytes each round sent down and
up, and the largest difference between the Flower and the in-process ``q``.

    python benchmarks/flower.py              # 3 rounds
    python benchmarks/flower.py --rounds 10
"""

import argparse
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
from jax import random

import numpyro_pvi as pvi

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import ray.cloudpickle  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402

from numpyro_pvi.flower import PVIStrategy, client_app, run_simulation  # noqa: E402

import models  # noqa: E402

DAMPING = 0.5
LOCAL = pvi.GradientUpdate(optax.adam(0.05), num_steps=30, num_particles=2)
SERVERS = {"sync": (lambda: pvi.Synchronous(DAMPING), 2), "seq": (pvi.Sequential, 4)}


def run_flower(rounds):
    """One Flower simulation of ``models.FLOWER_SITES`` virtual sites, each loading only its own
    groups: the synchronous strategy's ``rounds`` rounds, then the sequential one's."""
    X, y, parts = models.make_flower_data()
    site_data = [(np.asarray(X[p]), np.asarray(y[p])) for p in parts]

    def load_data(context):
        Xm, ym = site_data[int(context.node_config["partition-id"])]
        return (Xm,), {"y": ym}

    strategies = {
        name: PVIStrategy(
            pvi.MeanFieldGaussian(), models.FLOWER_SITES, random.PRNGKey(seed), server()
        )
        for name, (server, seed) in SERVERS.items()
    }
    app = ServerApp()

    @app.main()
    def main(grid, context):
        for strategy in strategies.values():
            strategy.start(grid, num_rounds=rounds, timeout=600)

    run_simulation(
        app,
        client_app(models.intercept_model, pvi.MeanFieldGaussian(), LOCAL, load_data),
        num_supernodes=models.FLOWER_SITES,
        backend_config={"init_args": {"num_cpus": 1}, "client_resources": {"num_cpus": 1}},
    )
    return strategies


def in_process(rounds, server, seed):
    """The same rounds in process (the ``vmap`` backend)."""
    X, y, parts = models.make_flower_data()
    inference = pvi.PVI(models.intercept_model, pvi.MeanFieldGaussian(), parts, LOCAL, server)
    return inference.run(random.PRNGKey(seed), rounds, X, y=y, progress_bar=False)


def largest_difference(a, b):
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves((a.q, a.factors)), jax.tree.leaves((b.q, b.factors)))
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    # the Ray workers cannot import the tests' model module: ship it by value
    ray.cloudpickle.register_pickle_by_value(models)
    start = time.perf_counter()
    strategies = run_flower(rounds)
    simulation = time.perf_counter() - start
    print(
        f"Flower simulation, whole run (Ray start-up, sites, {rounds} + {rounds} rounds): "
        f"{simulation:.1f} s"
    )
    for name, (server, seed) in SERVERS.items():
        strategy = strategies[name]
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pvi.PVIWarning)
            reference = in_process(rounds, server(), seed)
        in_process_seconds = time.perf_counter() - start
        print(f"\n{name}: Flower s/round {np.round(strategy.history.time, 3).tolist()}")
        print(
            f"{name}: in process s/round {np.round(reference.history.time, 3).tolist()} (whole "
            f"run with compilation {in_process_seconds:.1f} s)"
        )
        print(f"{name}: bytes per round (down, up): {strategy.traffic}")
        difference = largest_difference(strategy.state, reference.state)
        print(f"{name}: largest |q_flower - q_vmap| over q and the factors: {difference:.3g}")


if __name__ == "__main__":
    main()
