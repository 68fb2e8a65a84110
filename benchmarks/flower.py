"""PVI over Flower's simulation engine vs in process: seconds per round and bytes on the wire.

The set-up of ``tests/test_flower.py`` (4 sites, a regression with a local intercept per group,
mean-field, ``GradientUpdate`` with 30 Adam steps), run for ``--rounds`` synchronous and then
sequential rounds in one Flower simulation (one Ray actor holds the 4 virtual sites), and the same
rounds in process with the ``vmap`` backend. Prints each run's per-round seconds (the first round
includes compilation), the bytes each round sent down and up, and the largest difference between the
Flower and the in-process ``q``.

    python benchmarks/flower.py              # 3 rounds
    python benchmarks/flower.py --rounds 10
"""

import argparse
import os
import sys
import time
import warnings

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import ray.cloudpickle  # noqa: E402
import test_flower as setup  # noqa: E402

import numpyro_pvi as pvi  # noqa: E402


def largest_difference(a, b):
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves((a.q, a.factors)), jax.tree.leaves((b.q, b.factors)))
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    setup.NUM_ROUNDS = rounds
    ray.cloudpickle.register_pickle_by_value(setup)  # the Ray workers cannot import the test module
    start = time.perf_counter()
    strategies = setup.run_flower()
    simulation = time.perf_counter() - start
    print(
        f"Flower simulation, whole run (Ray start-up, sites, {rounds} + {rounds} rounds): "
        f"{simulation:.1f} s"
    )
    for name, server, seed in (
        ("sync", pvi.Synchronous(setup.DAMPING), 2),
        ("seq", pvi.Sequential(), 4),
    ):
        strategy = strategies[name]
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pvi.PVIWarning)
            (reference,) = setup._in_process(seed, server=server)
        in_process = time.perf_counter() - start
        print(f"\n{name}: Flower s/round {np.round(strategy.history.time, 3).tolist()}")
        print(
            f"{name}: in process s/round {np.round(reference.history.time, 3).tolist()} (whole "
            f"run with compilation {in_process:.1f} s)"
        )
        print(f"{name}: bytes per round (down, up): {strategy.traffic}")
        difference = largest_difference(strategy.state, reference.state)
        print(f"{name}: largest |q_flower - q_vmap| over q and the factors: {difference:.3g}")


if __name__ == "__main__":
    main()
