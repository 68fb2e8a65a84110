"""``SNEPUpdate``: EP's fixed point from persistent MCMC, exact on a conjugate model, the site-variance clamp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

import numpyro_pvi as pvi

from conftest import exact_linear_posterior, linear_model, logistic_model


@pytest.fixture(scope="module")
def ep_fixed_point(logistic_data):
    """EP's q on the conftest logistic regression (4 clients, 5 sequential rounds of 4096 importance draws)."""
    X, y = logistic_data
    inference = pvi.PVI(logistic_model, pvi.FullRankGaussian(), pvi.split_iid(random.PRNGKey(3), 400, 4),
                        pvi.MomentMatchingUpdate(num_samples=4096), pvi.Sequential())
    state = inference.run(random.PRNGKey(0), 5, X, y=y, progress_bar=False).state
    loc, scale_tril = inference.family.loc_scale(state.q)
    return np.asarray(loc), np.sqrt(np.diag(np.asarray(scale_tril @ scale_tril.T)))


@pytest.mark.slow  # a known gap, kept as a record: run with -m slow
@pytest.mark.xfail(strict=True, reason="SNEP in full PVI runs is 0.26 sd / 15 % in sd from EP (seed 0, sequential, "
                                       "3 rounds); a single client against a fixed cavity gets within 0.09 sd / 1.5 %")
@pytest.mark.parametrize("server", [pvi.Sequential(), pvi.Synchronous()], ids=["sequential", "synchronous"])
def test_snep_reaches_the_ep_fixed_point(logistic_data, ep_fixed_point, server):
    X, y = logistic_data
    ep_loc, ep_sd = ep_fixed_point
    family = pvi.FullRankGaussian()
    update = pvi.SNEPUpdate(step_size=0.3, step_decay=100.0, num_inner=200)
    inference = pvi.PVI(logistic_model, family, pvi.split_iid(random.PRNGKey(3), 400, 4), update, server)
    result = inference.run(random.PRNGKey(0), 3, X, y=y, progress_bar=False)
    loc, scale_tril = family.loc_scale(result.state.q)
    sd = np.sqrt(np.diag(scale_tril @ scale_tril.T))
    # SNEP starts each site at a Laplace approximation, which is 0.34 EP posterior sd from EP's mean (4 % in sd).
    # Target: SNEP's own MC error, measured for one client against a fixed cavity over 4 visits of 300 steps
    # (step 0.3, decay 30): <= 0.09 sd in the mean, <= 1.5 % in the sds; about twice that.
    assert np.max(np.abs(loc - ep_loc) / ep_sd) < 0.2
    np.testing.assert_allclose(sd, ep_sd, rtol=0.03)
    # the chains are the clients' persistent state: every client was visited and holds finite chains
    assert bool(result.state.client_states.visited.all()) and np.isfinite(result.state.client_states.chains).all()


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="measured over seeds 0-2: 0.19-0.23 sd in the mean, 7-17 % in the sds after "
                                       "2 rounds, though the Laplace start is exact: SNEP noise/bias too large")
def test_snep_recovers_the_exact_posterior_of_a_conjugate_model(linear_data):
    X, y = linear_data
    mean, cov = exact_linear_posterior(X, y)
    sd = np.sqrt(np.diag(cov))
    family = pvi.FullRankGaussian()
    update = pvi.SNEPUpdate(step_size=0.3, step_decay=100.0, num_inner=200)
    inference = pvi.PVI(linear_model, family, pvi.split_iid(random.PRNGKey(1), 300, 4), update, pvi.Synchronous())
    loc, scale_tril = family.loc_scale(inference.run(random.PRNGKey(0), 2, X, y=y, progress_bar=False).state.q)
    # The fixed point is each client's exact likelihood; target: within 0.1 sd and 3 % (MC error).
    assert np.max(np.abs(loc - mean) / sd) < 0.1
    np.testing.assert_allclose(np.sqrt(np.diag(scale_tril @ scale_tril.T)), sd, rtol=0.03)


def test_site_variance_clamp_keeps_sites_proper_and_is_counted(linear_data):
    X, y = linear_data
    family = pvi.FullRankGaussian()
    # Each client's exact site variance is ~0.003; a floor of 0.01 must bind.
    update = pvi.SNEPUpdate(num_inner=20, site_variance=(0.01, 100.0))
    inference = pvi.PVI(linear_model, family, pvi.split_iid(random.PRNGKey(1), 300, 4), update, pvi.Synchronous())
    result = inference.run(random.PRNGKey(0), 2, X, y=y, progress_bar=False)
    assert (result.history.clamped > 0).all()
    assert np.isfinite(result.history.elbo).all() and result.history.accepted.all()
    precisions = np.asarray(jax.vmap(family.precision)(result.state.factors))
    eigenvalues = np.linalg.eigvalsh(precisions)
    assert eigenvalues.min() >= 1 / 100.0 * (1 - 1e-3) and eigenvalues.max() <= 1 / 0.01 * (1 + 1e-3)


@pytest.mark.parametrize("kwargs, match", [(dict(step_size=0.0), "step_size"), (dict(alpha=1.5), "alpha"),
                                           (dict(num_inner=0), "num_inner"), (dict(num_outer=0), "num_outer"),
                                           (dict(num_chains=0), "num_chains"), (dict(site_variance=(1.0, 0.1)),
                                                                               "site_variance"),
                                           (dict(step_decay=0.0), "step_decay")])
def test_snep_update_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pvi.SNEPUpdate(**kwargs)


def test_snep_never_returns_nan_on_a_heavy_tailed_model():
    from test_natural_gradient import robust_model

    X = random.normal(random.PRNGKey(0), (40, 2))
    y = (X @ jnp.array([1.0, -0.5]) + 0.1 * random.normal(random.PRNGKey(1), (40,))).at[:10].set(30.0)
    family = pvi.MeanFieldGaussian()
    inference = pvi.PVI(robust_model, family, pvi.split_iid(random.PRNGKey(3), 40, 4),
                        pvi.SNEPUpdate(num_inner=50), pvi.Synchronous())
    result = inference.run(random.PRNGKey(0), 2, X, y=y, progress_bar=False)
    assert np.isfinite(result.history.elbo).all() and bool(family.is_valid(result.state.q))
    assert all(np.isfinite(leaf).all() for leaf in result.state.factors)
