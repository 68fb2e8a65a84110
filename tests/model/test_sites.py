import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer.util import potential_energy

import numpyro_pvi as pvi
from numpyro_pvi.model.densities import log_likelihood, log_prior
from numpyro_pvi.model.sites import read_model

from models import linear_model, scale_model

KEY = random.PRNGKey(0)


def test_read_model_classifies_sites(linear_data):
    X, y = linear_data
    sites = read_model(scale_model, (X,), {"y": y})
    assert sites.plate == "data" and sites.plate_size == X.shape[0]
    assert [s.name for s in sites.globals] == ["w", "sigma"]
    assert sites.likelihoods == ("y",)
    assert sites.dim == 4
    assert set(sites.gaussian_prior) == {"w"}  # HalfNormal is not Gaussian in log-space


def test_flatten_unflatten_round_trip_in_model_order(linear_data):
    X, y = linear_data
    sites = read_model(scale_model, (X,), {"y": y})
    values = {"w": jnp.array([0.1, -0.2, 0.3]), "sigma": jnp.array(2.0)}
    zeta = sites.flatten(values)
    np.testing.assert_allclose(zeta, [0.1, -0.2, 0.3, np.log(2.0)], rtol=1e-6)
    back = sites.unflatten(zeta)
    np.testing.assert_allclose(back["sigma"], 2.0, rtol=1e-6)
    np.testing.assert_allclose(back["w"], values["w"], rtol=1e-6)


def test_log_prior_matches_numpyro_potential_energy(linear_data):
    X, y = linear_data
    sites = read_model(scale_model, (X,), {"y": y})
    zeta = jnp.array([0.1, -0.2, 0.3, -0.4])
    unconstrained = {"w": zeta[:3], "sigma": zeta[3]}
    joint = -potential_energy(scale_model, (X,), {"y": y}, unconstrained)
    lik = log_likelihood(scale_model, sites, zeta, (X,), {"y": y})
    assert float(log_prior(scale_model, sites, zeta, (X,), {"y": y}) + lik) == pytest.approx(
        float(joint), rel=1e-5
    )


def test_masked_log_likelihood_equals_unpadded(linear_data):
    X, y = linear_data
    sites = read_model(linear_model, (X,), {"y": y})
    zeta = jnp.array([0.5, -0.1, 0.2])
    unpadded = log_likelihood(linear_model, sites, zeta, (X[:7],), {"y": y[:7]})
    mask = jnp.arange(10) < 7
    padded = log_likelihood(linear_model, sites, zeta, (X[:10],), {"y": y[:10]}, mask)
    assert float(padded) == pytest.approx(float(unpadded), rel=1e-6)


def test_no_partition_plate_is_an_error(linear_data):
    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    with pytest.raises(ValueError, match="no pvi.partition_plate"):
        read_model(model, linear_data[:1], {"y": linear_data[1]})


def test_discrete_global_site_is_named():
    def model(y=None):
        k = numpyro.sample("k", dist.Bernoulli(0.5))
        with pvi.partition_plate("data", 3):
            numpyro.sample("y", dist.Normal(k, 1.0), obs=y)

    with pytest.raises(ValueError, match="Global site 'k' has a discrete support"):
        read_model(model, (), {"y": jnp.zeros(3)})


def test_local_latents_hyperparameters_and_enumerated_sites_are_classified():
    def model(y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        s = numpyro.param("s", 2.0, constraint=dist.constraints.positive)
        with pvi.partition_plate("data", 3):
            z = numpyro.sample("z", dist.HalfNormal(1.0).expand([2]).to_event(1))
            k = numpyro.sample("k", dist.Bernoulli(0.5), infer={"enumerate": "parallel"})
            numpyro.sample("y", dist.Normal(mu + z.sum(-1) + k, s), obs=y)

    sites = read_model(model, (), {"y": jnp.zeros(3)})
    assert [g.name for g in sites.globals] == ["mu"] and sites.likelihoods == ("y",)
    (z,) = sites.locals
    assert (z.name, z.shape, z.flat_shape, z.event_dim, z.row_axis) == ("z", (3, 2), (3, 2), 1, -2)
    assert z.frames == (("data", 3, -1),)
    assert sites.enumerated == ("k",) and sites.has_local
    (h,) = sites.hyper
    assert h.name == "s" and float(h.init) == pytest.approx(np.log(2.0))
    assert float(sites.hyper_values({"s": h.init})["s"]) == pytest.approx(2.0)


def test_unsupported_local_structure_names_the_site():
    def discrete(y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with pvi.partition_plate("data", 3):
            k = numpyro.sample("k", dist.Bernoulli(0.5))
            numpyro.sample("y", dist.Normal(mu + k, 1.0), obs=y)

    def param_in_plate(y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with pvi.partition_plate("data", 3):
            a = numpyro.param("a", jnp.zeros(3))
            numpyro.sample("y", dist.Normal(mu + a, 1.0), obs=y)

    def param_in_prior(y=None):
        s = numpyro.param("s", 1.0, constraint=dist.constraints.positive)
        mu = numpyro.sample("mu", dist.Normal(0.0, s))
        with pvi.partition_plate("data", 3):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    with pytest.raises(
        ValueError, match="Local latent site 'k' is discrete: mark it for enumeration"
    ):
        read_model(discrete, (), {"y": jnp.zeros(3)})
    with pytest.raises(ValueError, match="numpyro.param site 'a' is inside partition plate 'data'"):
        read_model(param_in_plate, (), {"y": jnp.zeros(3)})
    with pytest.raises(NotImplementedError, match=r"\['s'\] enter the prior of global site 'mu'"):
        read_model(param_in_prior, (), {"y": jnp.zeros(3)})


def test_plate_without_observations_is_an_error():
    def model(y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with pvi.partition_plate("data", 3):
            numpyro.deterministic("m", mu * jnp.ones(3))
            numpyro.sample("x", dist.Normal(0.0, 1.0), obs=jnp.zeros(3))
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    with pytest.raises(NotImplementedError, match="Observed site 'y' is outside"):
        read_model(model, (), {"y": 0.0})


def test_gaussian_priors_in_unconstrained_space_are_recognised():
    def model(y=None):
        numpyro.sample("a", dist.Normal(1.0, 2.0).expand([2]).to_event(1))
        numpyro.sample("b", dist.LogNormal(0.0, 0.5).expand([2]).to_event(1))
        numpyro.sample(
            "c", dist.MultivariateNormal(jnp.zeros(2), jnp.array([[1.0, 0.5], [0.5, 1.0]]))
        )
        s = numpyro.sample("s", dist.Gamma(2.0, 1.0))
        h = numpyro.sample("h", dist.Normal(0.0, s))  # hierarchical: depends on another latent
        with pvi.partition_plate("data", 3):
            numpyro.sample("y", dist.Normal(h, 1.0), obs=y)

    sites = read_model(model, (), {"y": jnp.zeros(3)})
    assert set(sites.gaussian_prior) == {"a", "b", "c"}
    loc, precision = sites.gaussian_prior["a"]
    np.testing.assert_allclose(loc, [1.0, 1.0])
    np.testing.assert_allclose(precision, [0.25, 0.25])
    np.testing.assert_allclose(sites.gaussian_prior["b"][1], [4.0, 4.0], rtol=1e-6)
    assert sites.gaussian_prior["c"][1].shape == (2, 2)
