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


def _in_process(logistic_data, *seeds):
    """The in-process runs with these seeds (one PVI: its compiled round is shared), on the
    ``"loop"`` backend: one jitted ``client_update`` per client, the program a site compiles (the
    same HLO, checked)."""
    X, y = (np.asarray(a[: 2 * ROWS]) for a in logistic_data)
    inference = pvi.PVI(
        logistic_model,
        pvi.MeanFieldGaussian(),
        [np.arange(ROWS), np.arange(ROWS, 2 * ROWS)],
        pvi.GradientUpdate(optax.adam(0.05), num_steps=NUM_STEPS, num_particles=2),
        pvi.Synchronous(0.5),
        backend="loop",
    )
    with warnings.catch_warnings():  # three short rounds: far from converged on purpose
        warnings.simplefilter("ignore", pvi.PVIWarning)
        return [
            inference.run(random.PRNGKey(seed), NUM_ROUNDS, X, y=y, progress_bar=False)
            for seed in seeds
        ]


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_deployment_on_localhost_gives_the_in_process_q(tmp_path, logistic_data):
    """Same seeds: the deployed q equals the in-process run's to float32 rounding.

    Before: ``flwr run`` failed with flwr 1.42 ("uv sync failed", exit code 608: the SuperLink
    installed the app's dependencies at run time), and each site started a process per message.

    The in-process run is the ``"loop"`` backend's, computed first: its clients run the program
    the sites then compile (the same HLO), which the SuperNodes load from JAX's persistent cache
    (tests/flower/test_flower.py compares Flower with the batched ``"vmap"`` run: bitwise equal).
    A run with another seed differs by more than 1e-2 (asserted below), so 1e-4 separates "the
    same computation" from a different one.
    """
    reference, other = (run.state.q for run in _in_process(logistic_data, SEED, SEED + 1))
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
    for got, want, off in zip(*(jax.tree.leaves(t) for t in (q, reference, other))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert np.max(np.abs(np.asarray(off) - np.asarray(want))) > 1e-2  # the seed matters


class _SlowGrid:
    """A grid whose replies come after ``delay`` pulls: what PollingGrid wraps."""

    def __init__(self, delay):
        self.delay, self.pulls = delay, 0

    def push_messages(self, messages):
        return [f"id{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, message_ids):
        self.pulls += 1
        if self.pulls < self.delay:
            return []
        return [_Reply(i) for i in sorted(message_ids)]


class _Reply:
    def __init__(self, message_id):
        self.metadata = type("Metadata", (), {"reply_to_message_id": message_id})()


def test_polling_grid_collects_replies_every_poll_interval_and_stops_at_the_timeout():
    """Before: Flower's deployment grid waited 3 s between pulls, so a round took at least 3 s."""
    from numpyro_pvi.flower.grid import PollingGrid

    inner = _SlowGrid(delay=4)
    start = time.perf_counter()
    replies = PollingGrid(inner, poll_interval=0.01).send_and_receive(["a", "b"], timeout=5)
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["id0", "id1"]
    assert inner.pulls == 4 and time.perf_counter() - start < 1.0
    # no reply within the timeout: what came (nothing) comes back, after about the timeout
    start = time.perf_counter()
    assert PollingGrid(_SlowGrid(delay=10**9), 0.01).send_and_receive(["a"], timeout=0.2) == []
    assert 0.2 <= time.perf_counter() - start < 1.5
    with pytest.raises(ValueError, match="poll_interval"):
        PollingGrid(inner, poll_interval=0)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--isolation", "subprocess"], "--isolation process"),
        (["--superexec-auth-secret-file", "secret"], "does not sign"),
    ],
)
def test_the_warm_supernode_refuses_what_it_cannot_do_before_starting(argv, match):
    from numpyro_pvi.flower.supernode import main

    with pytest.raises(ValueError, match=match):
        main(["--insecure", "--superlink", "127.0.0.1:1", *argv])
