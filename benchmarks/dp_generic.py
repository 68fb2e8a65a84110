"""DP-SGD on a non-Gaussian family (the generic path): its Monte Carlo spread and the cost of a
step.

``spread`` (default): the Normal-Gamma regression of ``tests/families/test_site_families.py`` (48
rows, one
client), ``SiteFamilies({"w": FullRankGaussian(), "tau": Gamma()})``, ``DPGradientUpdate`` without
noise and with a clip norm no row reaches (batch = every row), Adam(0.05, b2=0.99), 4000 steps, 4
particles: one visit from the prior (what one round of PVI with one client runs), over seeds
(``jax.vmap`` over keys); prints each run's errors against the closed-form mean-field VB fixed point
(coordinate ascent): the tolerances of ``tests/privacy/test_dp_gradient.py``.

``--conjugate``: the spread of the Beta and Dirichlet tests of
``tests/privacy/test_dp_gradient.py`` (one
visit of 30 rows, no noise, Adam(0.05, b2=0.99), 3000 steps) against the exact posterior.

``--cost``: seconds per DP-SGD step (batch = every row, 1 particle) of a client of ``n`` rows of the
same model, for ``SiteFamilies`` (generic path: guide draws, per-row ``jax.vjp`` norms) against
``FullRankGaussian`` and ``MeanFieldGaussian`` (the Gaussian fast path: ``unwhiten`` draws; the
mean-field norms in closed form) over the same 3 coordinates, and a non-DP ``GradientUpdate`` step
(full batch) with ``SiteFamilies``; the fastest of 10 calls of 200 steps each, timed alternately.

    python benchmarks/dp_generic.py            # spread over 32 seeds python
    benchmarks/dp_generic.py --cost     # step cost, 48 and 1000 rows python
    benchmarks/dp_generic.py --conjugate  # Beta-Bernoulli and Dirichlet-categorical: spread, 16
    seeds
"""

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random

import numpyro_pvi as pvi

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fakes import conjugate_update, one_visit  # noqa: E402
from models import (  # noqa: E402
    bernoulli_model,
    categorical_model,
    normal_gamma_model,
    normal_gamma_vb,
)

STEPS, PARTICLES, LR = 4000, 4, 0.05


def data(n: int) -> tuple:
    """The test's data for 48 rows (``tests/privacy/test_dp_gradient.py``), the same construction
    for
    others."""
    X = random.normal(random.PRNGKey(4), (n, 2))
    return X, X @ jnp.array([1.0, -0.5]) + 0.7 * random.normal(random.PRNGKey(5), (n,))


def errors(family, q, X, y) -> np.ndarray:
    """E[tau] and shape relative errors, |w mean error| / sd, w's sds' relative errors, against
    VB."""
    mean, cov, a, b = normal_gamma_vb(X, y)
    sd = np.sqrt(np.diag(cov))
    w_block, tau_block = family.split(q)
    w_mean, w_cov = pvi.FullRankGaussian().moments(w_block)
    shape, rate = (float(p[0]) for p in pvi.Gamma().to_params(tau_block))
    return np.array(
        [
            shape / rate / (a / b) - 1,
            shape / a - 1,
            *(np.abs(np.asarray(w_mean) - mean) / sd),
            *(np.sqrt(np.diag(np.asarray(w_cov))) / sd - 1),
        ]
    )


def spread(num_seeds: int = 32) -> None:
    X, y = data(48)
    family = pvi.SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})
    update = pvi.DPGradientUpdate(
        optax.adam(LR, b2=0.99),
        num_steps=STEPS,
        batch_size=64,
        clip_norm=1e6,
        noise_multiplier=0.0,
        num_particles=PARTICLES,
    )
    visit, family = one_visit(normal_gamma_model, family, update, X, y=y)
    visit = jax.jit(jax.vmap(visit))
    qs = visit(random.split(random.PRNGKey(0), num_seeds))
    rows = np.array(
        [errors(family, jax.tree.map(lambda a, i=i: a[i], qs), X, y) for i in range(num_seeds)]
    )
    print(f"{num_seeds} seeds, {STEPS} steps, {PARTICLES} particles, Adam({LR}, b2=0.99)")
    print(f"{'':22s} {'max |err|':>10} {'sd':>8}")
    for name, col in (
        ("E[tau] rel.", rows[:, 0]),
        ("tau shape rel.", rows[:, 1]),
        ("w mean / sd", rows[:, 2:4].ravel()),
        ("w sds rel.", rows[:, 4:].ravel()),
    ):
        print(f"{name:22s} {np.max(np.abs(col)):10.4f} {np.std(col):8.4f}")


def conjugate(num_seeds: int = 16) -> None:
    """Beta-Bernoulli and Dirichlet-categorical (the data of tests/privacy/test_dp_gradient.py):
    relative
    errors of the parameters against the exact posterior, over seeds."""
    yb = random.bernoulli(random.PRNGKey(0), 0.3, (30,)).astype(jnp.float32)
    yc = random.categorical(random.PRNGKey(1), jnp.log(jnp.arange(1.0, 5.0)), shape=(30,))
    cases = (
        (
            bernoulli_model,
            pvi.Beta(),
            yb,
            np.array([2.0 + float(yb.sum()), 3.0 + 30 - float(yb.sum())]),
        ),
        (
            categorical_model,
            pvi.Dirichlet(),
            yc,
            np.array([1.0, 2.0, 0.5, 3.0]) + np.bincount(np.asarray(yc), minlength=4),
        ),
    )
    for model, family, y, exact in cases:
        visit, family = one_visit(model, family, conjugate_update(), y=y)
        qs = jax.jit(jax.vmap(visit))(random.split(random.PRNGKey(0), num_seeds))
        params = np.concatenate([np.asarray(p) for p in family.to_params(qs)], axis=-1)
        print(
            f"{family!r}: {num_seeds} seeds, max |relative error| per parameter "
            f"{np.round(np.max(np.abs(params / exact - 1), axis=0), 4)}"
        )


def cost(sizes=(48, 1000), repeats: int = 10) -> None:
    print("seconds per DP-SGD step (batch = every row, 1 particle), fastest of 10 x 200 steps")
    print(
        f"{'rows':>6} {'SiteFam.':>10} {'FullRank':>10} {'MeanField':>10} {'SiteFam. non-DP':>16}"
    )
    for n in sizes:
        X, y = data(n)
        dp, plain = (
            pvi.DPGradientUpdate(
                optax.adam(1e-2), num_steps=200, batch_size=n, clip_norm=1.0, noise_multiplier=1.0
            ),
            pvi.GradientUpdate(optax.adam(1e-2), 200),
        )
        site_families = lambda: pvi.SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})  # noqa: E731
        cases = (
            (site_families(), dp),
            (pvi.FullRankGaussian(), dp),
            (pvi.MeanFieldGaussian(), dp),
            (site_families(), plain),
        )
        runs = [jax.jit(one_visit(normal_gamma_model, f, u, X, y=y)[0]) for f, u in cases]
        for run in runs:
            jax.block_until_ready(run(random.PRNGKey(0)))  # compile
        best = [np.inf] * len(runs)
        for i in range(repeats):
            for j, run in enumerate(runs):
                start = time.perf_counter()
                jax.block_until_ready(run(random.PRNGKey(i + 1)))
                best[j] = min(best[j], (time.perf_counter() - start) / 200)
        print(f"{n:>6} " + " ".join(f"{b:>10.2e}" for b in best[:3]) + f" {best[3]:>16.2e}")


if __name__ == "__main__":
    cost() if "--cost" in sys.argv else conjugate() if "--conjugate" in sys.argv else spread()
