"""Seconds per synchronous PVI round, vmap vs loop, and PVI(M=1) vs NumPyro SVI, in one process.

Bayesian logistic regression, N = 10,000 synthetic rows, d = 10 features + intercept, N(0, 1)
priors, mean-field Gaussian factors, M = 10 and M = 100 iid clients; each client runs 10 local
epochs of mini-batches of 100 rows with 10 ELBO particles and Adam(1e-2) -- the configuration in
which the PyTorch reference library of Ashman et al. (2022) takes about 1.7 s (M = 10) and 2.0 s (M
= 100) per round on a 2-core machine. Also: the final global ELBO of the synchronous runs against
the global mean-field optimum (a long full-batch SVI run), both estimated with the same draws.

    python benchmarks/rounds.py              # the full configuration (a few minutes), 2 CPU devices
    python benchmarks/rounds.py --quick      # a small smoke run
    python benchmarks/rounds.py --devices 1
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from jax import random
from numpyro.infer import SVI, TraceMeanField_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal

import numpyro_pvi as pvi

REFERENCE_SECONDS = {10: 1.7, 100: 2.0}  # PyTorch pvi library, synchronous round, 2 cores


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def svi_model(X, y, batch_size):
    """The same model for NumPyro SVI, with NumPyro's own mini-batching."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0], subsample_size=batch_size):
        Xb, yb = numpyro.subsample(X, event_dim=1), numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=Xb @ w + b), obs=yb)


def make_data(num_data, dim, seed=0):
    kx, kw, ky = random.split(random.PRNGKey(seed), 3)
    X = random.normal(kx, (num_data, dim))
    y = random.bernoulli(ky, jax.nn.sigmoid(X @ random.normal(kw, (dim,)) + 0.5)).astype(
        jnp.float32
    )
    return X, y


def local_steps(num_data, num_clients, epochs, batch_size):
    return epochs * int(np.ceil(num_data / num_clients / batch_size))


def make_pvi(X, num_clients, args, backend, damping, full_batch=False):
    """PVI with `args.epochs` local epochs of `args.batch_size` rows (or as many full-batch
    steps)."""
    steps = local_steps(X.shape[0], num_clients, args.epochs, args.batch_size)
    batch_size = None if full_batch else args.batch_size
    update = pvi.GradientUpdate(
        optax.adam(1e-2), num_steps=steps, num_particles=10, batch_size=batch_size
    )
    parts = None if num_clients == 1 else pvi.split_iid(random.PRNGKey(1), X.shape[0], num_clients)
    server = pvi.Synchronous(damping)
    return pvi.PVI(model, pvi.MeanFieldGaussian(), parts, update, server, backend=backend), steps


def time_rounds(inference, X, y, num_rounds):
    """(seconds of round 1 incl. compile, median seconds of rounds 2.., final state, ELBO
    history)."""
    state = inference.init(random.PRNGKey(2), X, y=y)
    times, elbos = [], []
    for _ in range(num_rounds):
        start = time.perf_counter()
        state, info = inference.update(state, X, y=y)
        jax.block_until_ready(state.q)
        times.append(time.perf_counter() - start)
        elbos.append(info.elbo)
    return times[0], float(np.median(times[1:])), state, elbos


def global_optimum(X, y, steps):
    """The global mean-field VI optimum (loc, scale in PVI's flat order w, b) from long full-batch
    SVI."""
    guide = AutoDiagonalNormal(model)
    optim = optax.adam(optax.exponential_decay(1e-2, steps, 0.01))
    params = (
        SVI(model, guide, optim, TraceMeanField_ELBO(16))
        .run(random.PRNGKey(3), steps, X, y=y, progress_bar=False)
        .params
    )
    loc, scale = (
        guide._unpack_latent(params["auto_loc"]),
        guide._unpack_latent(params["auto_scale"]),
    )
    return (
        jnp.concatenate([loc["w"], loc["b"][None]]),
        jnp.concatenate([scale["w"], scale["b"][None]]),
    )


def svi_seconds(X, y, steps, batch_size):
    """Seconds for `steps` steps of NumPyro SVI (AutoDiagonalNormal, TMF(10), Adam 1e-2), compiled.

    With a ``batch_size`` the model subsamples with ``numpyro.plate(..., subsample_size)``; with
    ``None`` every step uses all rows (``model`` itself).
    """
    if batch_size is None:
        svi, args = (
            SVI(model, AutoDiagonalNormal(model), optax.adam(1e-2), TraceMeanField_ELBO(10)),
            (X, y),
        )
    else:
        guide = AutoDiagonalNormal(svi_model)
        svi, args = (
            SVI(svi_model, guide, optax.adam(1e-2), TraceMeanField_ELBO(10)),
            (X, y, batch_size),
        )
    state = svi.init(random.PRNGKey(4), *args)
    update = jax.jit(
        lambda s: jax.lax.scan(lambda s, _: svi.update(s, *args), s, None, length=steps)
    )
    jax.block_until_ready(update(state))  # compile
    start = time.perf_counter()
    jax.block_until_ready(update(state))
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N=2000 and few rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="synchronous rounds per run")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument(
        "--devices", type=int, default=2, help="CPU devices to split a round's clients over"
    )
    args = parser.parse_args()
    numpyro.set_host_device_count(args.devices)  # before the first JAX operation
    num_data, rounds, optimum_steps = (2000, 4, 4000) if args.quick else (10_000, 30, 30_000)
    rounds = args.rounds or rounds
    X, y = make_data(num_data, 10)
    print(
        f"logistic regression N={num_data}, d=10+1, {args.epochs} local epochs of batches of "
        f"{args.batch_size}, 10 particles, Adam(1e-2), {rounds} synchronous rounds; "
        f"{jax.device_count()} CPU device(s)\n"
    )

    opt_loc, opt_scale = global_optimum(X, y, optimum_steps)
    rows = []
    for num_clients, damping in [(10, 0.5), (100, 0.2)]:
        for backend in ["vmap", "loop"]:
            inference, steps = make_pvi(X, num_clients, args, backend, damping)
            compile_s, per_round, state, elbos = time_rounds(
                inference, X, y, rounds if backend == "vmap" else 3
            )
            row = dict(
                M=num_clients,
                backend=backend,
                steps=steps,
                damping=damping,
                first=compile_s,
                round=per_round,
            )
            if backend == "vmap":
                optimum = state._replace(q=inference.family.from_loc_scale(opt_loc, opt_scale))
                elbo, best = (
                    float(inference.evaluate(s, X, y=y, num_particles=4000))
                    for s in (state, optimum)
                )
                row.update(elbo=elbo, gap=best - elbo, history=elbos)
            rows.append(row)

    print(
        f"{'M':>4} {'backend':>8} {'steps':>6} {'rho':>5} {'1st round s':>12} {'s/round':>9} "
        f"{'vs ref':>8}"
    )
    for r in rows:
        speedup = REFERENCE_SECONDS[r["M"]] / r["round"]
        print(
            f"{r['M']:>4} {r['backend']:>8} {r['steps']:>6} {r['damping']:>5} {r['first']:>12.2f} "
            f"{r['round']:>9.4f} {speedup:>7.0f}x"
        )
    vmap = {r["M"]: r for r in rows if r["backend"] == "vmap"}
    loop = {r["M"]: r for r in rows if r["backend"] == "loop"}
    print(
        f"\nvmap vs loop: {loop[10]['round'] / vmap[10]['round']:.1f}x faster at M=10, "
        f"{loop[100]['round'] / vmap[100]['round']:.1f}x at M=100"
    )
    print(
        f"M=100 round / M=10 round (vmap): {vmap[100]['round'] / vmap[10]['round']:.2f} (target "
        "<= 3)"
    )
    print("targets: vmap >= 30x faster than the reference at M=10, >= 100x at M=100")

    print(
        "\nfinal global ELBO vs the global mean-field optimum (4000 common draws; target: within "
        "1 nat)"
    )
    for m, r in vmap.items():
        print(
            f"  M={m:<4} ELBO {r['elbo']:.2f}, optimum {r['elbo'] + r['gap']:.2f}, short by "
            f"{r['gap']:.2f} nats; ELBO per round: "
            f"{' '.join(f'{e:.1f}' for e in r['history'][-5:])} (last 5)"
        )

    steps = local_steps(num_data, 1, args.epochs, args.batch_size)
    print(
        f"\nPVI(M=1), one round of {steps} steps (incl. merge + ELBO estimate) vs NumPyro SVI, "
        f"{steps} steps:"
    )
    for batch_size in [args.batch_size, None]:
        one, _ = make_pvi(X, 1, args, "vmap", 1.0, full_batch=batch_size is None)
        _, pvi_round, _, _ = time_rounds(one, X, y, 3)
        svi_s = svi_seconds(X, y, steps, batch_size)
        label = f"batches of {batch_size}" if batch_size else "full batch"
        print(
            f"  {label:>16}: PVI {pvi_round:.3f} s, SVI {svi_s:.3f} s, ratio "
            f"{pvi_round / svi_s:.2f} (target <= 1.3)"
        )


if __name__ == "__main__":
    main()
