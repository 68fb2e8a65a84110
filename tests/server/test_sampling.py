"""Client sampling (``clients_per_round``): exact fixed point, seeded draws, and K = M is no
sampling at all."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64, random

import numpyro_pvi as pvi
from numpyro_pvi.state import CLIENT_FIELDS

from fakes import UNEQUAL, ExactLinearUpdate
from models import exact_linear_posterior, linear_model


def _run(server, data, rounds, seed=0, inference=None):
    X, y = data
    if inference is None:
        inference = pvi.PVI(
            linear_model, pvi.FullRankGaussian(), UNEQUAL, ExactLinearUpdate(), server
        )
    return inference, inference.run(random.PRNGKey(seed), rounds, X, y=y, progress_bar=False)


@pytest.mark.parametrize(
    "server",
    [pvi.Synchronous(1.0, clients_per_round=2), pvi.Asynchronous(1.0, clients_per_round=0.5)],
    ids=repr,
)
def test_k_of_m_per_round_reaches_the_exact_posterior(linear_data, server):
    with enable_x64(True):
        data = tuple(jnp.asarray(a, jnp.float64) for a in linear_data)
        inference, result = _run(server, data, 8)
        assert result.history.clients.shape == (8, 2)  # each round records its 2 clients
        attempts = result.history.dense(4).attempts
        np.testing.assert_array_equal(attempts.sum(1), 2)  # 2 of the 4 clients run in every round
        # ... and every client was drawn in 8 rounds
        assert attempts.max() == 1 and (attempts.sum(0) > 0).all()
        # exact local updates: a drawn client's factor becomes its exact likelihood, an undrawn one
        # keeps its factor, so once every client has run q is the exact posterior (to float64
        # round-off)
        mean, cov = exact_linear_posterior(*data)
        loc, scale_tril = inference.family.loc_scale(result.state.q)
        np.testing.assert_allclose(loc, mean, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(scale_tril @ scale_tril.T, cov, rtol=1e-9, atol=1e-14)


def test_sampled_sets_are_seeded_and_reproducible(linear_data):
    # one PVI for the three runs: its compiled round serves them all
    server = pvi.Synchronous(0.5, clients_per_round=2)
    inference = pvi.PVI(linear_model, pvi.FullRankGaussian(), UNEQUAL, ExactLinearUpdate(), server)
    runs = [_run(server, linear_data, 6, seed, inference)[1].history.clients for seed in (0, 0, 1)]
    np.testing.assert_array_equal(runs[0], runs[1])
    # another seed draws other clients (fails with prob. 6^-6)
    assert not np.array_equal(runs[0], runs[2])
    # the draws are not always the same pair: some two rounds differ
    assert len({tuple(r) for r in runs[0]}) > 1


@pytest.mark.parametrize(
    "make",
    [
        lambda k: pvi.Synchronous(0.5, clients_per_round=k),
        lambda k: pvi.Asynchronous(0.5, speeds=[1, 2, 1, 0.5], clients_per_round=k),
    ],
)
def test_k_equal_to_m_is_bitwise_no_sampling(linear_data, make):
    base = _run(make(None), linear_data, 3)[1]
    for k in (4, 1.0):
        result = _run(make(k), linear_data, 3)[1]
        for a, b in zip(
            jax.tree.leaves((base.state.q, base.state.factors)),
            jax.tree.leaves((result.state.q, result.state.factors)),
        ):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(base.history.attempts, result.history.attempts)


def test_client_weights_draw_only_weighted_clients(linear_data):
    server = pvi.Synchronous(0.5, clients_per_round=2, client_weights=[0.0, 1.0, 3.0, 0.0])
    sampled = _run(server, linear_data, 4)[1].history
    np.testing.assert_array_equal(sampled.clients, [[1, 2]] * 4)
    np.testing.assert_array_equal(sampled.attempts, [[1, 1]] * 4)
    history = sampled.dense(4)
    assert history.clients is None
    np.testing.assert_array_equal(history.attempts, [[0, 1, 1, 0]] * 4)
    # RoundInfo counts the messages: q and the cavity down (3 + 3x3 float32 each), the delta and the
    # free energy up; a client that did not run sent and received nothing
    np.testing.assert_array_equal(history.bytes_received, [[0, 96, 96, 0]] * 4)
    np.testing.assert_array_equal(history.bytes_sent, [[0, 52, 52, 0]] * 4)
    assert np.isnan(history.free_energy[:, [0, 3]]).all() and (history.inflation == 1).all()


@pytest.mark.parametrize(
    "bad, match",
    [
        (0, "at least 1"),
        (-2, "at least 1"),
        (1.5, r"\(0, 1\]"),
        (0.0, r"\(0, 1\]"),
        ("3", "an int"),
        (True, "an int"),
    ],
)
def test_clients_per_round_is_checked(bad, match):
    for server in (pvi.Synchronous, pvi.Asynchronous):
        with pytest.raises(ValueError, match=match):
            server(clients_per_round=bad)


def test_clients_per_round_and_weights_are_checked_against_the_clients(linear_data):
    X, y = linear_data
    for server, match in [
        (pvi.Synchronous(clients_per_round=5), "only 4 clients"),
        (pvi.Asynchronous(clients_per_round=2, client_weights=[1, 1, 1]), "3 client_weights"),
        (pvi.Synchronous(clients_per_round=2, client_weights=[1, 0, 0, 0]), "positive weight"),
    ]:
        inference = pvi.PVI(
            linear_model, pvi.FullRankGaussian(), UNEQUAL, ExactLinearUpdate(), server
        )
        with pytest.raises(ValueError, match=match):
            inference.build(X, y=y)
    with pytest.raises(ValueError, match="client_weights"):
        pvi.Synchronous(client_weights=[1.0, -1.0])


def _sampled_round_work(num_clients, rounds=1):
    """What sampled rounds over ``num_clients`` one-row clients (100 per round, the ELBO over a
    sample of 200) hand the compiled steps: each round's group sizes and the clients the ELBO pass
    runs over; and how many clients ran."""
    X = random.normal(random.PRNGKey(0), (num_clients, 3))
    y = X @ jnp.array([1.0, -0.5, 0.3]) + 0.5 * random.normal(random.PRNGKey(1), (num_clients,))
    parts = list(np.arange(num_clients).reshape(num_clients, 1))
    inference = pvi.PVI(
        linear_model,
        pvi.FullRankGaussian(),
        parts,
        ExactLinearUpdate(),
        pvi.Synchronous(0.5, clients_per_round=100),
        num_elbo_clients=200,
    )
    problem = inference.build(X, y=y)
    seen = {"groups": [], "elbo": []}

    def group_step(state, groups, key, pulled, run=problem.steps.group_step):
        seen["groups"].append([int(g.local.shape[0]) for g in groups])
        return run(state, groups, key, pulled)

    def elbo(q, key, clients, *rest, run=problem.steps.elbo):
        seen["elbo"].append([int(c.mask.shape[0]) for c in clients])
        return run(q, key, clients, *rest)

    steps = problem.steps._replace(group_step=group_step, elbo=elbo)
    object.__setattr__(problem, "steps", steps)  # a spy on the frozen problem's steps
    state, ran = inference.init(random.PRNGKey(0), problem), 0
    for _ in range(rounds):
        state, info = inference.update(state, problem)
        ran += int(info.attempts.sum())
        # the shapes of the round's record: its sampled clients' ids and per-client fields
        fields = [info.clients] + [getattr(info, name) for name in CLIENT_FIELDS]
        seen["record"] = sorted({np.shape(x) for x in fields})
    return seen, ran


def test_a_sampled_rounds_work_does_not_grow_with_the_clients():
    """Issue 27, item 3: a round of ``clients_per_round=K`` must cost the same at M = 1,000 and
    10,000 (and 10^6, ``benchmarks/scale.py --million``). The compiled group step gets the same
    group sizes (K = 100 padded to 128) and the round's ELBO passes over the same 200 sampled
    clients, not every client's data (on main: a pass over all M, and no ``num_elbo_clients``)."""
    small, large = _sampled_round_work(1_000), _sampled_round_work(10_000)
    assert small == large
    seen, ran = small
    assert seen["groups"] == [[128]] and ran == 100
    assert seen["elbo"] == [[200]]
    assert seen["record"] == [(100,)]  # RoundInfo: the K sampled clients' entries, not M


def test_an_elbo_sample_of_every_client_is_the_pooled_elbo(linear_data):
    """``num_elbo_clients >= M`` is the pass over every client (bitwise the default's ELBO), and a
    sample of 2 of the 4 clients is scaled by M / S = 2 (its ELBO differs, but is close: the
    clients' terms are of similar size)."""
    X, y = linear_data
    elbos = {}
    for num in (None, 4, 2):
        inference = pvi.PVI(
            linear_model,
            pvi.FullRankGaussian(),
            UNEQUAL,
            ExactLinearUpdate(),
            pvi.Synchronous(0.5, clients_per_round=2),
            num_elbo_clients=num,
        )
        result = inference.run(random.PRNGKey(0), 3, X, y=y, progress_bar=False)
        elbos[num] = result.history.elbo
    np.testing.assert_array_equal(elbos[None], elbos[4])
    assert not np.array_equal(elbos[None], elbos[2])
    assert np.all(np.isfinite(elbos[2]))


@pytest.mark.parametrize("bad", [0, 2.5, True, -3])
def test_pvi_refuses_a_bad_num_elbo_clients_by_name(bad):
    with pytest.raises(ValueError, match="num_elbo_clients"):
        pvi.PVI(
            linear_model, pvi.FullRankGaussian(), UNEQUAL, ExactLinearUpdate(), num_elbo_clients=bad
        )
