"""A real Flower deployment on 127.0.0.1 (``flower-superlink``, two SuperNodes, ``flwr run``), as
docs/federated.md ("Deployment") describes it, gives the in-process run's q.

The processes start as the documentation says (tests/fakes.py's ``LocalFederation``): the SuperLink
with ``--disable-runtime-dependency-installation``, each site with ``python -m
numpyro_pvi.flower.supernode``. The test runs once, on the xdist worker of the Ray and Flower
simulations (never beside them), and stops every process it started, within bounded time.
"""

import os
import time
import warnings

import jax
import numpy as np
import optax
import pytest
from jax import random

import numpyro_pvi as pvi

pytest.importorskip("flwr")

pytestmark = pytest.mark.xdist_group("ray")

from fakes import LocalFederation, write_flower_app  # noqa: E402
from models import logistic_model  # noqa: E402

NUM_ROUNDS, NUM_STEPS, SEED, ROWS = 3, 10, 0, 40


def _in_process(logistic_data, seed):
    X, y = (np.asarray(a[: 2 * ROWS]) for a in logistic_data)
    inference = pvi.PVI(
        logistic_model,
        pvi.MeanFieldGaussian(),
        [np.arange(ROWS), np.arange(ROWS, 2 * ROWS)],
        pvi.GradientUpdate(optax.adam(0.05), num_steps=NUM_STEPS, num_particles=2),
        pvi.Synchronous(0.5),
        backend="vmap",
    )
    with warnings.catch_warnings():  # three short rounds: far from converged on purpose
        warnings.simplefilter("ignore", pvi.PVIWarning)
        return inference.run(random.PRNGKey(seed), NUM_ROUNDS, X, y=y, progress_bar=False)


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_deployment_on_localhost_gives_the_in_process_q(tmp_path, logistic_data):
    """Same seeds: the deployed q equals the in-process (vmap) run's to float32 rounding.

    Before: ``flwr run`` failed with flwr 1.42 ("uv sync failed", exit code 608: the SuperLink
    installed the app's dependencies at run time), and each site started a process per message.

    The sites run ``client_update`` unbatched on their own rows, the vmap backend batched, so XLA
    may round differently (tests/test_flower.py measured the Flower simulation bitwise equal to the
    vmap run); a run with another seed differs by more than 1e-2 (asserted below), so 1e-4
    separates "the same computation" from a different one.
    """
    X, y = (np.asarray(a) for a in logistic_data)
    sites = [(X[:ROWS], y[:ROWS]), (X[ROWS : 2 * ROWS], y[ROWS : 2 * ROWS])]
    app, paths, checkpoint = write_flower_app(tmp_path, sites, NUM_ROUNDS, NUM_STEPS, SEED)
    federation = LocalFederation(tmp_path, paths, warm=True, grace=10.0)
    try:
        with federation:
            federation.run(app, timeout=300)
    finally:
        # every process the deployment started (SuperLink, SuperNodes, flwr run, and what they
        # started: the ServerApp's process) is gone within seconds
        deadline = time.monotonic() + 10
        while any(_group_alive(g) for g in federation.pids) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert len(federation.pids) == 4 and not [g for g in federation.pids if _group_alive(g)]
    q = pvi.load(checkpoint).q
    reference, other = (_in_process(logistic_data, s).state.q for s in (SEED, SEED + 1))
    for got, want, off in zip(*(jax.tree.leaves(t) for t in (q, reference, other))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert np.max(np.abs(np.asarray(off) - np.asarray(want))) > 1e-2  # the seed matters
