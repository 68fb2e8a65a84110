"""Synchronous mean-field PVI on a correlated posterior: rounds to global VI's optimum, and why.

Breast-cancer logistic regression (30 standardised, strongly correlated features and an intercept),
mean-field factors, 10 iid clients, ``NaturalGradientUpdate(step_size=0.5, num_steps=10,
num_particles=64)``. Global VI's optimum is computed deterministically: the ELBO's expectations by
64-point Gauss-Hermite quadrature of the 1-D linear predictor, maximised by BFGS in float64. The
error of a run is the largest distance of a mean from that optimum, in optimum posterior sds.

Printed: the spectrum of the linearised synchronous round ``(D + O/M)^-1 Lambda`` (see
docs/servers/synchronous.md), then per method the error after every round and the first round within
0.2 sd: ``Sequential``, ``Synchronous`` with adaptive and fixed damping, and two accelerations
applied on top of the fixed-damping round through the public API: heavy-ball momentum on (q,
factors) and Anderson acceleration.

Run: ``python benchmarks/sync_correlated.py [num_rounds] [name words...]`` (about 2 minutes on 2
cores).
"""

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from jax.flatten_util import ravel_pytree
from jax.scipy.optimize import minimize
from sklearn.datasets import load_breast_cancer

import numpyro_pvi as pvi
from numpyro_pvi.server.merge import is_valid_state

warnings.simplefilter("ignore")
M, THRESHOLD = 10, 0.2
X, y = load_breast_cancer(return_X_y=True)
X = ((X - X.mean(0)) / X.std(0)).astype(np.float32)
y = y.astype(np.float32)


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def global_vi_optimum():
    """Mean-field VI's optimum (means, sds) in PVI's flat order (w, then b), deterministic."""
    with jax.enable_x64(True):
        Xb = jnp.asarray(np.concatenate([X, np.ones((len(X), 1))], 1), jnp.float64)
        nodes, weights = np.polynomial.hermite_e.hermegauss(64)
        weights = weights / weights.sum()
        sign = 2.0 * jnp.asarray(y, jnp.float64) - 1.0
        d = Xb.shape[1]

        def negative_elbo(p):
            mu, log_sd = p[:d], p[d:]
            var = jnp.exp(2 * log_sd)
            f = (Xb @ mu)[:, None] + jnp.sqrt((Xb**2) @ var)[:, None] * nodes[None]
            loglik = jnp.sum(jax.nn.log_sigmoid(sign[:, None] * f) @ weights)
            return -(loglik - 0.5 * jnp.sum(var + mu**2 - 1 - 2 * log_sd))

        out = minimize(negative_elbo, jnp.concatenate([jnp.zeros(d), -jnp.ones(d)]), method="BFGS")
        return np.asarray(out.x[:d]), np.exp(np.asarray(out.x[d:]))


def spectrum(mean):
    """Eigenvalues of the linearised synchronous round ``(D + O/M)^-1 Lambda`` at the optimum
    (Laplace curvature)."""
    Xb = np.concatenate([X, np.ones((len(X), 1))], 1).astype(np.float64)
    p = 1 / (1 + np.exp(-Xb @ mean))
    precision = Xb.T @ ((p * (1 - p))[:, None] * Xb) + np.eye(Xb.shape[1])
    diagonal = np.diag(np.diag(precision))
    return np.sort(
        np.linalg.eigvals(np.linalg.solve(diagonal + (precision - diagonal) / M, precision)).real
    )


def inference(server):
    update = pvi.NaturalGradientUpdate(step_size=0.5, num_steps=10, num_particles=64)
    return pvi.PVI(
        model, pvi.MeanFieldGaussian(), pvi.split_iid(random.PRNGKey(1), len(y), M), update, server
    )


def plain(server, rounds, error):
    infer = inference(server)
    problem = infer.build(X, y=y)
    state, errors = infer.init(random.PRNGKey(0), problem), []
    for _ in range(rounds):
        state, _ = infer.update(state, problem)
        errors.append(error(infer, state))
    return errors


def accelerated(rounds, error, combine):
    """A fixed-damping synchronous round ``G``, then ``combine(history of x, history of G(x))`` when
    valid."""
    infer = inference(pvi.Synchronous(0.5))
    problem = infer.build(X, y=y)
    state = infer.init(random.PRNGKey(0), problem)
    _, unravel = ravel_pytree((state.q, state.factors))
    xs, gs, errors = [], [], []
    for _ in range(rounds):
        new, _ = infer.update(state, problem)
        xs.append(ravel_pytree((state.q, state.factors))[0])
        gs.append(ravel_pytree((new.q, new.factors))[0])
        q, factors = unravel(combine(xs, gs))
        state = (
            new._replace(q=q, factors=factors)
            if bool(is_valid_state(infer.family, q, factors))
            else new
        )
        errors.append(error(infer, state))
    return errors


def heavy_ball(momentum):
    # x_{k+1} = G(x_k) + momentum * (x_k - x_{k-1})
    return lambda xs, gs: gs[-1] + (momentum * (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0)


def anderson(depth):
    def combine(xs, gs):
        xs, gs = xs[-(depth + 1) :], gs[-(depth + 1) :]
        if len(xs) < 2:
            return gs[-1]
        residuals = jnp.stack([g - x for g, x in zip(gs, xs)], 1)
        outputs = jnp.stack(gs, 1)
        gamma = jnp.linalg.lstsq(jnp.diff(residuals, axis=1), residuals[:, -1], rcond=1e-6)[0]
        return gs[-1] - jnp.diff(outputs, axis=1) @ gamma

    return combine


def main(rounds):
    mean, sd = global_vi_optimum()
    lam = spectrum(mean)
    best = 2 / (lam.max() + lam.min())
    print(
        f"spectrum of the linearised synchronous round: [{lam.min():.3f}, {lam.max():.2f}]; best "
        f"fixed damping {best:.2f} shrinks the error by {1 - best * lam.min():.3f} per round "
        f"({np.log(0.1) / np.log(1 - best * lam.min()):.0f} rounds per tenfold)"
    )

    def error(infer, state):
        return float(np.max(np.abs(np.asarray(infer.family.loc_scale(state.q)[0]) - mean) / sd))

    runs = {
        "Sequential()": lambda: plain(pvi.Sequential(), rounds, error),
        "Synchronous() = HeavyBall() (default)": lambda: plain(pvi.Synchronous(), rounds, error),
        "Synchronous(AdaptiveDamping())": lambda: plain(
            pvi.Synchronous(pvi.AdaptiveDamping()), rounds, error
        ),
        f"Synchronous({best:.2f})": lambda: plain(pvi.Synchronous(float(best)), rounds, error),
        "Synchronous(0.5)": lambda: plain(pvi.Synchronous(0.5), rounds, error),
        "Synchronous(0.5) + heavy ball 0.5": lambda: accelerated(rounds, error, heavy_ball(0.5)),
        "Synchronous(0.5) + Anderson(5)": lambda: accelerated(rounds, error, anderson(5)),
    }
    only = sys.argv[2:]  # names containing any of these words (all runs if none)
    for name, run in runs.items():
        if only and not any(word in name for word in only):
            continue
        errors = run()
        within = next((r + 1 for r, e in enumerate(errors) if e <= THRESHOLD), None)
        print(
            f"{name:36s} first round within {THRESHOLD} sd: {within}; error after rounds "
            f"10/20/{rounds}: {errors[9]:.2f} / {errors[19]:.2f} / {errors[-1]:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
