"""Shared fixtures of the tests: small, seeded, deterministic data built once per session.

Shared models and exact references live in ``tests/models.py``, fake local updates in ``tests/fakes.py``; tests
import them from there. The names below are re-exported for the test files that still import them from conftest.
"""

import jax
import jax.numpy as jnp
import numpyro
import pytest
from jax import random

from fakes import (  # noqa: F401  (re-exported)
    UNEQUAL,
    ExactLinearUpdate,
    FaultyUpdate,
    PoisonedUpdate,
    assert_checkpoint_resumes,
)
from models import (  # noqa: F401  (re-exported)
    CONCENTRATION,
    EP_N,
    EP_PARTS,
    EP_SIZES,
    NOISE,
    bernoulli_model,
    categorical_data,
    categorical_model,
    categorical_pvi,
    dirichlet_errors,
    exact_linear_posterior,
    linear_model,
    logistic_model,
    ng_errors,
    noise_model,
    normal_gamma_data,
    normal_gamma_ep,
    normal_gamma_model,
    normal_gamma_pvi,
    normal_gamma_vb,
    poisson_model,
    robust_model,
    scale_model,
    type_ii_ml_sigma,
)

numpyro.set_platform("cpu")


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
