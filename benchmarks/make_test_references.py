"""Write ``tests/references.py``: the NUTS and SVI references of the test suite, computed once,
stored as constants.

    python benchmarks/make_test_references.py      # a few minutes on 2 cores; rewrites
    tests/references.py

NUTS references are the mean and sd of long seeded runs (4 chains of 1,000 warmup + 10,000 draws,
keys 0-3), in PVI's flat unconstrained space; the printed ESS and split R-hat say how precise each
constant is (the tests' tolerances are far wider than its Monte Carlo error). SVI references are
NumPyro SVI's optima with the seeds and settings the tests used when they ran SVI themselves (their
tolerances were measured against these very runs).
"""

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from jax import enable_x64, random
from jax.scipy.optimize import minimize
from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO, TraceMeanField_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal, AutoMultivariateNormal, AutoNormal
from sklearn.datasets import load_breast_cancer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from models import (  # noqa: E402
    intercept_model,
    logistic_model,
    make_heavy_tailed_data,
    make_intercept_data,
    make_linear_data,
    make_logistic_data,
    make_nb_data,
    make_skewed_logistic_data,
    nb_fixed_model,
    nb_model,
    robust_model,
    scale_model,
)

NUM_CHAINS, NUM_WARMUP, NUM_SAMPLES = 4, 1000, 10_000


def nuts_flat(model, flatten, *args, **kwargs):
    """Draws of ``model``'s posterior in PVI's flat unconstrained space, ``(chains, draws,
    dim)``."""
    chains = []
    for chain in range(NUM_CHAINS):
        mcmc = MCMC(NUTS(model), num_warmup=NUM_WARMUP, num_samples=NUM_SAMPLES, progress_bar=False)
        mcmc.run(random.PRNGKey(chain), *args, **kwargs)
        chains.append(flatten(mcmc.get_samples()))
    draws = np.stack(chains)
    ess, rhat = effective_sample_size(draws), split_gelman_rubin(draws)
    print(f"{model.__name__}: min ESS {ess.min():.0f}, max split R-hat {rhat.max():.4f}")
    flat = draws.reshape(-1, draws.shape[-1])
    return flat.mean(0), flat.std(0), float(ess.min())


def svi_moments(model, guide_class, data, num_steps=6000, seed=0):
    """Mean and covariance of NumPyro SVI's optimum, reordered to PVI's flat (model) order."""
    X, y = data
    guide = guide_class(model)
    optim = optax.adam(optax.exponential_decay(2e-2, num_steps, 0.02))
    svi = SVI(model, guide, optim, TraceMeanField_ELBO(num_particles=8))
    params = svi.run(random.PRNGKey(seed), num_steps, X, y=y, progress_bar=False).params
    loc = params["auto_loc"]
    L = params["auto_scale_tril"] if "auto_scale_tril" in params else jnp.diag(params["auto_scale"])
    # AutoContinuous packs sites in sorted order; PVI keeps model order: map one to the other.
    unpacked = guide._unpack_latent(jnp.arange(loc.shape[0], dtype=jnp.float32))
    trace = numpyro.handlers.trace(numpyro.handlers.seed(model, 0)).get_trace(X, y=y)
    names = [n for n, site in trace.items() if site["type"] == "sample" and not site["is_observed"]]
    order = np.concatenate([np.asarray(unpacked[name]).reshape(-1) for name in names]).astype(int)
    cov = L @ L.T
    return np.asarray(loc)[order], np.asarray(cov)[np.ix_(order, order)]


def online_vi(X, y, tasks):
    """Online VI by hand: SVI (AutoNormal, 4,000 steps, key 10 + t) on each task with the last
    posterior as prior."""

    def task_model(X, y, loc, scale):
        w = numpyro.sample("w", dist.Normal(loc[:3], scale[:3]).to_event(1))
        b = numpyro.sample("b", dist.Normal(loc[3], scale[3]))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)

    loc, scale = jnp.zeros(4), jnp.ones(4)
    for t, rows in enumerate(tasks):
        optim = optax.adam(optax.exponential_decay(2e-2, 4000, 0.02))
        svi = SVI(task_model, AutoNormal(task_model), optim, TraceMeanField_ELBO(num_particles=8))
        p = svi.run(
            random.PRNGKey(10 + t), 4000, X[rows], y[rows], loc, scale, progress_bar=False
        ).params
        loc = jnp.concatenate([p["w_auto_loc"], p["b_auto_loc"][None]])
        scale = jnp.concatenate([p["w_auto_scale"], p["b_auto_scale"][None]])
    return loc, scale


def breast_cancer_mean_field_vi():
    """Mean-field VI's optimum (means, sds) for Bayesian logistic regression (N(0, 1) priors, an
    intercept last) on sklearn's breast cancer data, standardised, deterministic: the expectations
    by 64-point Gauss-Hermite quadrature of the 1-D linear predictor, BFGS in float64
    (test_heavy_ball's reference)."""
    X, y = load_breast_cancer(return_X_y=True)
    X, y = ((X - X.mean(0)) / X.std(0)).astype(np.float32), y.astype(np.float32)
    with enable_x64(True):
        Xb = jnp.asarray(np.concatenate([X, np.ones((len(X), 1))], 1), jnp.float64)
        nodes, weights = np.polynomial.hermite_e.hermegauss(64)
        sign, d = 2.0 * jnp.asarray(y, jnp.float64) - 1.0, Xb.shape[1]

        def negative_elbo(p):
            mu, log_sd = p[:d], p[d:]
            var = jnp.exp(2 * log_sd)
            f = (Xb @ mu)[:, None] + jnp.sqrt((Xb**2) @ var)[:, None] * nodes[None]
            loglik = jnp.sum(
                jnp.log(jnp.exp(-jnp.logaddexp(0.0, -sign[:, None] * f)))
                @ (weights / weights.sum())
            )
            return -(loglik - 0.5 * jnp.sum(var + mu**2 - 1 - 2 * log_sd))

        out = minimize(negative_elbo, jnp.concatenate([jnp.zeros(d), -jnp.ones(d)]), method="BFGS")
        return np.asarray(out.x[:d]), np.exp(np.asarray(out.x[d:]))


def intercept_svi():
    """NumPyro SVI (AutoNormal, TraceMeanField_ELBO(8), Adam 2e-2 decayed to 2 % over 6,000 steps,
    key 0) on ``intercept_model``: test_local_latents's reference for the globals and every group's
    intercept."""
    x, y = make_intercept_data()
    optim = optax.adam(optax.exponential_decay(2e-2, 6000, 0.02))
    svi = SVI(
        intercept_model, AutoNormal(intercept_model), optim, TraceMeanField_ELBO(num_particles=8)
    )
    return svi.run(random.PRNGKey(0), 6000, x, y=y, progress_bar=False).params


def skewed_logistic_references():
    """test_moment_matching's references on ``make_skewed_logistic_data()``, as that test computed
    them when its tolerances were measured: NUTS (one chain, 500 warmup + 10,000 draws, key 0) and
    global VI (AutoMultivariateNormal, Trace_ELBO(8), Adam 1e-2 decayed to 5 % over 4,000 steps, key
    1); each the mean and covariance of (w[0], w[1], b)."""
    X, y = make_skewed_logistic_data()
    mcmc = MCMC(NUTS(logistic_model), num_warmup=500, num_samples=10_000, progress_bar=False)
    mcmc.run(random.PRNGKey(0), X, y=y)
    samples = mcmc.get_samples()
    z = np.concatenate([samples["w"], samples["b"][:, None]], axis=1)
    guide = AutoMultivariateNormal(logistic_model)
    svi = SVI(
        logistic_model, guide, optax.adam(optax.exponential_decay(1e-2, 4000, 0.05)), Trace_ELBO(8)
    )
    params = svi.run(random.PRNGKey(1), 4000, X, y=y, progress_bar=False).params
    order = guide._unpack_latent(jnp.arange(3.0))
    perm = np.concatenate([np.atleast_1d(order["w"]), np.atleast_1d(order["b"])]).astype(int)
    scale_tril = np.asarray(params["auto_scale_tril"])
    vi_cov = (scale_tril @ scale_tril.T)[np.ix_(perm, perm)]
    return z.mean(0), np.cov(z.T), np.asarray(params["auto_loc"])[perm], vi_cov


def wide_prior_references():
    """test_wide_prior's NUTS references on ``make_nb_data()``, as that test computed them when its
    tolerances were measured (one chain, 500 warmup + 500 draws, key 0): the mean and sd of (b, w,
    log phi) for ``nb_model`` and of (b, w) for ``nb_fixed_model``."""
    X, y = make_nb_data()
    out = []
    for model in (nb_model, nb_fixed_model):
        mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=500, progress_bar=False)
        mcmc.run(random.PRNGKey(0), X, y=y)
        s = mcmc.get_samples()
        z = np.concatenate(
            [s["b"][:, None], s["w"]] + ([np.log(s["phi"])[:, None]] if "phi" in s else []), axis=1
        )
        out.append((z.mean(0), z.std(0, ddof=1)))
    return out


def references_the_tests_computed():
    """The constants of ``skewed_logistic_references`` and ``wide_prior_references``."""
    skewed = skewed_logistic_references()
    (nb_mean, nb_sd), (fixed_mean, fixed_sd) = wide_prior_references()
    return (
        "\n# logistic_model on make_skewed_logistic_data(), (w[0], w[1], b): NUTS (one chain, 500 "
        "warmup +\n# 10,000 draws, key 0) and global VI (AutoMultivariateNormal, Trace_ELBO(8), "
        "Adam 1e-2 decayed to\n# 5 % over 4,000 steps, key 1), each a mean and a covariance\n"
        + constant("SKEWED_LOGISTIC_NUTS_MEAN", skewed[0])
        + constant("SKEWED_LOGISTIC_NUTS_COV", skewed[1])
        + constant("SKEWED_LOGISTIC_VI_MEAN", skewed[2])
        + constant("SKEWED_LOGISTIC_VI_COV", skewed[3])
        + "\n# NUTS on make_nb_data() (one chain, 500 warmup + 500 draws, key 0): the mean and sd "
        "of\n# (b, w[0..2], log phi) for nb_model and of (b, w[0..2]) for nb_fixed_model\n"
        + constant("NB_MODEL_NUTS_MEAN", nb_mean)
        + constant("NB_MODEL_NUTS_SD", nb_sd)
        + constant("NB_FIXED_MODEL_NUTS_MEAN", fixed_mean)
        + constant("NB_FIXED_MODEL_NUTS_SD", fixed_sd)
    )


def constant(name, values):
    """``NAME = np.array([...])`` with 7 significant digits, at most 6 numbers a line."""
    values = np.asarray(values, np.float64)

    def row(r):
        chunks = [", ".join(f"{v:.7g}" for v in r[i : i + 6]) for i in range(0, len(r), 6)]
        return "[" + ",\n     ".join(chunks) + "]"

    body = row(values) if values.ndim == 1 else "[" + ",\n     ".join(row(r) for r in values) + "]"
    return f"{name} = np.array({body})\n"


def entry(key, value):
    """One ``"key": np.array([...]),`` line of a dict constant (a scalar as
    ``np.array([x])[0]``)."""
    array = (
        constant("", np.ravel(value)).split("= ", 1)[1].replace("\n     ", "\n" + " " * 9).rstrip()
    )
    return f'    "{key}": {array}' + ("[0],\n" if np.ndim(value) == 0 else ",\n")


def main():
    X, y = make_linear_data()
    scale = nuts_flat(
        scale_model, lambda s: np.concatenate([s["w"], np.log(s["sigma"])[:, None]], 1), X, y=y
    )
    Xh, yh = make_heavy_tailed_data()
    robust = nuts_flat(robust_model, lambda s: np.asarray(s["w"]), Xh, y=yh)
    logistic = make_logistic_data()
    mf = svi_moments(logistic_model, AutoDiagonalNormal, logistic)
    fr = svi_moments(logistic_model, AutoMultivariateNormal, logistic)
    breast_cancer = breast_cancer_mean_field_vi()
    intercept = intercept_svi()
    online = online_vi(*logistic, [np.arange(0, 100), np.arange(100, 250), np.arange(250, 400)])
    text = (
        '"""NUTS, SVI and VI references of the tests, written by ``python '
        "benchmarks/make_test_references.py``\n"
        "(do not edit); each constant's comment says how it was computed.\n\n"
        f"NUTS: the mean and sd over {NUM_CHAINS} chains (keys 0-{NUM_CHAINS - 1}) of "
        f"{NUM_WARMUP} warmup "
        f"+ {NUM_SAMPLES} draws (float32, as the tests),\n"
        "in PVI's flat unconstrained space; ESS is the smallest over coordinates "
        "(the means' MC error is sd / sqrt(ESS)).\n"
        '"""\n\nimport numpy as np\n\n'
        "# scale_model on make_linear_data(): (w[0], w[1], w[2], log sigma)\n"
        + constant("SCALE_MODEL_MEAN", scale[0])
        + constant("SCALE_MODEL_SD", scale[1])
        + f"SCALE_MODEL_ESS = {scale[2]:.0f}\n\n# robust_model (Cauchy noise) on "
        "make_heavy_tailed_data(): (w[0], w[1])\n"
        + constant("ROBUST_MODEL_MEAN", robust[0])
        + constant("ROBUST_MODEL_SD", robust[1])
        + f"ROBUST_MODEL_ESS = {robust[2]:.0f}\n\n# NumPyro SVI on logistic_model and "
        "make_logistic_data() (TraceMeanField_ELBO(8), Adam 2e-2 decayed\n# to 2 % over 6,000 "
        "steps, key 0), in PVI's flat order (w[0], w[1], w[2], b):\n# AutoDiagonalNormal's and "
        "AutoMultivariateNormal's mean and covariance\n"
        + constant("SVI_LOGISTIC_MEAN_FIELD_MEAN", mf[0])
        + constant("SVI_LOGISTIC_MEAN_FIELD_COV", mf[1])
        + constant("SVI_LOGISTIC_FULL_RANK_MEAN", fr[0])
        + constant("SVI_LOGISTIC_FULL_RANK_COV", fr[1])
        + "\n# online VI by hand on make_logistic_data()'s rows 0-99, 100-249, 250-399 "
        "(AutoNormal, 4,000 steps per task,\n# keys 10, 11, 12): the final (w[0], w[1], w[2], "
        "b) means and sds\n"
        + constant("ONLINE_VI_LOGISTIC_LOC", online[0])
        + constant("ONLINE_VI_LOGISTIC_SCALE", online[1])
        + "\n# global mean-field VI's optimum on sklearn's breast cancer data, standardised (30 "
        "weights, then the\n# intercept): 64-point Gauss-Hermite expectations, BFGS in float64 "
        "(deterministic)\n"
        + constant("BREAST_CANCER_MEAN_FIELD_VI_MEAN", breast_cancer[0])
        + constant("BREAST_CANCER_MEAN_FIELD_VI_SD", breast_cancer[1])
        + "\n# NumPyro SVI on intercept_model and make_intercept_data() (AutoNormal, "
        "TraceMeanField_ELBO(8), Adam 2e-2\n# decayed to 2 % over 6,000 steps, key 0): its "
        "parameters (b, w scalars; u per group)\nINTERCEPT_SVI_AUTONORMAL = {\n"
        + "".join(entry(k, v) for k, v in sorted(intercept.items()))
        + "}\n"
        + references_the_tests_computed()
    )
    (ROOT / "tests" / "references.py").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
