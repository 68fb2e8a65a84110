"""The problem: built once from the data, immutable, its compiled steps reused for data of the same
structure.

Compilations are counted with ``jax.monitoring`` (every XLA compilation, eager operations included)
and, for the round's own step, with JAX's compilation log.
"""

import logging
import warnings
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_pvi as pvi

from fakes import ExactLinearUpdate
from models import linear_model, logistic_model

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextmanager
def compilations():
    """The names of the functions XLA compiles inside the block (one entry per compilation)."""
    events, names = [], []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            events.append(duration)

    class Names(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Finished XLA compilation of "):
                names.append(message.split(" of ")[1].split(" in ")[0])

    handler, logger = Names(), logging.getLogger("jax._src.dispatch")
    jax.monitoring.register_event_duration_secs_listener(listener)
    logger.addHandler(handler)
    previous_level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles(True):
            yield names
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(names) == len(events), (names, events)  # the log and the monitoring events agree


@pytest.fixture(scope="module")
def logistic(logistic_data):
    X, y = logistic_data
    update = pvi.GradientUpdate(optax.adam(1e-2), num_steps=20, num_particles=2, batch_size=50)
    inference = pvi.PVI(
        logistic_model,
        pvi.MeanFieldGaussian(),
        pvi.split_iid(random.PRNGKey(0), 400, 4),
        update,
        pvi.Synchronous(0.5),
    )
    # round 1 compiles
    state, _ = inference.update(inference.init(random.PRNGKey(1), X, y=y), X, y=y)
    return inference, state, X, y


def test_rounds_after_the_first_never_compile(logistic):
    inference, state, X, y = logistic
    with compilations() as compiled:
        for _ in range(3):
            state, info = inference.update(state, X, y=y)
    assert compiled == []
    assert np.isfinite(info.elbo) and info.num_rejected == 0


def test_equal_new_arrays_reuse_the_compiled_steps(logistic):
    inference, state, X, y = logistic
    first = inference.build(X, y=y)
    assert inference.build(X, y=y) is first  # the same arrays: the same problem
    X2, y2 = jnp.array(np.asarray(X)), jnp.array(np.asarray(y))  # equal values, new arrays
    with compilations() as compiled:
        problem = inference.build(X2, y=y2)
        state, _ = inference.update(state, X2, y=y2)
    assert compiled == []
    assert problem is not first and problem.steps is first.steps
    # other values of the same shapes: other data, the same steps
    other = inference.build(X + 1.0, y=y)
    assert other.steps is first.steps and not np.allclose(
        other.clients.arrays[0], first.clients.arrays[0]
    )


@pytest.mark.parametrize(
    "family, features", [(pvi.MeanFieldGaussian(), 13), (pvi.FullRankGaussian(), 17)]
)
def test_a_fresh_configuration_compiles_at_most_five_programs_by_round_one_and_none_again(
    family, features
):
    """From ``PVI(...)`` to the end of round 1 of a configuration new to the process: the model's
    trace, the prior, the start's check, the round's keys and the round's step; the bookkeeping
    between them is NumPy or part of these (before, 21: the first client's rows, the prior's 12
    eager operations, the check's 4 and the keys' 2 besides; full rank 27 more: NumPyro's check of
    the guide's and the cavity's triangular factors, whose mask it builds eagerly while the round
    is traced). A second run on new arrays of the same shapes, init included, compiles nothing."""
    # shapes no other test uses (13 or 17 features, 3 clients of 41 rows): eager operations
    # another test compiled for its own shapes cannot hide a compilation here
    X = random.normal(random.PRNGKey(11), (123, features))
    y = (X[:, 0] > 0).astype(jnp.float32)
    X2, y2 = X + 0.5, 1.0 - y
    parts = pvi.split_iid(random.PRNGKey(0), 123, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)  # one or two rounds: far from converged
        with compilations() as compiled:
            inference = pvi.PVI(
                logistic_model,
                family,
                parts,
                pvi.GradientUpdate(optax.sgd(1e-2), num_steps=2, num_particles=1),
                pvi.Synchronous(1.0),
            )
            first = inference.run(random.PRNGKey(1), 1, X, y=y, progress_bar=False)
        with compilations() as again:
            second = inference.run(random.PRNGKey(2), 2, X2, y=y2, progress_bar=False)
    assert sum("group_step" in name for name in compiled) == 1, compiled
    assert len(compiled) <= 5, compiled
    assert again == []
    assert np.all(np.isfinite(first.history.elbo)) and np.all(np.isfinite(second.history.elbo))


def test_a_gamma_prior_is_read_off_in_four_compiled_programs():
    """``init`` of a conjugate Gamma block compiles the model's trace, the prior's reference draws
    and density, their least-squares fit and the start's check (before, 23: the fit's 20
    operations compiled one program each)."""

    # 7 rates: shapes no other test uses
    def model(y=None):
        rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5).expand([7]).to_event(1))
        with pvi.partition_plate("data", y.shape[0]):
            numpyro.sample("y", dist.Poisson(rate).to_event(1), obs=y)

    y = random.poisson(random.PRNGKey(3), 3.0, (30, 7)).astype(jnp.float32)
    inference = pvi.PVI(
        model,
        pvi.Gamma(),
        pvi.split_iid(random.PRNGKey(0), 30, 3),
        pvi.NaturalGradientUpdate(step_size=1.0, num_particles=4),
        pvi.Synchronous(1.0),
    )
    with compilations() as compiled:
        state = inference.init(random.PRNGKey(1), y=y)
    assert len(compiled) <= 4, compiled
    # the prior read off: Gamma(2, 0.5) in every coordinate (eta = (a - 1, -b))
    np.testing.assert_allclose(state.q.eta1, 1.0, atol=1e-3)
    np.testing.assert_allclose(state.q.eta2, -0.5, atol=1e-3)


def test_a_full_round_over_two_buckets_compiles_one_program_and_a_sampled_round_one_per_bucket():
    """A skewed split (one client of 200 rows, 21 of one row: two size buckets): a round over every
    client runs both buckets and the merge in one compiled ``group_step``; a round over a sample of
    the clients runs each bucket's sample in its own ``run_group`` (compiled once per bucket and
    padded size, whichever buckets a sample touches) and merges them in ``merge_groups``."""
    # shapes no other test uses (7 features, 221 rows)
    X = random.normal(random.PRNGKey(12), (221, 7))
    y = (X[:, 0] > 0).astype(jnp.float32)
    parts = [np.arange(200)] + [np.array([200 + i]) for i in range(21)]
    update = pvi.GradientUpdate(optax.sgd(1e-2), num_steps=2, num_particles=1)
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)  # one round: far from converged
        for name, server in (
            ("full", pvi.Synchronous(1.0)),
            ("sampled", pvi.Synchronous(1.0, clients_per_round=8)),
        ):
            inference = pvi.PVI(logistic_model, pvi.MeanFieldGaussian(), parts, update, server)
            assert [b.clients.mask.shape for b in inference.build(X, y=y).buckets] == [
                (21, 1),
                (1, 200),
            ]
            with compilations() as compiled:
                result = inference.run(random.PRNGKey(4), 1, X, y=y, progress_bar=False)
            runs[name] = (result, [n for n in compiled if "group" in n])
    result, programs = runs["full"]
    assert programs == ["jit(group_step)"], programs
    assert result.history.accepted.all() and np.isfinite(result.history.elbo).all()
    result, programs = runs["sampled"]
    # key 4's sample holds the 200-row client and 7 of the 21 one-row ones (a group of 8 of 21
    # slots)
    assert result.history.clients[0, 0] == 0 and result.history.accepted.all()
    assert sorted(programs) == ["jit(merge_groups)"] + ["jit(run_group)"] * 2, programs


def test_a_problem_is_immutable_and_states_match_their_problem(logistic):
    inference, state, X, y = logistic
    problem = inference.build(X, y=y)
    with pytest.raises(AttributeError):
        problem.sites = None
    assert problem.num_clients == problem.capacity == 4 and list(problem.sizes) == [100] * 4
    too_few = pvi.PVI(
        logistic_model,
        pvi.MeanFieldGaussian(),
        pvi.split_iid(random.PRNGKey(0), 400, 2),
        inference.local_update,
    )
    with pytest.raises(ValueError, match="client slots"):
        too_few.update(state, X, y=y)


def test_a_problem_is_used_only_by_the_pvi_that_built_it(logistic):
    # a problem's compiled steps hold its builder's server and local update: another PVI (here
    # adaptive damping instead of 0.5) given it would silently run the builder's configuration
    inference, state, X, y = logistic
    other = pvi.PVI(
        logistic_model,
        inference.family,
        inference.partitions,
        inference.local_update,
        pvi.Synchronous(),
    )
    with pytest.raises(ValueError, match="built by another PVI: its server"):
        other.update(state, inference.build(X, y=y))
    same = pvi.PVI(
        inference.model,
        inference.family,
        inference.partitions,
        inference.local_update,
        inference.server,
        backend=inference.backend,
        hyper_optimizer=inference.hyper_optimizer,
    )
    assert (
        same.build(X, y=y) is not None
        and inference.build(X, y=y).config.mismatch(same.config) == []
    )


def test_adding_ten_clients_compiles_the_round_about_log2_times(linear_data):
    X, y = linear_data
    parts = np.array_split(np.arange(300), 11)
    tasks = pvi.ClientData([((X[parts[0]],), {"y": y[parts[0]]})])
    inference = pvi.PVI(
        linear_model, pvi.FullRankGaussian(), tasks, ExactLinearUpdate(), pvi.Continual()
    )
    problem = inference.build()
    state, _ = inference.update(inference.init(random.PRNGKey(0), problem), problem)
    with compilations() as compiled:
        for p in parts[1:]:
            old = problem
            state, problem = inference.add_client(state, problem, X[p], y=y[p])
            state, info = inference.update(state, problem)
            assert old.num_clients == problem.num_clients - 1  # the old problem is unchanged
            np.testing.assert_array_equal(info.attempts, [0] * (problem.num_clients - 1) + [1])
    rounds = [name for name in compiled if "group_step" in name]
    # capacity 1 -> 2 -> 4 -> 8 -> 16: one compilation of the round per growth, ceil(log2(11)) = 4
    assert len(rounds) <= 4, rounds
    assert (
        problem.num_clients == 11 and problem.capacity == 16 and state.factors.eta1.shape[0] == 16
    )
    from models import exact_linear_posterior

    loc = inference.family.loc_scale(state.q)[0]
    np.testing.assert_allclose(loc, exact_linear_posterior(X, y)[0], rtol=1e-4)


def test_inference_holds_configuration_only(logistic):
    inference, state, X, y = logistic
    before = dict(vars(inference))
    result = inference.run(random.PRNGKey(3), 1, X, y=y, progress_bar=False)
    assert {k: v for k, v in vars(inference).items() if k != "_memo"} == {
        k: v for k, v in before.items() if k != "_memo"
    }
    assert result.problem is inference.build(X, y=y) and result.num_clients == 4
