"""Start-up cost: a fresh process, from ``PVI(...)`` to the end of round 1 and of round 20.

Each configuration runs in its own fresh Python process (so JAX compiles everything from scratch, as
a user's script does), after the imports and the data are ready:

* ``logistic M=10`` / ``logistic M=100``: the configuration of ``benchmarks/rounds.py`` (N = 10,000,
  d = 10 + intercept, mean-field, 10 local epochs of batches of 100, 10 particles, Adam 1e-2,
  ``Synchronous``), timed from ``PVI(...)`` to the end of round 1 and of round 20 (``init``
  included). The PyTorch reference library takes about 2.1 s a round at M = 100, so about 42 s for
  20 rounds.
* ``bnn``: a 64-32-32-10 Bayesian neural network on scikit-learn's ``load_digits`` with 10
  label-skewed clients (``split_by_label``, alpha 0.5): ``PVI(...)`` and ``init`` alone.

Three start-up modes, each a fresh process: ``cold`` (JAX's defaults: everything compiled from
scratch), ``cache`` (JAX's persistent compilation cache, ``jax_compilation_cache_dir``, filled by an
earlier process: what a user's second run of a script costs) and ``O0`` (``XLA_FLAGS=
--xla_backend_optimization_level=0``: XLA compiles about 3x faster, rounds run about 3x slower;
worth it for short runs only).

    python benchmarks/startup.py            # every configuration and mode, each in a fresh process
    python benchmarks/startup.py --rounds 5 # fewer rounds
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = ["logistic-10", "logistic-100", "bnn"]
TARGETS = {"bnn": ("init", 2.0), "logistic-100": ("rounds", 2.5)}


def logistic(num_clients, num_rounds):
    import jax
    import numpyro
    import numpyro.distributions as dist
    import optax
    from jax import random

    import numpyro_pvi as pvi

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        with pvi.partition_plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)

    kx, kw, ky = random.split(random.PRNGKey(0), 3)
    X = random.normal(kx, (10_000, 10))
    y = random.bernoulli(ky, jax.nn.sigmoid(X @ random.normal(kw, (10,)) + 0.5)).astype("float32")
    jax.block_until_ready((X, y))
    steps = 10 * -(-10_000 // num_clients // 100)
    start = time.perf_counter()
    inference = pvi.PVI(
        model,
        pvi.MeanFieldGaussian(),
        pvi.split_iid(random.PRNGKey(1), 10_000, num_clients),
        pvi.GradientUpdate(optax.adam(1e-2), num_steps=steps, num_particles=10, batch_size=100),
        pvi.Synchronous(0.5 if num_clients == 10 else 0.2),
    )
    state = inference.init(random.PRNGKey(2), X, y=y)
    init = time.perf_counter() - start
    times = []
    for _ in range(num_rounds):
        state, info = inference.update(state, X, y=y)
        jax.block_until_ready(state.q)
        times.append(time.perf_counter() - start)
    return {
        "init": init,
        "round1": times[0],
        "rounds": times[-1],
        "steady": (times[-1] - times[1]) / (num_rounds - 2),
        "elbo": float(info.elbo),
    }


def bnn():
    import jax
    import numpy as np
    import numpyro
    import numpyro.distributions as dist
    import optax
    from jax import random
    from sklearn.datasets import load_digits

    import numpyro_pvi as pvi

    def model(X, y=None):
        h = X
        for i, (a, b) in enumerate([(64, 32), (32, 32), (32, 10)]):
            W = numpyro.sample(f"W{i}", dist.Normal(0.0, 1.0).expand([a, b]).to_event(2))
            c = numpyro.sample(f"b{i}", dist.Normal(0.0, 1.0).expand([b]).to_event(1))
            h = h @ W + c if i == 2 else jax.nn.relu(h @ W + c)
        with pvi.partition_plate("data", X.shape[0]):
            numpyro.sample("y", dist.Categorical(logits=h), obs=y)

    X, y = load_digits(return_X_y=True)
    X, y = (X / 16.0).astype(np.float32), y.astype(np.int32)
    parts = pvi.split_by_label(random.PRNGKey(0), y, 10, alpha=0.5)
    start = time.perf_counter()
    inference = pvi.PVI(
        model,
        pvi.MeanFieldGaussian(),
        parts,
        pvi.GradientUpdate(optax.adam(1e-2), num_steps=100, num_particles=1, batch_size=64),
        pvi.Sequential(),
    )
    state = inference.init(random.PRNGKey(1), X, y=y)
    jax.block_until_ready(state.q)
    return {"init": time.perf_counter() - start}


def child(config, num_rounds, cache):
    if cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    result = bnn() if config == "bnn" else logistic(int(config.split("-")[1]), num_rounds)
    print(json.dumps(result))


def run_child(config, num_rounds, mode, cache):
    env = dict(os.environ)
    if mode == "O0":
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
        ).strip()
    command = [sys.executable, __file__, "--child", config, "--rounds", str(num_rounds)]
    if mode == "cache":
        command += ["--cache", cache]
        # fills the cache
        subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.rounds, args.cache)
    print(
        "fresh process per configuration and mode; seconds from PVI(...) (imports and data "
        f"excluded); {args.rounds} rounds\n"
    )
    print(
        f"{'configuration':>14} {'mode':>6} {'init':>7} {'round 1':>8} "
        f"{f'{args.rounds} rounds':>10} {'s/round after':>14}  target"
    )
    for config in CONFIGS:
        for mode in ["cold", "cache", "O0"]:
            with tempfile.TemporaryDirectory() as cache:
                r = run_child(config, args.rounds, mode, cache)
            cells = [f"{r['init']:7.2f}"] + (
                [f"{r['round1']:8.2f}", f"{r['rounds']:10.2f}", f"{r['steady']:14.4f}"]
                if "round1" in r
                else ["", "", ""]
            )
            target = ""
            if config in TARGETS:
                key, limit = TARGETS[config]
                target = f"{key} < {limit} s: {'met' if r[key] < limit else 'missed'}"
            print(
                f"{config:>14} {mode:>6} "
                + " ".join(f"{c:>{w}}" for c, w in zip(cells, (7, 8, 10, 14)))
                + f"  {target}"
            )
    print(
        "\nreference: the PyTorch PVI library takes about 42 s for 20 synchronous rounds at M = 100"
    )


if __name__ == "__main__":
    main()
