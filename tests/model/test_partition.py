import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import MCMC, NUTS, Predictive
from numpyro.infer.util import log_density

import numpyro_pvi as pvi
from numpyro_pvi.model.partition import check_partitions, pad_rows

from models import linear_model


def plain_linear_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)


def test_partition_plate_is_a_plate_outside_pvi(linear_data):
    X, y = linear_data
    params = {"w": jnp.array([0.3, -0.2, 0.1])}
    ours, _ = log_density(linear_model, (X,), {"y": y}, params)
    plain, _ = log_density(plain_linear_model, (X,), {"y": y}, params)
    assert ours == pytest.approx(float(plain), rel=1e-6)
    preds = Predictive(linear_model, {"w": jnp.zeros((4, 3))})(random.PRNGKey(0), X)
    assert preds["y"].shape == (4, X.shape[0])
    mcmc = MCMC(NUTS(linear_model), num_warmup=50, num_samples=50, progress_bar=False)
    mcmc.run(random.PRNGKey(1), X[:50], y=y[:50])
    assert mcmc.get_samples()["w"].shape == (50, 3)


def test_partition_plate_does_not_mutate_user_infer_dict():
    infer = {"enumerate": None}

    def model():
        with pvi.partition_plate("data", 3):
            numpyro.sample("x", dist.Normal(0.0, 1.0), infer=infer)

    numpyro.handlers.trace(numpyro.handlers.seed(model, 0)).get_trace()
    assert infer == {"enumerate": None}


def test_split_iid_covers_every_row_once():
    parts = pvi.split_iid(random.PRNGKey(0), num_data=103, num_clients=10)
    assert len(parts) == 10
    assert sorted(len(p) for p in parts) == [10] * 7 + [11] * 3
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(103))
    again = pvi.split_iid(random.PRNGKey(0), num_data=103, num_clients=10)
    assert all((a == b).all() for a, b in zip(parts, again))


def test_split_by_label_skews_labels():
    labels = np.repeat(np.arange(10), 50)
    skewed = pvi.split_by_label(random.PRNGKey(0), labels, num_clients=10, alpha=0.1)
    uniform = pvi.split_by_label(random.PRNGKey(0), labels, num_clients=10, alpha=100.0)
    for parts in (skewed, uniform):
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(500))
        assert all(len(p) > 0 for p in parts)
    # with small alpha most of a client's rows come from few labels
    top_share = lambda parts: np.mean([np.bincount(labels[p]).max() / len(p) for p in parts])  # noqa: E731
    assert top_share(skewed) > 0.6 > 0.3 > top_share(uniform)


@pytest.mark.parametrize(
    "parts, match",
    [
        ([np.array([0, 1, 2]), np.array([2, 3, 4])], "overlap"),
        ([np.array([0, 1]), np.array([3, 4])], "miss"),
        ([np.array([0, 1, 2]), np.array([3, 4, 5])], "outside"),
        ([np.array([0.0, 1.0]), np.array([2, 3, 4])], "integer"),
        ([], "empty"),
    ],
)
def test_bad_partitions_are_named(parts, match):
    with pytest.raises(ValueError, match=match):
        check_partitions(parts, 5, "data")


def test_client_data_validation():
    with pytest.raises(TypeError, match="entry 0"):
        pvi.ClientData([(jnp.ones(3), {})])
    with pytest.raises(ValueError, match="at least one"):
        pvi.ClientData([])
    with pytest.raises(ValueError, match="holds no rows"):
        pad_rows(np.zeros((0, 2)), 3)


def test_pad_rows_repeats_a_real_row():
    padded = pad_rows(np.array([[1.0, 2.0], [3.0, 0.5]]), 4)
    np.testing.assert_array_equal(padded, [[1.0, 2.0], [3.0, 0.5], [3.0, 0.5], [3.0, 0.5]])
