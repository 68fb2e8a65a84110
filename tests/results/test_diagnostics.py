"""``to_arviz``: the posterior and history of a fitted run as ArviZ data that ArviZ's tools accept
silently."""

import logging
import warnings
from contextlib import contextmanager

import arviz as az
import jax.numpy as jnp
import matplotlib
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_pvi as pvi
from numpyro_pvi.results.arviz import to_arviz

matplotlib.use("Agg")


def multi_output_model(X, Y=None):
    """Two-output linear regression: a matrix, a vector and a positive global site."""
    W = numpyro.sample("W", dist.Normal(0.0, 1.0).expand([X.shape[1], 2]).to_event(2))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("Y", dist.Normal(X @ W + b, sigma).to_event(1), obs=Y)


@contextmanager
def arviz_log():
    """Collect what ArviZ logs: its logger is standalone (no propagation to pytest's caplog) and
    de-duplicates."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    az._log.cache.clear()
    az._log.addHandler(handler)
    try:
        yield records
    finally:
        az._log.removeHandler(handler)


@pytest.fixture(scope="module")
def fitted():
    X = random.normal(random.PRNGKey(0), (200, 3))
    W = jnp.array([[1.0, -1.0], [0.5, 0.0], [0.0, 2.0]])
    Y = X @ W + jnp.array([0.3, -0.2]) + 0.5 * random.normal(random.PRNGKey(1), (200, 2))
    update = pvi.GradientUpdate(
        optax.adam(optax.exponential_decay(5e-2, 300, 0.05)), num_steps=300, num_particles=4
    )
    inference = pvi.PVI(
        multi_output_model,
        pvi.MeanFieldGaussian(),
        pvi.split_iid(random.PRNGKey(2), 200, 4),
        update,
        pvi.Sequential(),
    )
    return inference.run(random.PRNGKey(3), 3, X, Y=Y, progress_bar=False)


def test_posterior_has_every_global_site_with_named_dims(fitted):
    idata = to_arviz(fitted, num_samples=1000)
    post = idata.posterior
    assert list(post.data_vars) == ["W", "b", "sigma"]  # model order
    assert post["W"].dims == ("chain", "draw", "W_dim_0", "W_dim_1")
    assert post["W"].shape == (4, 250, 3, 2)
    assert post["b"].dims == ("chain", "draw", "b_dim_0")
    assert post["sigma"].dims == ("chain", "draw")
    assert (post["sigma"].values > 0).all()  # constrained values
    assert post.attrs["inference_library"] == "numpyro_pvi"
    assert post.attrs["num_clients"] == 4


def test_posterior_draws_are_q(fitted):
    idata = to_arviz(fitted, num_samples=4000, rng_key=random.PRNGKey(7))
    # flat order: W (6), b (2), log sigma (1)
    loc, scale = fitted.config.family.loc_scale(fitted.state.q)
    loc, scale = np.asarray(loc), np.asarray(scale)
    draws = np.concatenate(
        [
            idata.posterior["W"].values.reshape(4000, 6),
            idata.posterior["b"].values.reshape(4000, 2),
            np.log(idata.posterior["sigma"].values.reshape(4000, 1)),
        ],
        axis=1,
    )
    # 4000 iid draws: the mean is within 4 standard errors, the sd within 10 %
    assert np.all(np.abs(draws.mean(0) - loc) < 4 * scale / np.sqrt(4000))
    np.testing.assert_allclose(draws.std(0), scale, rtol=0.1)


def test_sample_stats_hold_the_history(fitted):
    stats = to_arviz(fitted, num_samples=100).sample_stats
    history = fitted.history
    np.testing.assert_array_equal(stats["round"].values, [1, 2, 3])
    np.testing.assert_array_equal(stats["client"].values, [0, 1, 2, 3])
    np.testing.assert_allclose(stats["elbo"].values, history.elbo)
    assert stats["free_energy"].dims == ("round", "client")
    for name in ("free_energy", "attempts", "accepted", "damping", "clamped"):
        np.testing.assert_allclose(stats[name].values, getattr(history, name))
    np.testing.assert_allclose(stats["time"].values, history.time)
    assert stats.attrs["num_rounds"] == 3


def test_summary_runs_without_warnings(fitted):
    idata = fitted.to_arviz()  # the method of PVIRunResult, with its defaults
    with warnings.catch_warnings(), arviz_log() as records:
        warnings.simplefilter("error")
        summary = az.summary(idata)
    assert not records, [r.getMessage() for r in records]
    assert list(summary.index) == [
        "W[0, 0]",
        "W[0, 1]",
        "W[1, 0]",
        "W[1, 1]",
        "W[2, 0]",
        "W[2, 1]",
        "b[0]",
        "b[1]",
        "sigma",
    ]
    # independent draws: r_hat ~ 1 and the effective sample size ~ the number of draws
    assert summary["r_hat"].between(0.98, 1.02).all(), summary["r_hat"]
    assert (summary["ess_bulk"] > 600).all(), summary["ess_bulk"]
    np.testing.assert_allclose(summary.loc["W[2, 1]", "mean"], 2.0, atol=0.15)


def test_the_method_is_the_function(fitted):
    key = random.PRNGKey(5)
    by_method = fitted.to_arviz(200, key, num_chains=2, dims={"b": ["output"]})
    by_function = to_arviz(
        fitted, num_samples=200, rng_key=key, num_chains=2, dims={"b": ["output"]}
    )
    assert by_method.posterior["b"].dims == ("chain", "draw", "output")
    for name in ("W", "b", "sigma"):
        np.testing.assert_array_equal(
            by_method.posterior[name].values, by_function.posterior[name].values
        )
    np.testing.assert_array_equal(by_method.sample_stats["elbo"].values, fitted.history.elbo)


def test_one_chain_is_allowed_but_arviz_then_warns(fitted):
    idata = to_arviz(fitted, num_samples=200, num_chains=1)
    assert idata.posterior["W"].shape == (1, 200, 3, 2)
    with arviz_log() as records:  # this is why the default is 4 chains
        summary = az.summary(idata)
    assert any("Shape validation failed" in r.getMessage() for r in records)
    assert summary["r_hat"].isna().all()


def test_plot_posterior_and_plot_forest(fitted):
    import matplotlib.pyplot as plt

    idata = to_arviz(fitted, num_samples=400)
    with warnings.catch_warnings():
        # arviz 0.23 calls a matplotlib API that matplotlib 3.11 deprecates; that is theirs, not
        # ours
        warnings.simplefilter("ignore", matplotlib.MatplotlibDeprecationWarning)
        axes = az.plot_posterior(idata, var_names=["b", "sigma"])
        assert np.asarray(axes).size == 3
        axes = az.plot_forest(idata, var_names=["W"], combined=True)
        assert len(axes[0].get_yticklabels()) == 6
    plt.close("all")


def test_coords_and_dims_can_be_named(fitted):
    idata = to_arviz(
        fitted,
        num_samples=100,
        coords={"feature": ["x0", "x1", "x2"], "output": ["u", "v"]},
        dims={"W": ["feature", "output"], "b": ["output"]},
    )
    assert idata.posterior["W"].dims == ("chain", "draw", "feature", "output")
    assert list(idata.posterior["b"].coords["output"].values) == ["u", "v"]
    assert idata.posterior["W"].sel(feature="x2", output="v").shape == (4, 25)


def test_draws_are_seeded(fitted):
    a = to_arviz(fitted, num_samples=100, rng_key=random.PRNGKey(1)).posterior["b"].values
    b = to_arviz(fitted, num_samples=100, rng_key=random.PRNGKey(1)).posterior["b"].values
    c = to_arviz(fitted, num_samples=100, rng_key=random.PRNGKey(2)).posterior["b"].values
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_a_run_without_rounds_has_no_sample_stats(fitted):
    empty = fitted._replace(history=None)
    idata = to_arviz(empty, num_samples=100)
    assert "sample_stats" not in idata.groups()
    assert "posterior" in idata.groups()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"num_samples": 10, "num_chains": 4}, ValueError),
        ({"num_samples": 2, "num_chains": 4}, ValueError),
        ({"num_chains": 0}, ValueError),
        ({"num_samples": 100.0}, ValueError),
    ],
)
def test_bad_arguments(fitted, kwargs, error):
    with pytest.raises(error, match="to_arviz"):
        to_arviz(fitted, **kwargs)


def test_not_a_result():
    with pytest.raises(TypeError, match="PVIRunResult"):
        to_arviz({"w": np.zeros(3)})


def intercept_model(x, y=None):
    """y[g, i] = b + u[g] + noise: the group intercepts u are local latents of the client holding
    group g."""
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with pvi.partition_plate("groups", x.shape[0]):
        u = numpyro.sample("u", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(b + u[:, None] + 0.0 * x, 1.0).to_event(1), obs=y)


def test_local_latents_are_gathered_in_pooled_row_order():
    x = jnp.zeros((10, 3))
    y = 0.5 + jnp.arange(10.0)[:, None] / 3 + random.normal(random.PRNGKey(0), (10, 3))
    # shuffled, unequal clients
    parts = [np.array([7, 2, 9]), np.array([0, 5, 1, 8]), np.array([3, 4, 6])]
    update = pvi.GradientUpdate(optax.adam(5e-2), num_steps=150, num_particles=4)
    inference = pvi.PVI(intercept_model, pvi.MeanFieldGaussian(), parts, update, pvi.Sequential())
    result = inference.run(random.PRNGKey(1), 2, x, y=y, progress_bar=False)
    idata = to_arviz(result, num_samples=2000)
    u = idata.posterior["u"]
    assert u.dims == ("chain", "draw", "groups") and list(u.coords["groups"].values) == list(
        range(10)
    )
    assert list(idata.constant_data["client"].values) == [1, 1, 0, 2, 2, 1, 2, 0, 1, 0]
    loc, scale = result.state.client_states["u"]
    # each group's draws are its own client's guide (sd / sqrt(2000) MC error)
    for m, rows in enumerate(parts):
        drawn = u.sel(groups=rows).mean(("chain", "draw")).values
        np.testing.assert_allclose(
            drawn, loc[m, : len(rows)], atol=4 * float(scale.max()) / np.sqrt(2000)
        )
    # y rises by 3 over the groups
    assert float(u.sel(groups=9).mean()) - float(u.sel(groups=0).mean()) > 1.0
    with warnings.catch_warnings(), arviz_log() as records:
        warnings.simplefilter("error")
        summary = az.summary(idata)
    assert not records and list(summary.index) == ["b"] + [f"u[{g}]" for g in range(10)]
