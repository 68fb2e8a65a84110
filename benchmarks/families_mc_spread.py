"""Monte Carlo spread of the Normal-Gamma SiteFamilies fixed point (the tolerances of
tests/families/test_site_families.py).

Linear regression with unknown noise precision, ``SiteFamilies({"w": FullRankGaussian(), "tau":
Gamma()})`` and CVI with 512 particles, over seeds and servers; prints each run's relative errors
against the closed-form mean-field VB solution (coordinate ascent).

    python benchmarks/families_mc_spread.py             # Normal-Gamma python
    benchmarks/families_mc_spread.py halfnormal  # HalfNormal scale in a SiteFamilies' default block

``halfnormal``: ``SiteFamilies({"w": FullRankGaussian()})`` with a ``HalfNormal`` noise scale fitted
by the default block's prior factor ``t_0``, CVI with 64 particles, 8 sequential rounds, against the
closed-form block-diagonal VI optimum; prints the errors in units of the optimum's sds.
"""

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from jax import random

import numpyro_pvi as pvi

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import UNEVEN_N as N  # noqa: E402
from models import UNEVEN_PARTS as PARTS  # noqa: E402
from models import (  # noqa: E402
    block_diagonal_vi_optimum,
    halfnormal_scale_model,
    normal_gamma_model,
    normal_gamma_vb,
)


def halfnormal(num_seeds: int = 5) -> None:
    X = 0.3 + random.normal(random.PRNGKey(0), (40, 2))
    y = X @ jnp.array([1.0, -0.5]) + 0.6 * random.normal(random.PRNGKey(1), (40,))
    m, cov, mu, s = block_diagonal_vi_optimum(X, y)
    sd = np.sqrt(np.diag(cov))
    family = pvi.SiteFamilies({"w": pvi.FullRankGaussian()})
    inference = pvi.PVI(
        halfnormal_scale_model,
        family,
        partitions=np.split(np.arange(40), [6, 15, 27]),
        server=pvi.Sequential(),
        local_update=pvi.NaturalGradientUpdate(step_size=1.0, num_particles=64),
    )
    for seed in range(10, 10 + num_seeds):
        result = inference.run(random.PRNGKey(seed), 8, X, y=y, progress_bar=False)
        w_block, sigma_block = result.family.split(result.state.q)
        w_mean, w_cov = pvi.FullRankGaussian().moments(w_block)
        log_mean, log_var = pvi.MeanFieldGaussian().moments(sigma_block)
        print(
            f"seed={seed}: w mean/sd {np.max(np.abs(np.asarray(w_mean) - m) / sd):.4f} w sd "
            f"{np.max(np.abs(np.sqrt(np.diag(np.asarray(w_cov))) / sd - 1)):.4f} log sigma "
            f"mean/sd {abs(float(log_mean[0]) - mu) / s:.4f} log sigma sd "
            f"{abs(float(np.sqrt(log_var[0])) / s - 1):.4f}",
            flush=True,
        )


def main() -> None:
    X = random.normal(random.PRNGKey(4), (N, 2))
    y = X @ jnp.array([1.0, -0.5]) + 0.7 * random.normal(random.PRNGKey(5), (N,))
    mean, cov, a, b = normal_gamma_vb(X, y)
    sd = np.sqrt(np.diag(cov))
    for server, rounds in [
        (pvi.Sequential(), 8),
        (pvi.Synchronous(1.0), 12),
        (pvi.Synchronous(1.0), 30),
    ]:
        family = pvi.SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})
        inference = pvi.PVI(
            normal_gamma_model,
            family,
            partitions=PARTS,
            server=server,
            local_update=pvi.NaturalGradientUpdate(step_size=1.0, num_particles=512),
        )
        for seed in range(5):
            result = inference.run(random.PRNGKey(seed), rounds, X, y=y, progress_bar=False)
            w_block, tau_block = result.family.split(result.state.q)
            shape, rate = pvi.Gamma().to_params(tau_block)
            w_mean, w_cov = pvi.FullRankGaussian().moments(w_block)
            tau_error, shape_error = (
                float(shape[0] / rate[0]) / (a / b) - 1,
                float(shape[0]) / a - 1,
            )
            mean_error = np.max(np.abs(np.asarray(w_mean) - mean) / sd)
            sd_error = np.max(np.abs(np.sqrt(np.diag(np.asarray(w_cov))) / sd - 1))
            print(
                f"{type(server).__name__} rounds={rounds} seed={seed}: E[tau] {tau_error:+.4f} "
                f"shape {shape_error:+.4f} w mean/sd {mean_error:.4f} w sd {sd_error:.4f}",
                flush=True,
            )


if __name__ == "__main__":
    halfnormal() if sys.argv[1:] == ["halfnormal"] else main()
