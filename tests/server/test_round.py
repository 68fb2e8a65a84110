"""A round's bookkeeping: which factors a compiled step may consume (``OwnedFactors``)."""

import jax
import numpy as np
import pytest
from jax import random

import numpyro_pvi as pvi

from fakes import UNEQUAL, ExactLinearUpdate
from models import linear_model


def _pointers(factors):
    return [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(factors)]


def _spied(server, data):
    """An inference, its problem and the list of ``(factors handed in, factors made)`` buffer
    addresses of every call of the compiled group step."""
    X, y = data
    inference = pvi.PVI(linear_model, pvi.FullRankGaussian(), UNEQUAL, ExactLinearUpdate(), server)
    problem, calls = inference.build(X, y=y), []

    def group_step(state, groups, key, pulled, run=problem.steps.group_step):
        handed = _pointers(state.factors)
        state, out = run(state, groups, key, pulled)
        calls.append((handed, _pointers(state.factors)))
        return state, out

    object.__setattr__(problem, "steps", problem.steps._replace(group_step=group_step))
    return inference, problem, calls


@pytest.mark.parametrize("server", [pvi.Synchronous(0.5), pvi.Sequential()], ids=repr)
def test_a_run_merges_into_the_factors_memory_and_keeps_the_callers_state(linear_data, server):
    """Issue 27: at a million clients, copying all M factors was most of a round. In a run each
    merge writes into the memory of the factors the step before made (donated: the same buffer
    in and out); the caller's state is copied once, and stays intact."""
    inference, problem, calls = _spied(server, linear_data)
    state = inference.init(random.PRNGKey(0), problem)
    before = jax.tree.map(np.array, state.factors)
    result = inference.run(random.PRNGKey(0), 3, problem, init_state=state, progress_bar=False)
    jax.tree.map(np.testing.assert_array_equal, state.factors, before)  # not consumed
    assert calls[0][0] != _pointers(state.factors)  # the first step got a copy
    for (handed, made), (next_handed, _) in zip(calls, calls[1:] + [(None, None)]):
        assert made == handed  # merged in place
        assert next_handed in (made, None)  # the next step got them, no copy
    assert _pointers(result.state.factors) == calls[-1][1]
    kept = jax.tree.map(np.array, result.state.factors)
    inference.update(result.state, problem)  # update() leaves its input intact too
    jax.tree.map(np.testing.assert_array_equal, result.state.factors, kept)


def test_heavy_ball_and_averaging_get_the_factors_a_round_started_from(linear_data):
    """The heavy ball reads the factors a round started from, and ``average_rounds`` keeps each
    round's: their rounds' steps get copies (a new buffer every round; consuming the factors
    ``before`` holds would fail the heavy ball's step on a deleted array)."""
    for server, average in ((pvi.Synchronous(), None), (pvi.Synchronous(0.5), 2)):
        inference, problem, calls = _spied(server, linear_data)
        result = inference.run(
            random.PRNGKey(0), 3, problem, progress_bar=False, average_rounds=average
        )
        assert all(made != next_handed for (_, made), (next_handed, _) in zip(calls, calls[1:]))
        assert np.isfinite(np.asarray(result.state.factors.eta1)).all()
        if average is not None:
            averaged = result.averaged()
            assert np.isfinite(np.asarray(averaged.state.factors.eta1)).all()
