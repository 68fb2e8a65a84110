"""Mean-field EP's fixed point on correlated posteriors, in closed form, and the rule that flags it.

Linear-Gaussian models (``y = X w + noise``, noise variance 4, prior ``N(0, I)``, N = 600) whose
features are correlated (``equi5``: 5 features, every pair ``rho``; ``pair2``: 2 features;
``block4``: two pairs, ``rho`` and ``rho / 2``), split into M iid clients, or (M = 5) sorted by the
first feature into clients of 40/25/15/12/8 %. Mean-field EP is iterated to its fixed point exactly
(every tilted distribution is Gaussian). For each case: how far its sds are from the posterior's
(``e_post``) and from the mean-field VI optimum's (``e_vi``, ``1 / sqrt`` of the precision's
diagonal), and ``M (v - 1)`` with ``v`` the clients' mean variance inflation of their tilted
distributions at the fixed point (what ``MomentMatchingUpdate`` / ``SNEPUpdate`` report as
``ClientResult.inflation``;
:data:`numpyro_pvi.server.monitor.CORRELATED` flags ``M (v - 1) > 0.2``).

    python benchmarks/mean_field_ep.py
"""

from __future__ import annotations

from itertools import product

import numpy as np

THRESHOLD = 0.2  # numpyro_pvi.server.monitor.CORRELATED
SKEWED = np.array([0.4, 0.25, 0.15, 0.12, 0.08])


def fixed_point(parts: list, noise_var: float, prior: np.ndarray, iters: int = 500) -> tuple:
    """Mean-field EP's sds and each client's tilted variance inflation at its fixed point (damped
    0.5)."""
    curv = [x.T @ x / noise_var for x in parts]
    sites = [np.diag(a).copy() for a in curv]
    for _ in range(iters):
        q = prior + sum(sites)
        new = [
            1 / np.diag(np.linalg.inv(np.diag(q - s) + a)) - (q - s) for s, a in zip(sites, curv)
        ]
        sites = [0.5 * s + 0.5 * n for s, n in zip(sites, new)]
    q = prior + sum(sites)
    inflation = []
    for s, a in zip(sites, curv):
        precision = np.diag(q - s) + a
        inflation.append(np.max(np.diag(np.linalg.inv(precision)) * np.diag(precision)))
    return 1 / np.sqrt(q), np.array(inflation)


def features(design: str, rho: float) -> np.ndarray:
    if design == "equi5":
        return rho * np.ones((5, 5)) + (1 - rho) * np.eye(5)
    if design == "pair2":
        return np.array([[1.0, rho], [rho, 1.0]])
    cov = np.eye(4)
    cov[0, 1] = cov[1, 0] = rho
    cov[2, 3] = cov[3, 2] = rho / 2
    return cov


def main() -> None:
    rng, rows = np.random.default_rng(1), []
    for design, rho, m, skewed in product(
        ["equi5", "pair2", "block4"],
        [0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 0.95],
        [2, 3, 5, 10, 20],
        [False, True],
    ):
        if skewed and m != 5:
            continue
        cov = features(design, rho)
        x = rng.multivariate_normal(np.zeros(len(cov)), cov, 600)
        if skewed:
            x = x[np.argsort(x[:, 0])]
            parts = np.split(x, np.cumsum((SKEWED * 600).astype(int))[:-1])
        else:
            parts = np.array_split(x, m)
        precision = np.eye(len(cov)) + x.T @ x / 4.0
        sd, inflation = fixed_point(parts, 4.0, np.ones(len(cov)))
        e_post = np.max(np.abs(sd / np.sqrt(np.diag(np.linalg.inv(precision))) - 1))
        e_vi = np.max(np.abs(sd * np.sqrt(np.diag(precision)) - 1))
        rows.append((design, rho, m, skewed, e_post, e_vi, m * (inflation.mean() - 1)))
    print(
        f"{'design':7s} {'rho':>5s} {'M':>3s} {'split':7s} {'e_post':>7s} {'e_vi':>6s} "
        f"{'M(v-1)':>7s} flagged"
    )
    for design, rho, m, skewed, e_post, e_vi, score in rows:
        print(
            f"{design:7s} {rho:5.2f} {m:3d} {'skewed' if skewed else 'iid':7s} {e_post:7.3f} "
            f"{e_vi:6.3f} {score:7.3f} {'yes' if score > THRESHOLD else ''}"
        )
    worst = np.array([min(r[4], r[5]) for r in rows])
    score = np.array([r[6] for r in rows])
    flagged = score > THRESHOLD
    print(
        f"\n{len(rows)} cases; flagged {flagged.sum()}. Distance to the nearer of the two "
        "(posterior, VI):"
    )
    print(
        f"  not flagged: at most {worst[~flagged].max():.3f}; flagged: at least "
        f"{worst[flagged].min():.3f}"
    )
    print(
        f"  cases more than 10 % from both: {np.sum(worst > 0.1)}, of them flagged "
        f"{np.sum(flagged & (worst > 0.1))}"
    )


if __name__ == "__main__":
    main()
