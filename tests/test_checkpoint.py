import numpy as np
import optax
import pytest
from jax import random

import numpyro_pvi as pvi

from conftest import linear_model

PARTS = [np.arange(0, 100), np.arange(100, 300)]


@pytest.mark.parametrize("server", [pvi.Synchronous(0.5), pvi.Asynchronous(0.5, speeds=[1.0, 0.5])], ids=str)
def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(linear_data, tmp_path, server):
    X, y = linear_data
    update = pvi.GradientUpdate(optax.adam(1e-2), num_steps=50, num_particles=2)
    inference = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), PARTS, update, server)
    straight = inference.run(random.PRNGKey(0), 4, X, y=y, progress_bar=False)
    first = inference.run(random.PRNGKey(0), 2, X, y=y, progress_bar=False)
    path = tmp_path / "state.npz"
    pvi.save(first.state, path)
    resumed = inference.run(random.PRNGKey(1), 2, X, y=y, progress_bar=False, init_state=pvi.load(path))
    for a, b in zip(np.asarray(straight.state.q), np.asarray(resumed.state.q)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(straight.history.elbo[2:], resumed.history.elbo)


def test_loading_something_else_is_a_clear_error(tmp_path):
    path = tmp_path / "other.npz"
    np.savez(path, x=np.ones(2))
    with pytest.raises(ValueError, match="not a numpyro_pvi checkpoint"):
        pvi.load(path)
