"""Monte Carlo spread of ``SNEPUpdate`` in mean parameters (the tolerances of
tests/local_updates/test_snep_blocks.py).

Runs each test's configuration over seeds and prints its errors against the exact references: the
exact conjugate posteriors (Poisson-Gamma, Dirichlet-categorical; 5 uneven clients, 3 rounds) and
the moment match of the exact Normal-Gamma posterior onto ``SiteFamilies({"w": FullRankGaussian(),
"tau": Gamma()})`` (one client, 2 rounds). The last line of each configuration is the worst case
over the seeds.

    python benchmarks/snep_mc_spread.py            # seeds 0-4, the defaults
    python benchmarks/snep_mc_spread.py 10         # seeds 0-9
    python benchmarks/snep_mc_spread.py 5 plain    # control_variates=False, num_chains=32
"""

import sys
from pathlib import Path

import numpy as np
from jax import random

import numpyro_pvi as pvi

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import (  # noqa: E402
    categorical_data,
    categorical_pvi,
    dirichlet_errors,
    gamma_errors,
    ng_errors,
    normal_gamma_data,
    normal_gamma_ep,
    normal_gamma_pvi,
    poisson_data,
    poisson_pvi,
)


def spread(name: str, labels: tuple, run, num_seeds: int) -> None:
    """Print ``run(seed)``'s errors for every seed and their worst case."""
    rows = []
    for seed in range(num_seeds):
        rows.append(run(seed))
        print(
            f"{name} seed={seed}: " + " ".join(f"{k} {v:.4f}" for k, v in zip(labels, rows[-1])),
            flush=True,
        )
    print(
        f"{name} worst:  " + " ".join(f"{k} {v:.4f}" for k, v in zip(labels, np.max(rows, axis=0))),
        flush=True,
    )


def _family_and_q(result) -> tuple:
    """The run's laid-out family and its ``q``."""
    return result.family, result.state.q


def main(num_seeds: int = 5, plain: bool = False) -> None:
    y = poisson_data()
    labels = ("mean/sd", "sd")
    update = pvi.SNEPUpdate(control_variates=False, num_chains=32) if plain else pvi.SNEPUpdate()
    for name, inference in [
        ("gamma sequential vmap", poisson_pvi(pvi.Sequential(), update=update)),
        ("gamma synchronous loop", poisson_pvi(pvi.Synchronous(1.0), "loop", update)),
    ]:
        spread(
            name,
            labels,
            lambda seed, inference=inference: gamma_errors(
                inference.run(random.PRNGKey(seed), 3, y=y, progress_bar=False).state.q, y
            ),
            num_seeds,
        )
    yc, inference = categorical_data(), categorical_pvi(update)
    spread(
        "dirichlet synchronous",
        labels,
        lambda seed: dirichlet_errors(
            inference.run(random.PRNGKey(seed), 3, y=yc, progress_bar=False).state.q, yc
        ),
        num_seeds,
    )
    X, yn = normal_gamma_data()
    reference, inference = normal_gamma_ep(X, yn), normal_gamma_pvi(update)
    spread(
        "site families one client",
        ("w mean/sd", "w sd", "tau mean", "tau sd"),
        lambda seed: ng_errors(
            *_family_and_q(inference.run(random.PRNGKey(seed), 2, X, y=yn, progress_bar=False)),
            reference,
        ),
        num_seeds,
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, sys.argv[2:] == ["plain"])
