"""Local updates compared: rounds and seconds to the global VI optimum, and EP / SNEP error against
NUTS.

Bayesian logistic regression, N = 10,000 synthetic rows, d = 10 features + intercept, N(0, 1)
priors, M = 10 iid clients, sequential PVI, in one process.

1. ``GradientUpdate`` (Adam) vs ``NaturalGradientUpdate`` (CVI), mean-field: rounds and seconds
   until the global ELBO is within 1 % (and within 1 nat) of the global mean-field VI optimum's (a
   long full-batch SVI run); both ELBOs estimated with the same 4000 draws. (The CVI paper reports
   natural-gradient updates converging in far fewer passes than gradient descent.)
2. ``MomentMatchingUpdate`` (EP, importance sampling and NUTS) and ``SNEPUpdate``, full rank: after
   each round, the error of ``q``'s mean (max over coordinates, in NUTS posterior sds) and
   covariance (relative Frobenius norm) against a NUTS run on all the data, against cumulative
   seconds.

    python benchmarks/local_updates.py            # the full configuration
    python benchmarks/local_updates.py --quick    # N = 2000, fewer rounds: a smoke run
"""

import argparse
import time

import jax
import numpy as np
import optax
from jax import random
from numpyro.infer import MCMC, NUTS
from rounds import global_optimum, make_data, model

import numpyro_pvi as pvi


def elbo_curve(inference, X, y, rounds, target):
    """Per round: (cumulative seconds, ELBO with common draws); the first (round, seconds) within 1
    % of ``target`` and the first within 1 nat of it."""
    state = inference.init(random.PRNGKey(2), X, y=y)
    seconds, curve, hit, hit_nat = 0.0, [], None, None
    for r in range(rounds):
        start = time.perf_counter()
        state, _ = inference.update(state, X, y=y)
        jax.block_until_ready(state.q)
        seconds += time.perf_counter() - start
        elbo = float(
            inference.evaluate(
                state._replace(rng_key=random.PRNGKey(7)), X, y=y, num_particles=4000
            )
        )
        curve.append((seconds, elbo))
        if hit is None and abs(elbo - target) <= 0.01 * abs(target):
            hit = (r + 1, seconds)
        if hit_nat is None and abs(elbo - target) <= 1.0:
            hit_nat = (r + 1, seconds)
    return curve, hit, hit_nat


def nuts_reference(X, y, num_samples):
    mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=num_samples, progress_bar=False)
    start = time.perf_counter()
    mcmc.run(random.PRNGKey(0), X, y=y)
    samples = mcmc.get_samples()
    z = np.concatenate([samples["w"], samples["b"][:, None]], axis=1)
    return z.mean(0), np.cov(z.T), time.perf_counter() - start


def error_curve(inference, X, y, rounds, reference):
    ref_mean, ref_cov, _ = reference
    sd = np.sqrt(np.diag(ref_cov))
    state = inference.init(random.PRNGKey(2), X, y=y)
    seconds, curve = 0.0, []
    for _ in range(rounds):
        start = time.perf_counter()
        state, info = inference.update(state, X, y=y)
        jax.block_until_ready(state.q)
        seconds += time.perf_counter() - start
        loc, scale_tril = inference.family.loc_scale(state.q)
        cov = np.asarray(scale_tril @ scale_tril.T)
        curve.append(
            (
                seconds,
                np.max(np.abs(np.asarray(loc) - ref_mean) / sd),
                np.linalg.norm(cov - ref_cov) / np.linalg.norm(ref_cov),
                int(np.sum(info.clamped)),
            )
        )
    return curve


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N=2000 and few rounds: a smoke run")
    parser.add_argument("--clients", type=int, default=10)
    args = parser.parse_args()
    num_data, vi_rounds, ep_rounds, optimum_steps, nuts_samples = (
        (2000, 6, 3, 4000, 2000) if args.quick else (10_000, 15, 5, 20_000, 4000)
    )
    M = args.clients
    X, y = make_data(num_data, 10)
    parts = pvi.split_iid(random.PRNGKey(1), num_data, M)
    print(
        f"logistic regression N={num_data}, d=10+1, M={M} iid clients, sequential PVI; "
        f"{jax.device_count()} CPU device(s)\n"
    )

    # 1. rounds / seconds to within 1 % of the global mean-field VI optimum
    mf = pvi.MeanFieldGaussian()
    opt_loc, opt_scale = global_optimum(X, y, optimum_steps)
    probe = pvi.PVI(model, mf, parts, pvi.NaturalGradientUpdate(), pvi.Sequential())
    state = probe.init(random.PRNGKey(7), X, y=y)._replace(q=mf.from_loc_scale(opt_loc, opt_scale))
    target = float(probe.evaluate(state, X, y=y, num_particles=4000))
    steps = 10 * int(np.ceil(num_data / M / 100))
    updates = {
        f"GradientUpdate(adam 1e-2, {steps} steps, batch 100)": pvi.GradientUpdate(
            optax.adam(1e-2), num_steps=steps, num_particles=10, batch_size=100
        ),
        "NaturalGradientUpdate(0.5, 5 steps, 32 particles)": pvi.NaturalGradientUpdate(
            0.5, num_steps=5, num_particles=32
        ),
        "NaturalGradientUpdate(1.0, 1 step, 32 particles)": pvi.NaturalGradientUpdate(
            1.0, num_steps=1, num_particles=32
        ),
    }
    print(
        f"global mean-field VI optimum ELBO {target:.2f} (SVI, {optimum_steps} full-batch steps); "
        f"1 % = {0.01 * abs(target):.2f} nats"
    )
    print(
        f"{'update':<52} {'rounds (s) to 1%':>17} {'rounds (s) to 1 nat':>20} {'s/round':>8} "
        f"{'final ELBO':>11}"
    )
    hits = {}
    for name, update in updates.items():
        curve, hit, hit_nat = elbo_curve(
            pvi.PVI(model, mf, parts, update, pvi.Sequential()), X, y, vi_rounds, target
        )
        hits[name] = hit_nat
        per_round = (curve[-1][0] - curve[0][0]) / max(len(curve) - 1, 1)
        cells = [f"{h[0]} ({h[1]:.2f})" if h else f">{vi_rounds}" for h in (hit, hit_nat)]
        print(f"{name:<52} {cells[0]:>17} {cells[1]:>20} {per_round:>8.3f} {curve[-1][1]:>11.2f}")
    grad, nat = (hits[k] for k in list(updates)[:2])
    if grad and nat:
        print(
            f"to 1 nat, GradientUpdate / NaturalGradientUpdate(0.5): {grad[0] / nat[0]:.1f}x "
            f"rounds, {grad[1] / nat[1]:.1f}x seconds"
        )

    # 2. EP / SNEP error against NUTS, against seconds
    reference = nuts_reference(X, y, nuts_samples)
    print(f"\nNUTS reference: 1 chain, 500 warm-up + {nuts_samples} draws, {reference[2]:.1f} s")
    fr = pvi.FullRankGaussian()
    methods = {
        "EP importance (1024)": pvi.MomentMatchingUpdate(tilted=pvi.Importance(num_particles=1024)),
        "EP NUTS (2x300 draws)": pvi.MomentMatchingUpdate(
            tilted=pvi.NUTSMoments(num_samples=300, num_warmup=200)
        ),
        "SNEP (defaults: eps .05, 200 inner, 8 chains)": pvi.SNEPUpdate(),
        "CVI (global VI fixed point)": pvi.NaturalGradientUpdate(
            0.5, num_steps=5, num_particles=32
        ),
    }
    print(
        f"{'method':<38} {'round':>5} {'seconds':>8} {'mean err (sd)':>14} {'cov rel err':>12} "
        f"{'clamped':>8}"
    )
    for name, update in methods.items():
        for r, (s, mean_err, cov_err, clamped) in enumerate(
            error_curve(
                pvi.PVI(model, fr, parts, update, pvi.Sequential()), X, y, ep_rounds, reference
            )
        ):
            print(
                f"{name if r == 0 else '':<38} {r + 1:>5} {s:>8.2f} {mean_err:>14.4f} "
                f"{cov_err:>12.4f} {clamped:>8}"
            )


if __name__ == "__main__":
    main()
