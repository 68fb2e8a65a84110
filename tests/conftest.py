"""Shared models and data for the tests: small, seeded, deterministic."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

import numpyro_pvi as pvi

numpyro.set_platform("cpu")

NOISE = 0.5  # known noise sd of the linear-regression model


def linear_model(X, y=None):
    """Bayesian linear regression with known noise: conjugate, so the exact posterior is known."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, NOISE), obs=y)


def logistic_model(X, y=None):
    """Bayesian logistic regression with an intercept."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def scale_model(X, y=None):
    """Linear regression with an unknown noise scale: a constrained global site with a non-Gaussian prior.

    "w" comes before "sigma" in the model, the reverse of sorted order: PVI's flat vector keeps model order.
    """
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def normal_gamma_model(X, y=None):
    """Linear regression with an unknown noise precision: w ~ N(0, 4 I), tau ~ Gamma(2, 1) (conjugate per block)."""
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
    tau = numpyro.sample("tau", dist.Gamma(2.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0 / jnp.sqrt(tau)), obs=y)


def normal_gamma_vb(X, y, iters=200):
    """Coordinate-ascent mean-field VB for w ~ N(0, 4 I), tau ~ Gamma(2, 1), y ~ N(X w, 1 / tau)."""
    X, y = np.asarray(X, np.float64), np.asarray(y, np.float64)
    a = 2.0 + 0.5 * len(y)
    e_tau = 1.0
    for _ in range(iters):
        cov = np.linalg.inv(e_tau * X.T @ X + np.eye(2) / 4.0)
        mean = cov @ (e_tau * X.T @ y)
        b = 1.0 + 0.5 * (np.sum((y - X @ mean) ** 2) + np.trace(X.T @ X @ cov))
        e_tau = a / b
    return mean, cov, a, b


def exact_linear_posterior(X, y):
    """Mean and covariance of w under linear_model (prior N(0, I), noise NOISE)."""
    X, y = np.asarray(X, np.float64), np.asarray(y, np.float64)
    precision = np.eye(X.shape[1]) + X.T @ X / NOISE**2
    cov = np.linalg.inv(precision)
    return cov @ X.T @ y / NOISE**2, cov


@pytest.fixture(scope="session")
def linear_data():
    X = random.normal(random.PRNGKey(0), (300, 3))
    y = X @ jnp.array([1.0, -0.5, 0.3]) + NOISE * random.normal(random.PRNGKey(1), (300,))
    return X, y


@pytest.fixture(scope="session")
def logistic_data():
    X = random.normal(random.PRNGKey(2), (400, 3))
    logits = X @ jnp.array([1.5, -1.0, 0.5]) - 0.3
    y = random.bernoulli(random.PRNGKey(3), jax.nn.sigmoid(logits)).astype(jnp.float32)
    return X, y


def assert_checkpoint_resumes(inference, result, path):
    """Save ``result``, load it back (identical state) and take one more round from both: identical ``q``."""
    pvi.save(result, path)
    loaded = pvi.load(path, inference, result.problem)
    for a, b in zip(jax.tree.leaves(result.state), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(a, b)
    resumed, _ = inference.update(loaded, result.problem)
    direct, _ = inference.update(result.state, result.problem)
    for a, b in zip(jax.tree.leaves(resumed.q), jax.tree.leaves(direct.q)):
        np.testing.assert_array_equal(a, b)
