"""A chosen start: ``PVI(..., init_loc_fn=..., init_scale=...)`` puts ``q`` there, split evenly over the clients."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import init_to_median, init_to_value

import numpyro_pvi as pvi
from numpyro_pvi.merge import is_valid_state

N = 30
PARTS = np.split(np.arange(N), [4, 13, 21])


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


@pytest.fixture(scope="module")
def data():
    X = random.normal(random.PRNGKey(0), (N, 2))
    return X, X @ jnp.array([1.0, -1.0]) + 0.5 * random.normal(random.PRNGKey(1), (N,))


@pytest.mark.parametrize("family", [pvi.MeanFieldGaussian(), pvi.FullRankGaussian()])
def test_initial_q_has_the_requested_location_and_scale(data, family):
    values = {"w": jnp.array([0.5, -2.0]), "sigma": jnp.array(3.0)}
    inference = pvi.PVI(model, family, partitions=PARTS, local_update=pvi.NaturalGradientUpdate(),
                        init_loc_fn=init_to_value(values=values), init_scale=0.2)
    problem = inference.build(*data[:1], y=data[1])
    state = inference.init(random.PRNGKey(2), problem)
    loc, scale = family.loc_scale(state.q)
    np.testing.assert_allclose(loc, [0.5, -2.0, np.log(3.0)], rtol=1e-5)  # sigma's unconstrained value
    np.testing.assert_allclose(family.to_dense(family.identity(3)) * 0.2,
                               family.to_dense(scale) if scale.ndim == 2 else np.diag(scale), rtol=1e-5)
    assert bool(is_valid_state(family, state.q, state.factors))
    prior = problem.prior
    shares = jax.tree.map(lambda f: f[:problem.num_clients], state.factors)
    for share in jax.tree.leaves(shares):  # every real client holds (q_init - prior) / M
        np.testing.assert_allclose(share, np.broadcast_to(share[0], share.shape), rtol=1e-6)
    np.testing.assert_allclose(state.q.eta1, prior.eta1 + problem.num_clients * shares.eta1[0], rtol=1e-5)


def test_defaults_start_at_the_prior_and_median_runs(data):
    plain = pvi.PVI(model, pvi.MeanFieldGaussian(), partitions=PARTS, local_update=pvi.NaturalGradientUpdate())
    problem = plain.build(*data[:1], y=data[1])
    state = plain.init(random.PRNGKey(2), problem)
    np.testing.assert_array_equal(state.q.eta1, problem.prior.eta1)
    assert not np.any(np.asarray(state.factors.eta1))
    median = pvi.PVI(model, pvi.MeanFieldGaussian(), partitions=PARTS, local_update=pvi.NaturalGradientUpdate(),
                     server=pvi.Synchronous(1.0), init_loc_fn=init_to_median)
    result = median.run(random.PRNGKey(3), 3, *data[:1], y=data[1], progress_bar=False)
    assert np.all(np.isfinite(result.history.elbo)) and int(result.history.num_rejected.sum()) == 0
    with pytest.raises(ValueError, match="init_scale"):
        pvi.PVI(model, pvi.MeanFieldGaussian(), local_update=pvi.NaturalGradientUpdate(), init_scale=-1.0)
