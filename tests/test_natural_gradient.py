"""``NaturalGradientUpdate`` (CVI): exact on a conjugate model, the global VI fixed point, safe steps."""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_pvi as pvi

from conftest import exact_linear_posterior, linear_model, logistic_model


@pytest.mark.parametrize("server", [pvi.Sequential(), pvi.Synchronous(1.0)], ids=["sequential", "synchronous"])
@pytest.mark.parametrize("num_clients", [1, 4])
def test_cvi_step_one_is_exact_after_one_round(linear_data, server, num_clients):
    X, y = linear_data
    mean, cov = exact_linear_posterior(X, y)
    partitions = pvi.split_iid(random.PRNGKey(num_clients), X.shape[0], num_clients)
    inference = pvi.PVI(linear_model, pvi.FullRankGaussian(), partitions, pvi.NaturalGradientUpdate(1.0), server)
    state = inference.run(random.PRNGKey(0), 1, X, y=y, progress_bar=False).state
    loc, scale_tril = inference.family.loc_scale(state.q)
    # Antithetic pairs make the Bonnet/Price estimates exact for a quadratic log-likelihood: only float32 error.
    np.testing.assert_allclose(loc, mean, atol=1e-5)
    np.testing.assert_allclose(scale_tril @ scale_tril.T, cov, atol=1e-6)


@pytest.mark.parametrize("family", [pvi.MeanFieldGaussian(), pvi.FullRankGaussian()], ids=["mean_field", "full_rank"])
def test_cvi_and_gradient_updates_share_the_fixed_point(logistic_data, family):
    X, y = logistic_data
    partitions = pvi.split_iid(random.PRNGKey(3), X.shape[0], 10)
    results = []
    for update in (pvi.NaturalGradientUpdate(0.5, num_steps=5, num_particles=64),
                   pvi.GradientUpdate(optax.adam(3e-2), num_steps=500, num_particles=8)):
        inference = pvi.PVI(logistic_model, family, partitions, update, pvi.Sequential())
        state = inference.run(random.PRNGKey(0), 4, X, y=y, progress_bar=False).state
        results.append(family.loc_scale(state.q))
    (loc_ng, scale_ng), (loc_gd, scale_gd) = results
    sd_ng, sd_gd = (np.sqrt(np.diag(s @ s.T)) if s.ndim == 2 else s for s in (scale_ng, scale_gd))
    # Both are stochastic fixed points of the same free energy: over seeds 0-4 their means differed by at most
    # 0.019 posterior sd and their sds by at most 2.2 % (mean field) / 4.4 % (full rank, where Adam's noisy
    # Cholesky factor is the larger error); twice that is the tolerance.
    assert np.max(np.abs(loc_ng - loc_gd) / sd_gd) < 0.04
    np.testing.assert_allclose(sd_ng, sd_gd, rtol=0.09)


def robust_model(X, y=None):
    """Cauchy-noise regression: not log-concave, so a full CVI step can make the site precision negative."""
    w = numpyro.sample("w", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.StudentT(1.0, X @ w, 0.1), obs=y)


@pytest.mark.parametrize("family", [pvi.MeanFieldGaussian(), pvi.FullRankGaussian()], ids=["mean_field", "full_rank"])
def test_cvi_halves_steps_that_would_make_q_improper(family):
    X = random.normal(random.PRNGKey(0), (40, 2))
    y = (X @ jnp.array([1.0, -0.5]) + 0.1 * random.normal(random.PRNGKey(1), (40,))).at[:10].set(30.0)
    inference = pvi.PVI(robust_model, family, pvi.split_iid(random.PRNGKey(3), 40, 4),
                        pvi.NaturalGradientUpdate(1.0, num_steps=3), pvi.Synchronous(1.0))
    result = inference.run(random.PRNGKey(0), 5, X, y=y, progress_bar=False)
    assert result.history.clamped[0].sum() > 0  # the outliers push the first steps out of the PD cone
    assert result.history.accepted.all() and bool(family.is_valid(result.state.q))
    assert np.isfinite(result.history.elbo).all()
    loc, _ = family.loc_scale(result.state.q)
    # The Cauchy likelihood ignores the 10 outliers: w is recovered to within 0.05 (its posterior sd is ~0.03).
    np.testing.assert_allclose(loc, [1.0, -0.5], atol=0.05)


@pytest.mark.parametrize("kwargs, match", [(dict(step_size=0.0), "step_size"), (dict(step_size=1.5), "step_size"),
                                           (dict(num_steps=0), "num_steps"), (dict(num_particles=1), "num_particles")])
def test_natural_gradient_update_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pvi.NaturalGradientUpdate(**kwargs)
