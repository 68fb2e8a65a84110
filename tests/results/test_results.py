"""What a run leaves (results.py): the pooled guide with every row's local latents, ``to_arviz``'s
deterministic sites.

Eight schools, non-centred: ``mu``, ``tau`` global, ``theta_raw`` local (each school's on the client
holding it), ``theta = mu + tau * theta_raw`` a per-row deterministic site and ``tau_sq`` a global
one.
"""

import warnings

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random
from numpyro.infer import Predictive

import numpyro_pvi as pvi

Y = jnp.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SIGMA = jnp.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
# 4 clients of 2 schools each, not contiguous: the pooled guide must put each school's draws back in
# its row
PARTS = [np.array([5, 0]), np.array([3, 7]), np.array([1, 6]), np.array([2, 4])]
NUM_DRAWS = 4000


def schools(sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    numpyro.deterministic("tau_sq", tau**2)
    with pvi.partition_plate("schools", sigma.shape[0]):
        theta_raw = numpyro.sample("theta_raw", dist.Normal(0.0, 1.0))
        theta = numpyro.deterministic("theta", mu + tau * theta_raw)
        numpyro.sample("y", dist.Normal(theta, sigma), obs=y)


def update():
    return pvi.GradientUpdate(
        optax.adam(optax.exponential_decay(5e-2, 300, 0.1)), num_steps=300, num_particles=4
    )


@pytest.fixture(scope="module")
def result():
    inference = pvi.PVI(schools, pvi.MeanFieldGaussian(), PARTS, update(), pvi.Sequential())
    return inference.run(random.PRNGKey(0), 6, SIGMA, y=Y, progress_bar=False)


def per_school_reference(result):
    """Each school's ``theta_raw`` and ``theta`` draws from ``sample_posterior(client=m)``, in
    pooled row order."""
    raw, theta = np.zeros((NUM_DRAWS, 8)), np.zeros((NUM_DRAWS, 8))
    for m, rows in enumerate(PARTS):
        draws = result.sample_posterior(random.PRNGKey(10 + m), NUM_DRAWS, client=m)
        raw[:, rows] = draws["theta_raw"]
        theta[:, rows] = draws["mu"][:, None] + draws["tau"][:, None] * draws["theta_raw"]
    return raw, theta


def within_mc_error(a, b):
    """|mean(a) - mean(b)| per school below 5 standard errors of the difference of two independent
    means of ``NUM_DRAWS`` draws, ``sqrt(var_a / n + var_b / n)`` with the sample variances: a false
    alarm has probability < 1e-6 per school; a systematic offset of more than ~5 % of a posterior sd
    is caught (n = 4000)."""
    se = np.sqrt(a.var(0) / len(a) + b.var(0) / len(b))
    return np.abs(a.mean(0) - b.mean(0)) < 5 * se, se


def test_pooled_guide_draws_each_rows_local_latents_from_its_clients_guide(result):
    predictive = Predictive(
        schools, guide=result.guide(), num_samples=NUM_DRAWS, return_sites=["theta_raw", "theta"]
    )
    drawn = predictive(random.PRNGKey(1), SIGMA)
    raw, theta = per_school_reference(result)
    for name, reference in [("theta_raw", raw), ("theta", theta)]:
        ok, se = within_mc_error(np.asarray(drawn[name]), reference)
        assert ok.all(), (name, np.asarray(drawn[name]).mean(0), reference.mean(0), se)
    # the same marginal spread (sd), not the prior's N(0, 1): 5 standard errors of an sd, sd /
    # sqrt(2 n) each
    sd, ref_sd = np.asarray(drawn["theta_raw"]).std(0), raw.std(0)
    np.testing.assert_array_less(
        np.abs(sd - ref_sd), 5 * np.sqrt(2) * ref_sd / np.sqrt(2 * NUM_DRAWS)
    )
    # the check can tell: draws from the prior N(0, 1) (what a guide without local sites gives)
    # would fail it
    prior_se = np.sqrt(1.0 / NUM_DRAWS + raw.var(0) / NUM_DRAWS)
    # measured: school 7's mean 0.33 > 0.11
    assert np.any(np.abs(raw.mean(0)) > 5 * prior_se), raw.mean(0)


def test_pooled_guide_raises_on_other_rows(result):
    predictive = Predictive(schools, guide=result.guide(), num_samples=10)
    with pytest.raises(ValueError, match="8 rows of partition plate 'schools'.*6 rows"):
        predictive(random.PRNGKey(1), SIGMA[:6])
    # a client's guide wants that client's rows
    with pytest.raises(ValueError, match="client 1's data: 2 rows"):
        Predictive(schools, guide=result.guide(client=1), num_samples=10)(random.PRNGKey(1), SIGMA)
    drawn = Predictive(
        schools, guide=result.guide(client=1), num_samples=10, return_sites=["theta_raw"]
    )(random.PRNGKey(1), SIGMA[PARTS[1]])
    assert drawn["theta_raw"].shape == (10, 2)


def test_to_arviz_has_the_deterministic_sites(result):
    idata = result.to_arviz(num_samples=2000)
    post = idata.posterior
    assert {"mu", "tau", "tau_sq", "theta_raw", "theta"} <= set(post.data_vars)
    assert post["theta"].dims == ("chain", "draw", "schools") == post["theta_raw"].dims
    assert post["tau_sq"].dims == ("chain", "draw")
    # computed from the very draws of the posterior group, row by row in pooled order
    np.testing.assert_allclose(post["tau_sq"], post["tau"] ** 2, rtol=1e-5)
    np.testing.assert_allclose(
        post["theta"], post["mu"] + post["tau"] * post["theta_raw"], rtol=1e-4, atol=1e-4
    )
    np.testing.assert_array_equal(idata.constant_data["client"], [0, 2, 3, 1, 3, 0, 2, 1])
    import arviz as az

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = az.summary(idata, var_names=["tau_sq", "theta"])
    assert list(summary.index) == ["tau_sq"] + [f"theta[{i}]" for i in range(8)]
    assert np.all(np.abs(summary["r_hat"] - 1) < 0.02)  # independent draws: r_hat 1 up to MC noise


def test_federated_clients_pooled_order_is_client_by_client():
    """With ``ClientData`` there are no pooled data: the guide's rows and ``to_arviz``'s are client
    0's, then client 1's, ... (here the schools in the order PARTS lists them). Two rounds of the
    shared run's configuration (its compiled round serves this one)."""
    order = np.concatenate(PARTS)
    clients = pvi.ClientData([((SIGMA[p],), {"y": Y[p]}) for p in PARTS])
    result = pvi.PVI(schools, pvi.MeanFieldGaussian(), clients, update(), pvi.Sequential()).run(
        random.PRNGKey(0), 2, progress_bar=False
    )
    drawn = Predictive(
        schools, guide=result.guide(), num_samples=NUM_DRAWS, return_sites=["theta_raw"]
    )(random.PRNGKey(1), SIGMA[order])["theta_raw"]
    for m in range(len(PARTS)):
        own = result.sample_posterior(random.PRNGKey(10 + m), NUM_DRAWS, client=m)["theta_raw"]
        ok, se = within_mc_error(np.asarray(drawn[:, 2 * m : 2 * m + 2]), np.asarray(own))
        assert ok.all(), (m, se)
    idata = result.to_arviz(num_samples=400)
    np.testing.assert_array_equal(idata.constant_data["client"], [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_allclose(
        idata.posterior["theta"],
        idata.posterior["mu"] + idata.posterior["tau"] * idata.posterior["theta_raw"],
        rtol=1e-4,
        atol=1e-4,
    )
