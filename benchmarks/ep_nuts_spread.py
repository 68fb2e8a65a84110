"""Monte Carlo spread of ``MomentMatchingUpdate(tilted=pvi.NUTSMoments(...))`` on the families
beyond one Gaussian.

EP is exact for the conjugate models (the tilted distribution is in the family), and with one client
its fixed point is the exact posterior moment-matched block by block, so every error below is the
NUTS estimate's. Prints, over seeds, the worst errors that
``tests/local_updates/test_moment_matching.py``'s
tilted-NUTS tests bound (at about 3x).

    python benchmarks/ep_nuts_spread.py [num_seeds]
"""

import sys
from pathlib import Path

import numpy as np
from jax import random

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import numpyro_pvi as pvi  # noqa: E402

import models as ref  # noqa: E402

UPDATE = pvi.MomentMatchingUpdate(
    tilted=pvi.NUTSMoments(num_samples=400, num_warmup=200, num_chains=2)
)


def main(num_seeds: int = 5) -> None:
    y, cat, (X, y_ng) = ref.poisson_data(), ref.categorical_data(), ref.normal_gamma_data()
    reference = ref.normal_gamma_ep(X, y_ng)
    runs = {
        "poisson-gamma, 5 clients, 2 sequential rounds": (
            ref.poisson_pvi(pvi.Sequential(), update=UPDATE),
            dict(y=y),
            lambda q: ref.gamma_errors(q, y),
        ),
        "dirichlet-categorical, 5 clients, 2 synchronous rounds": (
            ref.categorical_pvi(UPDATE),
            dict(y=cat),
            lambda q: ref.dirichlet_errors(q, cat),
        ),
    }
    for name, (inference, data, errors) in runs.items():
        worst = np.max(
            [
                errors(inference.run(random.PRNGKey(s), 2, progress_bar=False, **data).state.q)
                for s in range(num_seeds)
            ],
            axis=0,
        )
        print(
            f"{name}: |mean error| <= {worst[0]:.5f} sd, |sd ratio - 1| <= {100 * worst[1]:.2f} %"
        )
    inference = ref.normal_gamma_pvi(UPDATE)
    runs = [
        inference.run(random.PRNGKey(s), 2, X, y=y_ng, progress_bar=False) for s in range(num_seeds)
    ]
    worst = np.max([ref.ng_errors(run.family, run.state.q, reference) for run in runs], axis=0)
    print(
        f"SiteFamilies w (FullRank) + tau (Gamma), 1 client, 2 rounds: w mean <= {worst[0]:.4f} "
        f"sd, w sds <= {100 * worst[1]:.2f} %, tau mean <= {100 * worst[2]:.2f} %, tau sd <= "
        f"{100 * worst[3]:.2f} %"
    )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
