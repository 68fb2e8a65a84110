"""Differentially private PVI on breast cancer: utility against epsilon, and the cost of a DP local
step.

Bayesian logistic regression (31 coordinates: 30 standardised features and an intercept, N(0, 1)
priors, mean-field q) on scikit-learn's ``load_breast_cancer`` (455 training rows, 114 test rows), M
= 10 clients, iid and label-skewed (``split_by_label``, alpha = 1), sequential PVI, delta = 1e-5:

* DP-SGD (``DPGradientUpdate``) and local averaging (``DPLocalAveraging`` of a ``GradientUpdate``)
  at epsilon in {0.5, 1, 2, 4, 8}, their noise multipliers calibrated with
  ``pvi.calibrate_noise_multiplier`` for the client with the highest sampling rate (every client
  then spends at most epsilon; the spent epsilon reported is ``result.privacy_spent(delta)``'s
  largest);
* non-DP PVI (``GradientUpdate``) and global mean-field VI (NumPyro ``SVI`` with ``AutoNormal``);
* test accuracy and mean test log predictive density (posterior predictive, 1000 draws);
* the cost of a DP-SGD local step against a ``GradientUpdate`` step at the same batch size (target
  <= 3x), on a breast-cancer client (46 rows) and on a synthetic client of 1000 rows.

    python benchmarks/dp.py             # the full experiment (a few minutes on 2 cores)
    python benchmarks/dp.py --quick     # epsilon in {1, 8}, iid only: a smoke run
    python benchmarks/dp.py --cost      # only the cost of a local step (--particles 2: 2 particles)
"""

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split

import numpyro_pvi as pvi

DELTA, CLIENTS, ROUNDS = 1e-5, 10, 5
# DP-SGD: steps per round, expected batch, C, Adam's rate
DP_STEPS, DP_BATCH, DP_CLIP, DP_LR = 50, 10, 1.0, 2e-2
SHARDS, AVG_CLIP, AVG_ROUNDS = 4, 2.0, 2  # local averaging: shards, C on natural parameters, rounds
IMAGE = Path(__file__).resolve().parent.parent / "docs" / "images" / "dp_breast_cancer.png"


def model(X, y=None):
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def load():
    X, y = load_breast_cancer(return_X_y=True)
    X_train, X_test, y_train, y_test = train_test_split(
        X, y, test_size=0.2, random_state=0, stratify=y
    )
    mean, sd = X_train.mean(0), X_train.std(0)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return f32((X_train - mean) / sd), f32(y_train), f32((X_test - mean) / sd), f32(y_test)


def scores(samples, X, y):
    """Test accuracy and mean log predictive density of the posterior predictive (draws of w and
    b)."""
    logits = samples["w"] @ X.T + samples["b"][:, None]
    log_p1 = jax.nn.log_sigmoid(logits)
    log_p0 = jax.nn.log_sigmoid(-logits)
    log_pred = jax.scipy.special.logsumexp(jnp.where(y == 1, log_p1, log_p0), axis=0) - jnp.log(
        logits.shape[0]
    )
    prob1 = jnp.mean(jnp.exp(log_p1), axis=0)
    return float(jnp.mean((prob1 > 0.5) == (y == 1))), float(jnp.mean(log_pred))


def run_pvi(update, parts, data, rounds):
    X, y, X_test, y_test = data
    inference = pvi.PVI(model, pvi.MeanFieldGaussian(), parts, update, pvi.Sequential())
    import warnings

    with warnings.catch_warnings():
        # "far from converged" etc.: the table says how it did
        warnings.simplefilter("ignore", pvi.PVIWarning)
        result = inference.run(random.PRNGKey(1), rounds, X, y=y, progress_bar=False)
    acc, lpd = scores(result.sample_posterior(random.PRNGKey(2), 1000), X_test, y_test)
    spent = (
        float(np.max(result.privacy_spent(DELTA)))
        if isinstance(update, pvi.privacy.accounting.PrivateUpdate)
        else np.inf
    )
    rejected = int(np.sum(np.asarray(result.history.rejection) > 0))
    return acc, lpd, spent, rejected


def global_vi(data):
    X, y, X_test, y_test = data
    guide = AutoNormal(model)
    svi = SVI(model, guide, optax.adam(1e-2), Trace_ELBO(4))
    out = svi.run(random.PRNGKey(0), 3000, X, y=y, progress_bar=False)
    return scores(
        guide.sample_posterior(random.PRNGKey(2), out.params, sample_shape=(1000,)), X_test, y_test
    )


def dp_sgd(eps, sizes):
    # the smallest client samples at the highest rate: calibrate for it
    rate = min(1.0, DP_BATCH / min(sizes))
    sigma = pvi.calibrate_noise_multiplier(eps, DELTA, rate, DP_STEPS * ROUNDS)
    return pvi.DPGradientUpdate(
        optax.adam(DP_LR),
        num_steps=DP_STEPS,
        batch_size=DP_BATCH,
        clip_norm=DP_CLIP,
        noise_multiplier=sigma,
        num_particles=2,
    ), sigma


def local_averaging(eps):
    # one Gaussian mechanism per round
    sigma = pvi.calibrate_noise_multiplier(eps, DELTA, 1.0, AVG_ROUNDS)
    inner = pvi.GradientUpdate(optax.adam(2e-2), num_steps=200, num_particles=2)
    return pvi.DPLocalAveraging(
        inner, num_shards=SHARDS, clip_norm=AVG_CLIP, noise_multiplier=sigma
    ), sigma


def step_cost(X, y, parts, batches, particles=1, repeats=20):
    """Seconds per local step of DPGradientUpdate vs GradientUpdate, both at batch size B and with
    the same number of particles, on client 0.

    The two are timed alternately (so both see the same load from other processes), each the fastest
    of ``repeats`` calls of 200 steps, by the wall clock and by the process's CPU time (which other
    processes' load disturbs less).
    """
    rows = []
    for batch in batches:
        runs = []
        for update in (
            pvi.DPGradientUpdate(
                optax.adam(1e-2),
                num_steps=200,
                batch_size=batch,
                clip_norm=1.0,
                noise_multiplier=1.0,
                num_particles=particles,
            ),
            pvi.GradientUpdate(optax.adam(1e-2), 200, num_particles=particles, batch_size=batch),
        ):
            problem = pvi.PVI(
                model, pvi.MeanFieldGaussian(), parts, update, pvi.Sequential()
            ).build(X, y=y)
            cp, client = problem.client_problem, jax.tree.map(lambda a: a[0], problem.clients)
            q = cp.family.from_loc_scale(jnp.zeros(cp.dim), jnp.ones(cp.dim))
            run = jax.jit(
                lambda k, u=update, cp=cp, c=client, q=q: (
                    u.bind(cp)(k, c, q, q, u.init_state(cp)).delta
                )
            )
            jax.block_until_ready(run(random.PRNGKey(0)))  # compile
            runs.append(run)
        wall, cpu = [np.inf, np.inf], [np.inf, np.inf]
        for i in range(repeats):
            for j, run in enumerate(runs):
                start, start_cpu = time.perf_counter(), time.process_time()
                jax.block_until_ready(run(random.PRNGKey(i + 1)))
                wall[j] = min(wall[j], (time.perf_counter() - start) / 200)
                cpu[j] = min(cpu[j], (time.process_time() - start_cpu) / 200)
        rows.append((len(parts[0]), batch, wall[0], wall[1], cpu[0], cpu[1]))
    return rows


def main(quick: bool, cost_only: bool, particles: int = 1) -> None:
    data = load()
    X, y = data[:2]
    eps_grid = (1.0, 8.0) if quick else (0.5, 1.0, 2.0, 4.0, 8.0)
    splits = {
        "iid": pvi.split_iid(random.PRNGKey(0), X.shape[0], CLIENTS),
        "label-skew": pvi.split_by_label(random.PRNGKey(0), np.asarray(y, int), CLIENTS, alpha=1.0),
    }
    if quick:
        splits.pop("label-skew")
    if not cost_only:
        utility(data, splits, eps_grid)
    print_costs(X, y, splits["iid"], quick, particles)


def utility(data, splits, eps_grid) -> None:
    X = data[0]
    print(
        f"breast cancer: {X.shape[0]} train / {data[2].shape[0]} test rows, {CLIENTS} clients, "
        f"delta={DELTA}; DP-SGD: {ROUNDS} rounds x {DP_STEPS} steps, batch {DP_BATCH}, "
        f"C={DP_CLIP}; local averaging: {AVG_ROUNDS} rounds, {SHARDS} shards, C={AVG_CLIP}"
    )
    gvi = global_vi(data)
    table = []
    for split, parts in splits.items():
        sizes = [len(p) for p in parts]
        print(f"\n{split}: client sizes {sizes}")
        plain = run_pvi(
            pvi.GradientUpdate(optax.adam(2e-2), num_steps=200, num_particles=2),
            parts,
            data,
            ROUNDS,
        )
        table.append((split, "global VI", np.inf, np.nan, *gvi, np.inf, 0))
        table.append((split, "PVI (non-DP)", np.inf, np.nan, *plain))
        for eps in eps_grid:
            for name, (update, sigma), rounds in (
                ("DP-PVI DP-SGD", dp_sgd(eps, sizes), ROUNDS),
                ("DP-PVI local avg", local_averaging(eps), AVG_ROUNDS),
            ):
                start = time.perf_counter()
                row = (split, name, eps, sigma, *run_pvi(update, parts, data, rounds))
                table.append(row)
                print(
                    f"  {name:18s} eps={eps:<4} sigma={sigma:7.3f} acc={row[4]:.3f} "
                    f"lpd={row[5]:.3f} spent={row[6]:.3f} rejected={row[7]} "
                    f"({time.perf_counter() - start:.1f} s)"
                )
    print_table(table)
    plot(table, eps_grid)


def print_costs(X, y, parts, quick, particles=1) -> None:
    print(
        f"\ncost of a local step (client 0, mean-field, 31 coordinates, {particles} particle(s) "
        "in both), DPGradientUpdate vs GradientUpdate"
    )
    print(
        f"{'rows':>6} {'batch':>6} {'DP s/step':>10} {'non-DP':>10} {'ratio':>6} {'DP cpu':>10} "
        f"{'non-DP cpu':>10} {'ratio':>6}  target <= 3x"
    )
    # synthetic clients of 1000 rows
    X_big = random.normal(random.PRNGKey(3), (10 * 1000, X.shape[1]))
    y_big = random.bernoulli(random.PRNGKey(4), jax.nn.sigmoid(X_big[:, 0])).astype(jnp.float32)
    costs = step_cost(X, y, parts, (DP_BATCH, len(parts[0])), particles)
    if not quick:
        costs += step_cost(
            X_big, y_big, pvi.split_iid(random.PRNGKey(5), 10000, CLIENTS), (100, 1000), particles
        )
    for rows, batch, dp, plain, dp_cpu, plain_cpu in costs:
        ratio, ratio_cpu = dp / plain, dp_cpu / plain_cpu
        print(
            f"{rows:>6} {batch:>6} {dp:10.2e} {plain:10.2e} {ratio:6.2f} {dp_cpu:10.2e} "
            f"{plain_cpu:10.2e} {ratio_cpu:6.2f}  "
            f"{'met' if max(ratio, ratio_cpu) <= 3 else 'missed'}"
        )


def print_table(table) -> None:
    print(
        f"\n{'split':10s} {'method':18s} {'eps target':>10} {'sigma':>8} {'test acc':>8} "
        f"{'test lpd':>9} {'eps spent':>9} {'rejected':>8}"
    )
    for split, name, eps, sigma, acc, lpd, spent, rejected in table:
        print(
            f"{split:10s} {name:18s} {eps:10.1f} {sigma:8.3f} {acc:8.3f} {lpd:9.3f} {spent:9.3f} "
            f"{rejected:8d}"
        )


def plot(table, eps_grid) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = sorted({row[0] for row in table})
    fig, axes = plt.subplots(2, len(splits), figsize=(5 * len(splits), 6), squeeze=False)
    for j, split in enumerate(splits):
        rows = [r for r in table if r[0] == split]
        for i, (metric, label) in enumerate(
            ((4, "test accuracy"), (5, "test log predictive density"))
        ):
            ax = axes[i, j]
            for name, style in (("DP-PVI DP-SGD", "o-"), ("DP-PVI local avg", "s-")):
                points = [(r[2], r[metric]) for r in rows if r[1] == name]
                ax.plot(*zip(*points), style, label=name)
            for name, style in (("PVI (non-DP)", "--"), ("global VI", ":")):
                ax.axhline(
                    next(r[metric] for r in rows if r[1] == name), ls=style, color="k", label=name
                )
            ax.set_xscale("log", base=2)
            ax.set_xticks(eps_grid, [str(e) for e in eps_grid])
            ax.set_xlabel("epsilon (delta = 1e-5)")
            ax.set_ylabel(label)
            ax.set_title(split)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    IMAGE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMAGE, dpi=100)
    print(f"\nplot saved to {IMAGE}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cost", action="store_true", help="only the cost of a local step")
    parser.add_argument(
        "--particles", type=int, default=1, help="particles of both updates in the cost table"
    )
    args = parser.parse_args()
    main(args.quick, args.cost, args.particles)
