"""The figure of docs/families.md: a Poisson rate's posterior under a Gamma family and a Gaussian in
log space.

Poisson counts (few, small: where the posterior is skewed) with a Gamma(2, 0.5) prior on the rate,
five uneven clients. ``pvi.Gamma()`` with one synchronous CVI round of step 1 gives the exact Gamma
posterior; ``pvi.MeanFieldGaussian()`` (a Gaussian over ``log rate``, i.e. a log-normal ``q``)
reaches its own fixed point in a few rounds and misses the exact posterior's shape. Prints each
one's mean, sd and KL from the exact posterior (Monte Carlo, 200k draws) and writes the PNG.

    python benchmarks/families_figure.py docs/images/families_poisson_rate.png
"""

import sys

import jax.numpy as jnp
import matplotlib
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random

import numpyro_pvi as pvi

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SIZES = [1, 1, 2, 2, 3]
N = sum(SIZES)
PARTS = np.split(np.arange(N), np.cumsum(SIZES)[:-1])


def model(y=None):
    rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
    with pvi.partition_plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(rate), obs=y)


def fit(family, rounds):
    inference = pvi.PVI(
        model,
        family,
        partitions=PARTS,
        server=pvi.Synchronous(1.0),
        local_update=pvi.NaturalGradientUpdate(step_size=1.0, num_particles=64),
    )
    return inference.run(random.PRNGKey(1), rounds, y=Y, progress_bar=False)


Y = jnp.array([0.0, 1.0, 0.0, 2.0, 0.0, 1.0, 0.0, 0.0, 1.0])


def main(path: str) -> None:
    exact = dist.Gamma(2.0 + float(Y.sum()), 0.5 + N)
    gamma_q = fit(pvi.Gamma(), 1)
    gauss_q = fit(pvi.MeanFieldGaussian(), 20)
    draws = {
        "Gamma family (1 round)": gamma_q.sample_posterior(random.PRNGKey(2), 200_000)["rate"],
        "Gaussian in log space (20 rounds)": gauss_q.sample_posterior(random.PRNGKey(2), 200_000)[
            "rate"
        ],
    }
    grid = np.linspace(1e-3, 2.5, 500)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(
        grid, np.exp(exact.log_prob(grid)), "k", lw=3, alpha=0.35, label="exact Gamma posterior"
    )
    shape, rate = pvi.Gamma().to_params(gamma_q.state.q)
    ax.plot(grid, np.exp(dist.Gamma(shape[0], rate[0]).log_prob(grid)), "C0--", label="pvi.Gamma()")
    loc, scale = pvi.MeanFieldGaussian().loc_scale(gauss_q.state.q)
    ax.plot(
        grid,
        np.exp(dist.LogNormal(loc[0], scale[0]).log_prob(grid)),
        "C3",
        label="pvi.MeanFieldGaussian()",
    )
    for label, x in draws.items():
        kl = float(jnp.mean(_log_q(label, gamma_q, gauss_q, x) - exact.log_prob(x)))
        print(
            f"{label}: mean {float(x.mean()):.4f} sd {float(x.std()):.4f} KL(q || exact) {kl:.4f} "
            f"(exact mean {float(exact.mean):.4f} sd {float(jnp.sqrt(exact.variance)):.4f})"
        )
    ax.set_xlabel("Poisson rate")
    ax.set_ylabel("density")
    ax.set_title(f"Posterior of a Poisson rate ({N} counts, 5 clients)")
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def _log_q(label, gamma_q, gauss_q, x):
    if label.startswith("Gamma"):
        shape, rate = pvi.Gamma().to_params(gamma_q.state.q)
        return dist.Gamma(shape[0], rate[0]).log_prob(x)
    loc, scale = pvi.MeanFieldGaussian().loc_scale(gauss_q.state.q)
    return dist.LogNormal(loc[0], scale[0]).log_prob(x)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "families_poisson_rate.png")
