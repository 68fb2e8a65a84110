"""No silent failure: a run says when updates are all rejected, clamped away or stale, when q stalls, and
whether it converged (``RoundInfo.rejection`` / ``moved`` / ``change``, ``PVIWarning``, ``result.converged``)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import enable_x64, random
from test_backends import FaultyUpdate

import numpyro_pvi as pvi

from conftest import exact_linear_posterior, linear_model
from test_servers import UNEQUAL, ExactLinearUpdate, PoisonedUpdate

FIVE = np.array_split(np.arange(300), 5)


class ClampedAway(ExactLinearUpdate):
    """Every step would leave q invalid: no step is taken (delta 0) and 6 halvings are reported."""

    def bind(self, problem):
        def client_update(rng_key, client, cavity, q, state, hyper=()):
            return pvi.ClientResult(jax.tree.map(jnp.zeros_like, q), jnp.zeros(()), state, 6)

        return client_update


def test_max_staleness_that_rejects_every_update_says_so_and_a_sensible_one_converges(linear_data):
    with enable_x64(True):
        X, y = (jnp.asarray(a, jnp.float64) for a in linear_data)
        strict = pvi.PVI(linear_model, pvi.FullRankGaussian(), FIVE, ExactLinearUpdate(),
                         pvi.Asynchronous(damping=0.5, max_staleness=2))
        with pytest.warns(pvi.PVIWarning, match=r"max_staleness=2\) rejected every update: they were 4-4 merges "
                                                r"stale; max_staleness >= 4 would admit"):
            result = strict.run(random.PRNGKey(0), 4, X, y=y, progress_bar=False)
        assert (result.history.rejection[1:] == pvi.Rejection.STALE).all() and (result.history.change[1:] == 0).all()
        sensible = pvi.PVI(linear_model, pvi.FullRankGaussian(), FIVE, ExactLinearUpdate(),
                           pvi.Asynchronous(damping=0.5, max_staleness=4))
        with warnings.catch_warnings():
            warnings.simplefilter("error", pvi.PVIWarning)
            result = sensible.run(random.PRNGKey(0), 40, X, y=y, progress_bar=False, tol=1e-8)
        assert result.converged and (result.history.rejection == 0).all()
        mean, _ = exact_linear_posterior(X, y)
        np.testing.assert_allclose(sensible.family.loc_scale(result.state.q)[0], mean, rtol=1e-6)


def test_updates_clamped_away_warn_and_a_stall_is_named(linear_data):
    X, y = linear_data
    inference = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), UNEQUAL, ClampedAway(), pvi.Synchronous(0.5))
    with pytest.warns(pvi.PVIWarning) as caught:
        result = inference.run(random.PRNGKey(0), 4, X, y=y, progress_bar=False)
    messages = [str(w.message) for w in caught]
    assert sum("rejected or clamped away" in m and "steps clamped: 24" in m for m in messages) == 1  # once per run
    assert sum("has not moved for 3 rounds" in m for m in messages) == 1
    assert result.history.num_rejected.sum() == 0 and not result.history.moved.any()


def test_rejection_reasons_are_recorded(linear_data):
    X, y = linear_data
    cases = [(PoisonedUpdate(bad_size=20), 2, pvi.Rejection.NON_FINITE), (FaultyUpdate(90, "raise"), 1,
                                                                             pvi.Rejection.RAISED)]
    for update, bad, reason in cases:
        inference = pvi.PVI(linear_model, pvi.FullRankGaussian(), UNEQUAL, update, pvi.Synchronous(1.0), backend="loop")
        _, info = inference.update(inference.init(random.PRNGKey(0), X, y=y), X, y=y)
        expected = np.zeros(4, int)
        expected[bad] = reason
        np.testing.assert_array_equal(info.rejection, expected)
        assert info.moved[[m for m in range(4) if m != bad]].all() and not info.moved[bad]


def test_tol_stops_a_converged_run_and_says_whether_it_converged(linear_data):
    X, y = linear_data
    exact = pvi.PVI(linear_model, pvi.FullRankGaussian(), UNEQUAL, ExactLinearUpdate(), pvi.Sequential())
    result = exact.run(random.PRNGKey(0), 10, X, y=y, progress_bar=False, tol=1e-4)
    # round 1 is exact (sequential, exact local updates); round 2 moves nothing: the run stops there
    assert result.converged and len(result.history.elbo) == 2 and result.history.change[-1] <= 1e-4
    assert exact.run(random.PRNGKey(0), 2, X, y=y, progress_bar=False).converged is None  # no tol, no verdict
    noisy = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), UNEQUAL, pvi.GradientUpdate(optax.adam(1e-3), 5),
                    pvi.Synchronous(0.5))
    with pytest.warns(pvi.PVIWarning, match="did not converge in 2 rounds"):
        result = noisy.run(random.PRNGKey(0), 2, X, y=y, progress_bar=False, tol=1e-6)
    assert result.converged is False
    with pytest.raises(ValueError, match="tol must be a positive number"):
        exact.run(random.PRNGKey(0), 2, X, y=y, tol=0.0)
