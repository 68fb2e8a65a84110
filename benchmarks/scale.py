"""Federated at scale: seconds per round and peak memory for many clients, skewed sizes, full rank,
sampling.

Bayesian logistic regression (no intercept), N = 100 rows per client on average, ``GradientUpdate``
with Adam (1e-2), 10 steps of 1 particle on all of a client's rows, ``Synchronous(0.5)``, a
16-particle ELBO per round. Each configuration runs in its own subprocess, so its peak resident
memory (``ru_maxrss``) is its own; start-up (building the problem, ``init`` and the first round,
which compiles) is reported apart from the steady rounds (the mean of ``--rounds`` rounds after it).

* sizes ``iid``: every client 100 rows; ``dirichlet``: client shares ~ Dirichlet(0.3) (at least one
  row each); ``one90``: one client holds 90 % of the rows, the others share the rest evenly.
* ``mf``: mean-field, d = 10, M = 100, 1,000, 10,000 (N up to 1,000,000); ``fr``: full rank, d =
  200, M = 100 and 1,000; ``K=10``: 10 of M = 1,000 clients per round.
* ``-epochs``: ``GradientUpdate(num_epochs=10, batch_size=100)`` in place of 10 full-batch steps: a
  client of ``n`` rows takes ``ceil(10 n / min(100, n))`` steps of ``min(100, n)`` rows, so an iid
  client (100 rows) does the same work as before and the total work is again 10 passes over every
  row; clients of a bucket run to the bucket's largest count, masked after their own. *masked %* is
  the share of the step-rows run that are masked (a client's steps past its own count), ``-`` for
  fixed steps.

* ``--million``: ``mf-few-M-K1000``, M = 10,000, 100,000 and 1,000,000 clients of 1 to 50 rows
  (shares ~ Dirichlet(0.3) of 24 M rows, one row added to each, clipped at 50: about 16 rows on
  average), d = 10, ``Synchronous(0.5, clients_per_round=1000)``, 10 full-batch steps, the round's
  ELBO over a fixed sample of 10,000 clients (``PVI(num_elbo_clients=10_000)``). Printed: building
  the problem, ``init``, the first round (compiles), the median and slowest of the later rounds
  (a round whose draw puts a bucket's count past a power of two compiles once more), peak RSS.

    python benchmarks/scale.py              # all configurations (several minutes)
    python benchmarks/scale.py --quick      # M <= 1,000 only
    python benchmarks/scale.py --million --rounds 6   # the million-client sweep
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings

import numpy as np

ROWS_PER_CLIENT = 100
EPOCHS, BATCH = 10, 100  # the -epochs configurations' schedule
CONFIGS = {  # name: (family, d, M, sizes, clients per round, steps: "fixed" or "epochs")
    **{
        f"mf-{sizes}-{m}": ("mf", 10, m, sizes, None, "fixed")
        for m in (100, 1000, 10000)
        for sizes in ("iid", "dirichlet", "one90")
    },
    "fr-iid-100": ("fr", 200, 100, "iid", None, "fixed"),
    "fr-iid-1000": ("fr", 200, 1000, "iid", None, "fixed"),
    "mf-iid-1000-K10": ("mf", 10, 1000, "iid", 10, "fixed"),
    **{
        f"mf-{sizes}-{m}-epochs": ("mf", 10, m, sizes, None, "epochs")
        for m in (1000, 10000)
        for sizes in ("iid", "dirichlet")
    },
}
MILLION = {f"mf-few-{m}-K1000": ("mf", 10, m, "few", 1000, "fixed") for m in (10**4, 10**5, 10**6)}
CONFIGS.update(MILLION)
FEW_ROWS, FEW_MAX, ELBO_CLIENTS = 24, 50, 10_000  # the million sweep's sizes and ELBO sample


def masked_share(update, buckets) -> float:
    """The share of a round's step-rows (steps x rows per step) that are masked, over the size
    buckets."""
    run = used = 0
    for bucket in buckets:
        sizes = [int(n) for n in np.asarray(bucket.clients.size)]
        padded = int(bucket.clients.mask.shape[1])
        run += len(sizes) * int(update.steps_for(padded)) * min(BATCH, padded)
        used += sum(int(update.steps_for(n)) * min(BATCH, n) for n in sizes)
    return 1.0 - used / run


def client_sizes(kind: str, num_clients: int, seed: int = 0) -> np.ndarray:
    """Rows per client: ``iid``, ``dirichlet`` (shares ~ Dirichlet(0.3), at least 1 row) or
    ``one90``."""
    total = ROWS_PER_CLIENT * num_clients
    if kind == "iid":
        return np.full(num_clients, ROWS_PER_CLIENT)
    if kind == "few":
        rng = np.random.default_rng(seed)
        shares = rng.dirichlet(np.full(num_clients, 0.3))
        return np.minimum(FEW_MAX, 1 + rng.multinomial(FEW_ROWS * num_clients, shares))
    if kind == "dirichlet":
        rng = np.random.default_rng(seed)
        shares = rng.dirichlet(np.full(num_clients, 0.3))
        return 1 + rng.multinomial(total - num_clients, shares)
    big = int(0.9 * total)
    return np.array(
        [big] + [len(a) for a in np.array_split(np.arange(total - big), num_clients - 1)]
    )


def run_one(name: str, rounds: int) -> dict:
    """Time one configuration in this process; returns its figures."""
    import jax
    import numpyro
    import numpyro.distributions as dist
    import optax
    from jax import random

    import numpyro_pvi as pvi

    family_name, dim, num_clients, kind, per_round, schedule = CONFIGS[name]

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with pvi.partition_plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    sizes = client_sizes(kind, num_clients)
    total = int(sizes.sum())
    kx, kw, ky = random.split(random.PRNGKey(0), 3)
    X = random.normal(kx, (total, dim)) / np.sqrt(dim)
    y = random.bernoulli(ky, jax.nn.sigmoid(X @ random.normal(kw, (dim,)))).astype(X.dtype)
    parts = np.split(np.random.default_rng(1).permutation(total), np.cumsum(sizes)[:-1])
    jax.block_until_ready((X, y))
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    family = pvi.MeanFieldGaussian() if family_name == "mf" else pvi.FullRankGaussian()
    update = (
        pvi.GradientUpdate(optax.adam(1e-2), num_steps=10, num_particles=1)
        if schedule == "fixed"
        else pvi.GradientUpdate(
            optax.adam(1e-2), num_epochs=EPOCHS, batch_size=BATCH, num_particles=1
        )
    )
    server = pvi.Synchronous(0.5, clients_per_round=per_round)
    inference = pvi.PVI(
        model,
        family,
        parts,
        update,
        server,
        num_elbo_particles=16,
        num_elbo_clients=ELBO_CLIENTS if kind == "few" else None,
    )
    start = time.perf_counter()
    problem = inference.build(X, y=y)
    built = time.perf_counter()
    state = jax.block_until_ready(inference.init(random.PRNGKey(0), problem))
    ready = time.perf_counter()
    state, info = inference.update(state, problem)
    jax.block_until_ready(state.q)
    startup = time.perf_counter() - start
    # the steady rounds as a user's run does them (``run`` hands each round the factors the last
    # one made, so a merge writes its clients' rows in place instead of copying all M factors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)  # a 6-round run is far from converged
        result = inference.run(
            random.PRNGKey(1), rounds, problem, init_state=state, progress_bar=False
        )
    jax.block_until_ready(result.state.q)
    times = np.asarray(result.history.time)
    info = jax.tree.map(lambda x: x[-1], result.history)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "name": name,
        "clients": num_clients,
        "rows": total,
        "largest": int(sizes.max()),
        "buckets": len(problem.buckets),
        "startup_s": startup,
        "build_s": built - start,
        "init_s": ready - built,
        "first_s": startup - (ready - start),
        "round_s": float(np.mean(times)),
        "round_median_s": float(np.median(times)),
        "round_max_s": float(np.max(times)),
        "round_min_s": float(np.min(times)),
        "peak_mb": peak_kb / 1024,
        "delta_mb": (peak_kb - base_kb) / 1024,
        "ran": int(np.sum(info.attempts)),
        "masked": None if schedule == "fixed" else masked_share(update, problem.buckets),
        "rejected": int(info.num_rejected),
        "sent_mb": None
        if getattr(info, "bytes_sent", None) is None
        else float(np.sum(info.bytes_sent) + np.sum(info.bytes_received)) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only M <= 1,000")
    parser.add_argument("--rounds", type=int, default=3, help="steady rounds timed after the first")
    parser.add_argument(
        "--full-rank-rounds", type=int, default=1, help="steady rounds of the full-rank runs"
    )
    parser.add_argument("--only", nargs="*", help="configuration names (default: all)")
    parser.add_argument(
        "--million", action="store_true", help="the million-client sweep (M = 10^4, 10^5, 10^6)"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one configuration in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.rounds)))
        return
    if args.million:
        million(args.only or list(MILLION), args.rounds)
        return
    names = args.only or [
        n for n, c in CONFIGS.items() if n not in MILLION and not (args.quick and c[2] > 1000)
    ]
    print(
        f"{'configuration':>25} {'M':>6} {'N':>9} {'largest':>8} {'buckets':>7} "
        f"{'start-up s':>10} {'s/round':>8} {'peak MB':>8} {'+MB':>7} {'ran':>6} "
        f"{'MB sent+received':>16} {'masked %':>8}"
    )
    for name in names:
        rounds = args.full_rank_rounds if CONFIGS[name][0] == "fr" else args.rounds
        out = subprocess.run(
            [sys.executable, __file__, "--one", name, "--rounds", str(rounds)],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            print(
                f"{name:>25} failed: "
                f"{out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}"
            )
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{name:>25} {r['clients']:>6} {r['rows']:>9} {r['largest']:>8} {r['buckets']:>7} "
            f"{r['startup_s']:>10.2f} {r['round_s']:>8.3f} {r['peak_mb']:>8.0f} "
            f"{r['delta_mb']:>7.0f} {r['ran']:>6} {r['sent_mb'] or float('nan'):>16.3f} "
            f"{'-' if r['masked'] is None else format(100 * r['masked'], '.1f'):>8}",
            flush=True,
        )


def million(names: list, rounds: int) -> None:
    """The million-client sweep: one subprocess per configuration, its phases apart."""
    print(
        f"{'configuration':>22} {'M':>9} {'N':>10} {'buckets':>7} {'build s':>8} {'init s':>7} "
        f"{'round 1 s':>9} {'median s':>8} {'max s':>6} {'peak MB':>8}"
    )
    for name in names:
        out = subprocess.run(
            [sys.executable, __file__, "--one", name, "--rounds", str(rounds)],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            print(f"{name:>22} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{name:>22} {r['clients']:>9} {r['rows']:>10} {r['buckets']:>7} "
            f"{r['build_s']:>8.2f} {r['init_s']:>7.2f} {r['first_s']:>9.2f} "
            f"{r['round_median_s']:>8.3f} {r['round_max_s']:>6.2f} {r['peak_mb']:>8.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
