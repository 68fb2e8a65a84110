"""In-process backends: a failing client is rejected, never fatal; vmap over devices changes no
number."""

import numpy as np
from jax import random

import numpyro_pvi as pvi

from fakes import UNEQUAL, FaultyUpdate
from models import linear_model


def test_loop_backend_rejects_a_raising_client(linear_data):
    X, y = linear_data
    inference = pvi.PVI(
        linear_model,
        pvi.FullRankGaussian(),
        UNEQUAL,
        FaultyUpdate(90, "raise"),
        pvi.Synchronous(1.0),
        backend="loop",
    )
    state, info = inference.update(inference.init(random.PRNGKey(0), X, y=y), X, y=y)
    np.testing.assert_array_equal(info.accepted, [1, 0, 1, 1])
    assert info.num_rejected == 1 and bool(inference.family.is_valid(state.q))


RUN = """
import jax, numpy as np, optax
from jax import random
import numpyro_pvi as pvi
from models import logistic_model
X = random.normal(random.PRNGKey(2), (400, 3))
y = (X[:, 0] > 0).astype("float32")
update = pvi.GradientUpdate(optax.adam(1e-2), num_steps=50, num_particles=4, batch_size=20)
parts = pvi.split_iid(random.PRNGKey(0), 400, 4)
inference = pvi.PVI(logistic_model, pvi.MeanFieldGaussian(), parts, update)
state = inference.run(random.PRNGKey(1), 2, X, y=y, progress_bar=False).state
count, eta1 = jax.device_count(), np.asarray(state.q.eta1)
"""
TWO_DEVICES = (
    """
import sys, numpyro
numpyro.set_platform("cpu")  # as conftest sets it for this process
numpyro.set_host_device_count(2)
sys.path.insert(0, "tests")
"""
    + RUN
    + """
print(count, *eta1.tolist())
"""
)


def test_vmap_over_two_cpu_devices_equals_one(tmp_path):
    """With 2 devices a round's clients are split across them (SPMD); the numbers do not change. The
    2-device run is a fresh process (the device count is fixed when JAX starts); the 1-device run is
    this one, same code."""
    import subprocess
    import sys

    script = tmp_path / "two_devices.py"
    script.write_text(TWO_DEVICES)
    two_count, *two = np.array(
        subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, check=True
        ).stdout.split(),
        float,
    )
    one = {}
    exec(RUN, one)  # noqa: S102 - the very statements the 2-device process ran
    assert (one["count"], two_count) == (1, 2)
    np.testing.assert_allclose(two, one["eta1"], rtol=1e-5)
