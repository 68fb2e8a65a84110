"""Monte Carlo spread of the Normal-Gamma SiteFamilies fixed point (the tolerances of tests/test_site_families.py).

Linear regression with unknown noise precision, ``SiteFamilies({"w": FullRankGaussian(), "tau": Gamma()})``
and CVI with 512 particles, over seeds and servers; prints each run's relative errors against the closed-form
mean-field VB solution (coordinate ascent).

    python benchmarks/families_mc_spread.py
"""

import sys

import jax.numpy as jnp
import numpy as np
from jax import random

import numpyro_pvi as pvi

sys.path.insert(0, "tests")
from test_site_families import PARTS, N, normal_gamma_model, normal_gamma_vb  # noqa: E402


def main() -> None:
    X = random.normal(random.PRNGKey(4), (N, 2))
    y = X @ jnp.array([1.0, -0.5]) + 0.7 * random.normal(random.PRNGKey(5), (N,))
    mean, cov, a, b = normal_gamma_vb(X, y)
    sd = np.sqrt(np.diag(cov))
    for server, rounds in [(pvi.Sequential(), 8), (pvi.Synchronous(1.0), 12), (pvi.Synchronous(1.0), 30)]:
        family = pvi.SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})
        inference = pvi.PVI(normal_gamma_model, family, partitions=PARTS, server=server,
                            local_update=pvi.NaturalGradientUpdate(step_size=1.0, num_particles=512))
        for seed in range(5):
            result = inference.run(random.PRNGKey(seed), rounds, X, y=y, progress_bar=False)
            w_block, tau_block = family.split(result.state.q)
            shape, rate = pvi.Gamma().to_params(tau_block)
            w_mean, w_cov = pvi.FullRankGaussian().moments(w_block)
            tau_error, shape_error = float(shape[0] / rate[0]) / (a / b) - 1, float(shape[0]) / a - 1
            mean_error = np.max(np.abs(np.asarray(w_mean) - mean) / sd)
            sd_error = np.max(np.abs(np.sqrt(np.diag(np.asarray(w_cov))) / sd - 1))
            print(f"{type(server).__name__} rounds={rounds} seed={seed}: E[tau] {tau_error:+.4f} "
                  f"shape {shape_error:+.4f} "
                  f"w mean/sd {mean_error:.4f} w sd {sd_error:.4f}", flush=True)


if __name__ == "__main__":
    main()
