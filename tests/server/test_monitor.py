"""No silent failure: a run says when updates are all rejected, clamped away or stale, when q
stalls, and whether it converged (``RoundInfo.rejection`` / ``moved`` / ``change``, ``PVIWarning``,
``result.converged``)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import enable_x64, random

import numpyro_pvi as pvi
from numpyro_pvi.families import NatParams
from numpyro_pvi.server.monitor import (
    DRIFT_FLOOR,
    STOP_REASONS,
    RunMonitor,
    coordinate_drift,
    q_change,
    trend,
)

from fakes import UNEQUAL, ExactLinearUpdate, FaultyUpdate, PoisonedUpdate
from models import exact_linear_posterior, linear_model

FIVE = np.array_split(np.arange(300), 5)


def caught_messages(caught):
    return [str(w.message) for w in caught if issubclass(w.category, pvi.PVIWarning)]


def says_why(result, messages):
    """The result and the warnings agree: converged iff no end warning; otherwise one names
    stopped_because."""
    end = [m for m in messages if "result.stopped_because ==" in m]
    if result.converged or result.stopped_because == "num_rounds":
        return not end
    return any(f"result.stopped_because == {result.stopped_because!r}" in m for m in end)


class ClampedAway(ExactLinearUpdate):
    """Every step would leave q invalid: no step is taken (delta 0) and 6 halvings are reported."""

    def bind(self, problem):
        def client_update(rng_key, client, cavity, q, state, hyper=()):
            return pvi.local_updates.ClientResult(
                jax.tree.map(jnp.zeros_like, q), jnp.zeros(()), state, 6
            )

        return client_update


def test_max_staleness_that_rejects_every_update_says_so_and_a_sensible_one_converges(linear_data):
    with enable_x64(True):
        X, y = (jnp.asarray(a, jnp.float64) for a in linear_data)
        strict = pvi.PVI(
            linear_model,
            pvi.FullRankGaussian(),
            FIVE,
            ExactLinearUpdate(),
            pvi.Asynchronous(damping=0.5, max_staleness=2),
        )
        with pytest.warns(
            pvi.PVIWarning,
            match=r"max_staleness=2\) rejected every update: they "
            r"were 4-4 merges "
            r"stale; max_staleness >= 4 would admit",
        ) as caught:
            result = strict.run(random.PRNGKey(0), 4, X, y=y, progress_bar=False, tol=1e-8)
        assert (result.history.rejection[1:] == pvi.state.Rejection.STALE).all() and (
            result.history.change[1:] == 0
        ).all()
        # q did not move because nothing was merged: not converged (on main: converged=True after
        # round 2)
        assert (
            len(result.history.elbo) == 4
            and result.converged is False
            and result.stopped_because == "not_merged"
        )
        assert says_why(result, caught_messages(caught))
        sensible = pvi.PVI(
            linear_model,
            pvi.FullRankGaussian(),
            FIVE,
            ExactLinearUpdate(),
            pvi.Asynchronous(damping=0.5, max_staleness=4),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", pvi.PVIWarning)
            result = sensible.run(random.PRNGKey(0), 40, X, y=y, progress_bar=False, tol=1e-8)
        assert (
            result.converged
            and result.stopped_because == "converged"
            and (result.history.rejection == 0).all()
        )
        mean, _ = exact_linear_posterior(X, y)
        np.testing.assert_allclose(sensible.family.loc_scale(result.state.q)[0], mean, rtol=1e-6)


def test_updates_clamped_away_warn_and_a_stall_is_named(linear_data):
    X, y = linear_data
    inference = pvi.PVI(
        linear_model, pvi.MeanFieldGaussian(), UNEQUAL, ClampedAway(), pvi.Synchronous(0.5)
    )
    with pytest.warns(pvi.PVIWarning) as caught:
        result = inference.run(random.PRNGKey(0), 4, X, y=y, progress_bar=False, tol=0.05)
    messages = caught_messages(caught)
    assert (
        sum(
            "Every client update of a round was rejected or clamped away" in m
            and "steps clamped: 24" in m
            for m in messages
        )
        == 1
    )  # once per run
    assert sum("has not moved for 3 rounds" in m for m in messages) == 1
    assert result.history.num_rejected.sum() == 0 and not result.history.moved.any()
    # change 0 from round 1 on, but every step was clamped away: not converged (on main: converged
    # after round 1)
    assert (
        result.converged is False
        and result.stopped_because == "not_merged"
        and says_why(result, messages)
    )


def test_rejection_reasons_are_recorded(linear_data):
    X, y = linear_data
    cases = [
        (PoisonedUpdate(bad_size=20), 2, pvi.state.Rejection.NON_FINITE),
        (FaultyUpdate(90, "raise"), 1, pvi.state.Rejection.RAISED),
    ]
    for update, bad, reason in cases:
        inference = pvi.PVI(
            linear_model,
            pvi.FullRankGaussian(),
            UNEQUAL,
            update,
            pvi.Synchronous(1.0),
            backend="loop",
        )
        _, info = inference.update(inference.init(random.PRNGKey(0), X, y=y), X, y=y)
        expected = np.zeros(4, int)
        expected[bad] = reason
        np.testing.assert_array_equal(info.rejection, expected)
        assert info.moved[[m for m in range(4) if m != bad]].all() and not info.moved[bad]


def test_tol_stops_a_converged_run_and_says_whether_it_converged(linear_data):
    X, y = linear_data
    exact = pvi.PVI(
        linear_model, pvi.FullRankGaussian(), UNEQUAL, ExactLinearUpdate(), pvi.Sequential()
    )
    result = exact.run(random.PRNGKey(0), 10, X, y=y, progress_bar=False, tol=1e-4)
    # round 1 is exact (sequential, exact local updates); round 2 moves nothing: the run stops there
    assert result.converged and len(result.history.elbo) == 2 and result.history.change[-1] <= 1e-4
    assert result.stopped_because == "converged"
    # no tol, no verdict
    assert exact.run(random.PRNGKey(0), 2, X, y=y, progress_bar=False).converged is None
    noisy = pvi.PVI(
        linear_model,
        pvi.MeanFieldGaussian(),
        UNEQUAL,
        pvi.GradientUpdate(optax.adam(1e-3), 5),
        pvi.Synchronous(0.5),
    )
    with pytest.warns(pvi.PVIWarning, match="did not converge in 2 rounds") as caught:
        result = noisy.run(random.PRNGKey(0), 2, X, y=y, progress_bar=False, tol=1e-6)
    # too few rounds to tell why
    assert result.converged is False and result.stopped_because == "not_settled"
    assert says_why(result, caught_messages(caught))
    with pytest.raises(ValueError, match="tol must be a positive number"):
        exact.run(random.PRNGKey(0), 2, X, y=y, tol=0.0)


# ---------------------------------------------------------------- converged only when earned; why a
# run stopped


def round_info(
    change,
    elbo=-100.0,
    num_clients=4,
    attempts=1,
    accepted=None,
    rejection=0,
    clamped=0,
    moved=True,
    inflation=1.0,
):
    """A synthetic RoundInfo: every client attempted (``attempts``) and merged unless ``rejection``
    says not."""
    full = lambda value, dtype: np.broadcast_to(np.asarray(value, dtype), (num_clients,)).copy()  # noqa: E731
    rejection, attempts = full(rejection, int), full(attempts, int)
    accepted = np.where(rejection > 0, 0, attempts) if accepted is None else full(accepted, int)
    return pvi.RoundInfo(
        elbo,
        np.zeros(num_clients),
        attempts,
        accepted,
        np.ones(num_clients),
        full(clamped, int),
        0.0,
        rejection,
        full(moved, bool),
        change,
        inflation=full(inflation, float),
    )


def watch(infos, tol, moves=None, history=None, num_clients=None):
    """Feed ``infos`` to a RunMonitor: ``(converged, stopped_because, PVIWarning messages)``."""
    monitor = RunMonitor(pvi.Synchronous(), tol, history)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r, info in enumerate(infos):
            monitor.after_round(info, [], None if moves is None else moves[r], num_clients)
        converged, reason = monitor.at_end()
    return converged, reason, caught_messages(caught)


SHRINKING = [0.6**r * np.array([1.0, 0.5, -0.2, 0.1]) for r in range(8)]  # one direction, shrinking
JITTER = list(0.1 * random.normal(random.PRNGKey(0), (8, 4)))  # unrelated directions, one size
SWINGS = [(-1.0) ** r * np.array([0.3, -0.2, 0.1, 0.0]) for r in range(8)]  # back and forth


def stack(infos):
    return pvi.RoundInfo.stacked(infos)


DRIFT = [np.array([0.04, -0.02, 0.01]) * 0.95**r for r in range(6)]
# the last moves q by 0.02 sds
HALVING = [np.array([0.04, -0.02, 0.01]) * 0.5**r * 16 for r in range(6)]
# Measured: mean field on sklearn's diabetes data (w ~ N(0, tau), tau and sigma HalfNormal, 10 iid
# clients, GradientUpdate(adam(1e-2), 300, 8), Sequential(), tol=0.05), rounds 18-23: the 13 means
# (tau, sigma, b, w) then the 13 log sds. Coordinates 7 and 8 (two correlated coefficients) move
# 0.04-0.07 sds a round one way, and 11 by 0.01-0.04, while the rest jitter by as much in unrelated
# directions (a mean cosine of 0.35): main said converged=True 0.57 sds from the mean-field optimum
# (numpyro SVI, 2 x 30,000 steps, seeds 0.06 sds apart).
SLOW_COORDINATE = [
    np.array(m)
    for m in [
        [
            0.005,
            -0.018,
            -0.001,
            -0.003,
            -0.02,
            -0.007,
            -0.007,
            -0.071,
            0.071,
            0.035,
            -0.01,
            0.012,
            -0.011,
            0.0,
            -0.034,
            -0.006,
            0.006,
            0.013,
            -0.009,
            -0.009,
            0.016,
            0.024,
            0.05,
            0.007,
            0.004,
            0.003,
        ],
        [
            0.002,
            0.013,
            0.013,
            0.006,
            0.002,
            -0.002,
            -0.006,
            -0.075,
            0.05,
            0.014,
            0.01,
            0.038,
            0.006,
            0.0,
            0.05,
            -0.017,
            0.03,
            -0.001,
            -0.009,
            -0.009,
            0.024,
            -0.017,
            -0.005,
            -0.021,
            0.002,
            -0.003,
        ],
        [
            0.007,
            -0.006,
            0.003,
            0.018,
            0.011,
            -0.005,
            0.006,
            -0.062,
            0.049,
            0.013,
            0.01,
            0.039,
            -0.004,
            -0.001,
            -0.028,
            0.014,
            -0.025,
            0.036,
            0.005,
            0.025,
            0.005,
            0.022,
            -0.026,
            0.017,
            -0.006,
            0.026,
        ],
        [
            0.007,
            -0.018,
            -0.003,
            -0.013,
            -0.025,
            -0.011,
            0.0,
            -0.067,
            0.042,
            0.046,
            -0.017,
            0.002,
            0.007,
            -0.0,
            -0.001,
            0.013,
            0.001,
            -0.034,
            0.008,
            -0.005,
            -0.014,
            -0.01,
            0.016,
            -0.006,
            -0.02,
            -0.008,
        ],
        [
            -0.001,
            0.031,
            0.0,
            -0.003,
            0.019,
            0.024,
            -0.004,
            -0.06,
            0.044,
            0.024,
            0.005,
            0.012,
            -0.011,
            0.002,
            -0.002,
            0.007,
            -0.027,
            0.008,
            -0.006,
            0.008,
            0.007,
            -0.009,
            -0.02,
            0.004,
            0.039,
            -0.017,
        ],
        [
            0.005,
            -0.017,
            -0.01,
            0.004,
            0.01,
            0.013,
            0.032,
            -0.042,
            0.046,
            0.006,
            0.02,
            0.034,
            0.007,
            -0.002,
            0.007,
            -0.019,
            0.0,
            -0.012,
            -0.006,
            -0.012,
            -0.02,
            -0.006,
            0.019,
            0.005,
            -0.042,
            -0.0,
        ],
    ]
]
# Measured (the same diabetes model, /tmp-style script: record q after each round, SVI optimum from
# numpyro SVI with AutoNormal, 30,000 Adam steps with a cosine-decayed rate, 16 particles; seeds 0
# and 1 0.018 sds apart): the last 6 moves of q before main said converged=True. Sequential(), seed
# 0, rounds 25-30: coordinate 7 moved 0.036-0.049 sds a round one way but 0.002 the other way in
# round 29, so "one sign in every move" missed it; q was 0.31 sds from the optimum. Synchronous(),
# seed 2, rounds 23-28: 0.21 sds off, coordinate 7 summed -0.15 over the window.
ONE_WAY_WITH_A_SLIP = [
    np.array(m)
    for m in [
        [
            0.002,
            0.002,
            -0.005,
            0.006,
            0.005,
            -0.027,
            -0.009,
            -0.049,
            0.02,
            0.025,
            -0.004,
            0.017,
            -0.014,
            0.002,
            -0.036,
            0.004,
            0.0,
            0.022,
            0.012,
            0.002,
            -0.021,
            -0.005,
            0.031,
            0.013,
            -0.006,
            -0.016,
        ],
        [
            -0.001,
            0.004,
            -0.019,
            -0.001,
            0.01,
            0.002,
            0.01,
            -0.039,
            0.036,
            -0.002,
            0.02,
            0.023,
            -0.013,
            0.001,
            0.02,
            0.014,
            0.011,
            0.0,
            0.004,
            0.002,
            0.006,
            0.005,
            -0.017,
            -0.003,
            -0.005,
            -0.008,
        ],
        [
            0.006,
            -0.016,
            -0.003,
            -0.013,
            -0.028,
            0.002,
            -0.026,
            -0.036,
            0.03,
            0.039,
            -0.014,
            -0.011,
            0.008,
            -0.002,
            -0.005,
            -0.019,
            -0.009,
            -0.004,
            -0.008,
            -0.021,
            0.021,
            0.012,
            0.019,
            -0.001,
            0.035,
            0.011,
        ],
        [
            -0.003,
            0.027,
            -0.006,
            0.015,
            -0.004,
            0.02,
            0.012,
            -0.049,
            0.007,
            -0.003,
            0.008,
            0.032,
            0.0,
            0.002,
            0.041,
            0.005,
            0.004,
            -0.013,
            -0.004,
            0.014,
            -0.038,
            -0.016,
            -0.035,
            0.005,
            -0.022,
            0.0,
        ],
        [
            0.011,
            -0.007,
            0.033,
            -0.005,
            0.013,
            -0.008,
            0.014,
            0.002,
            0.051,
            0.008,
            0.021,
            0.031,
            0.014,
            -0.003,
            -0.012,
            0.013,
            0.027,
            0.007,
            -0.001,
            0.009,
            0.039,
            -0.002,
            0.01,
            -0.023,
            -0.017,
            -0.008,
        ],
        [
            0.003,
            0.012,
            -0.008,
            -0.007,
            -0.01,
            -0.022,
            -0.016,
            -0.046,
            0.007,
            0.029,
            -0.013,
            -0.017,
            -0.029,
            0.002,
            -0.032,
            0.002,
            -0.021,
            -0.005,
            0.035,
            -0.01,
            -0.008,
            0.036,
            -0.017,
            0.041,
            0.012,
            0.005,
        ],
    ]
]
SYNCHRONOUS_SLIP = [
    np.array(m)
    for m in [
        [
            0.004,
            -0.012,
            0.004,
            0.029,
            0.019,
            0.06,
            0.039,
            0.002,
            0.09,
            -0.017,
            0.07,
            0.065,
            0.06,
            -0.001,
            -0.001,
            -0.024,
            0.001,
            -0.005,
            0.015,
            -0.009,
            0.009,
            0.009,
            -0.015,
            0.005,
            -0.012,
            -0.013,
        ],
        [
            0.014,
            -0.01,
            0.009,
            0.009,
            0.011,
            0.024,
            0.014,
            -0.026,
            0.053,
            0.003,
            0.032,
            0.02,
            0.032,
            -0.003,
            -0.007,
            -0.018,
            0.013,
            -0.015,
            0.001,
            -0.007,
            -0.015,
            -0.013,
            -0.004,
            -0.002,
            -0.004,
            0.0,
        ],
        [
            0.011,
            -0.009,
            0.002,
            -0.022,
            -0.012,
            -0.033,
            -0.025,
            -0.069,
            -0.011,
            0.056,
            -0.041,
            -0.038,
            -0.023,
            -0.001,
            -0.002,
            -0.011,
            0.004,
            -0.012,
            -0.002,
            -0.012,
            -0.01,
            -0.01,
            0.003,
            0.0,
            -0.002,
            0.001,
        ],
        [
            -0.001,
            0.011,
            -0.001,
            -0.015,
            -0.009,
            -0.033,
            -0.016,
            -0.052,
            -0.006,
            0.048,
            -0.031,
            -0.028,
            -0.02,
            0.002,
            -0.001,
            -0.008,
            0.005,
            0.005,
            -0.01,
            -0.007,
            -0.009,
            -0.005,
            -0.008,
            0.0,
            0.006,
            -0.016,
        ],
        [
            -0.006,
            0.011,
            -0.006,
            0.021,
            0.018,
            0.005,
            0.016,
            -0.002,
            0.038,
            0.0,
            0.03,
            0.032,
            0.014,
            0.002,
            0.002,
            0.011,
            0.002,
            0.007,
            -0.008,
            -0.008,
            -0.019,
            0.007,
            0.001,
            -0.006,
            0.01,
            0.014,
        ],
        [
            0.001,
            0.004,
            -0.005,
            0.013,
            0.019,
            0.017,
            0.022,
            -0.004,
            0.034,
            -0.017,
            0.034,
            0.035,
            0.015,
            0.0,
            -0.002,
            0.018,
            -0.01,
            0.002,
            0.0,
            0.001,
            -0.006,
            0.006,
            0.003,
            0.003,
            0.008,
            0.022,
        ],
    ]
]
EVERY = stack([round_info(1.0)])  # a history in which every client was merged


# name: (rounds, tol, moves, history, converged, stopped_because, a phrase of its warning)
def rounds_at_a_flat_elbo(moves):
    """One RoundInfo per move of q, the ELBO flat but for a 0.01-nat wobble."""
    return [round_info(np.abs(m).max(), -497.8 - 0.01 * (r % 2)) for r, m in enumerate(moves)]


CASES = {
    "settled": (
        [round_info(1.0, -200), round_info(0.1, -150), round_info(0.001, -149)],
        0.01,
        None,
        None,
        True,
        "converged",
        None,
    ),
    "all rejected": (
        [round_info(1.0, -200), round_info(0.0, -200, rejection=pvi.state.Rejection.NON_FINITE)],
        0.01,
        None,
        None,
        False,
        "not_merged",
        "non_finite x4",
    ),
    "one raised": (
        [round_info(1.0, -200), round_info(0.001, -199, rejection=[0, 5, 0, 0])],
        0.01,
        None,
        None,
        False,
        "not_merged",
        "raised x1",
    ),
    "clamped away": (
        [round_info(1.0, -200), round_info(0.0, -200, clamped=3, moved=False)],
        0.01,
        None,
        None,
        False,
        "not_merged",
        "steps clamped: 12",
    ),
    # merged and moving, but clamped (the sweep's SNEP cell on a skewed Poisson split: 40+ steps
    # clamped each round, q settled 8.6 NUTS sds off and main said converged=True)
    "clamped, moved": (
        [round_info(1.0, -200), round_info(0.001, -199, clamped=[0, 41, 0, 0])],
        0.01,
        None,
        None,
        False,
        "clamped",
        "client(s) [1] in its last round were clamped (41 steps",
    ),
    "budget spent": (
        [round_info(1.0, -200), round_info(0.001, -199, rejection=[0, 6, 0, 0])],
        0.01,
        None,
        None,
        # a client out of privacy budget sends nothing more: its factor is final
        True,
        "converged",
        None,
    ),
    "sampled": (
        [round_info(0.001, -200, attempts=[1, 0, 0, 0])] * 3,
        0.01,
        None,
        None,
        False,
        "unmerged_clients",
        "3 of 4 clients were never merged",
    ),
    "sampled, merged before": (
        [round_info(0.001, -200, attempts=[1, 0, 0, 0])],
        0.01,
        None,
        EVERY,
        True,
        "converged",
        None,
    ),
    "elbo falling": (
        [
            round_info(1.0, -200),
            round_info(0.5, -100),
            round_info(0.1, -110),
            round_info(0.1, -130),
            round_info(0.001, -160),
        ],
        0.01,
        None,
        None,
        False,
        "elbo_falling",
        "The ELBO fell",
    ),
    "settled after falling": (
        [
            round_info(1.0, -200),
            round_info(0.5, -100),
            round_info(0.1, -110),
            round_info(0.1, -130),
            round_info(0.1, -160),
            round_info(0.001, -159),
        ],
        0.01,
        None,
        None,
        True,
        "converged",
        "The ELBO fell",
    ),
    "still moving": (
        [round_info(np.abs(m).max(), -100 + r) for r, m in enumerate(SHRINKING)],
        0.01,
        SHRINKING,
        None,
        False,
        "still_moving",
        "Run more rounds",
    ),
    "noise floor": (
        [round_info(np.abs(m).max(), -100 + r % 2) for r, m in enumerate(JITTER)],
        0.01,
        JITTER,
        None,
        False,
        "noise_floor",
        "use more particles or local steps",
    ),
    "swinging": (
        [round_info(0.3, -100 - r % 2) for r in range(8)],
        0.01,
        SWINGS,
        None,
        False,
        "swinging",
        "swings back and forth",
    ),
    "too few rounds": (
        [round_info(1.0, -200), round_info(0.5, -100)],
        0.01,
        SHRINKING[:2],
        None,
        False,
        "not_settled",
        "too few rounds (moves of q) to tell",
    ),
    # one way at 0.04 sds a round, shrinking x0.95: below tol=0.05 but about 0.8 sds from where q
    # settles (the sweep's hierarchical cell: converged=True at 0.24 sds from the mean-field
    # optimum)
    "drifting below tol": (
        [round_info(np.abs(m).max(), -100 + r) for r, m in enumerate(DRIFT)],
        0.05,
        DRIFT,
        None,
        False,
        "still_moving",
        "still drifting toward its fixed point",
    ),
    "one coordinate drifting under noise": (
        rounds_at_a_flat_elbo(SLOW_COORDINATE),
        0.05,
        SLOW_COORDINATE,
        None,
        False,
        "still_moving",
        "drifted one way over the last 6 rounds",
    ),
    # ... and one whose drift slips the other way once (on main: converged=True 0.31 / 0.21 sds from
    # the optimum)
    "drift with a slip, Sequential": (
        rounds_at_a_flat_elbo(ONE_WAY_WITH_A_SLIP),
        0.05,
        ONE_WAY_WITH_A_SLIP,
        None,
        False,
        "still_moving",
        "coordinate 7 of q",
    ),
    "drift with a slip, Synchronous": (
        rounds_at_a_flat_elbo(SYNCHRONOUS_SLIP),
        0.05,
        SYNCHRONOUS_SLIP,
        None,
        False,
        "still_moving",
        "coordinate 7 of q",
    ),
    # one way, halving each round: 0.02 sds still to go once a round moves 0.02 sds
    "converging below tol": (
        [round_info(np.abs(m).max(), -100 + r) for r, m in enumerate(HALVING)],
        0.05,
        HALVING,
        None,
        True,
        "converged",
        None,
    ),
    # mean-field EP / SNEP over 4 clients whose tilted distributions have a variance inflation of
    # 1.19 (the sweep's logistic cells: sds 32 % off NUTS and 23 % off mean-field VI, and main said
    # converged=True): 4 x 0.19 > CORRELATED
    "factorised, correlated": (
        [round_info(1.0, -200, inflation=1.19), round_info(0.001, -199, inflation=1.19)],
        0.01,
        None,
        None,
        False,
        "factorised_correlation",
        "cannot represent the correlation. With 4 clients",
    ),
    # one client: EP's marginals are exact however correlated the posterior
    "one client, correlated": (
        [round_info(1.0, -200, 1, inflation=7.0), round_info(0.001, -199, 1, inflation=7.0)],
        0.01,
        None,
        None,
        True,
        "converged",
        None,
    ),
    # 4 x 0.03 = 0.12: the fixed point's sds within about 6 % of mean-field VI's
    "factorised, little correlation": (
        [round_info(1.0, -200, inflation=1.03), round_info(0.001, -199, inflation=1.03)],
        0.01,
        None,
        None,
        True,
        "converged",
        None,
    ),
    "no tol": (
        [round_info(1.0, -200), round_info(0.1, -150)],
        None,
        None,
        None,
        None,
        "num_rounds",
        None,
    ),
    "no tol, far": (
        [round_info(np.abs(m).max() * 10, -100 + r) for r, m in enumerate(JITTER)],
        None,
        [10 * m for m in JITTER],
        None,
        None,
        "noise_floor",
        "ended far from converged",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_converged_only_when_earned_and_the_warning_names_why(case):
    infos, tol, moves, history, converged, reason, phrase = CASES[case]
    got, why, messages = watch(infos, tol, moves, history)
    assert (got, why) == (converged, reason) and why in STOP_REASONS
    end = [m for m in messages if "result.stopped_because ==" in m]
    if converged or reason == "num_rounds":
        assert not end  # the result and the warnings never disagree
    else:
        assert len(end) == 1 and f"result.stopped_because == {reason!r}" in end[0]
    if phrase is not None:
        assert any(phrase in m for m in messages), messages
    # rounds cannot help at the noise floor, and cost a DP run its budget
    if reason == "noise_floor":
        assert (
            "More rounds will not help" in end[0]
            and "privacy budget" in end[0]
            and "average_rounds" in end[0]
        )


def test_trend_tells_still_moving_from_the_noise_floor_and_swinging():
    # too few moves
    assert trend(SHRINKING[:3]) is None and trend([*SHRINKING[:3], 0 * SHRINKING[3]]) is None
    assert trend(SHRINKING)[0] == "still_moving" and trend(SWINGS)[0] == "swinging"
    assert trend(JITTER)[0] == "noise_floor"
    # one direction at a steady size (a slow Jacobi iteration): still moving though the size does
    # not shrink. Measured (MeanFieldGaussian, NaturalGradientUpdate, Synchronous(0.3), correlated
    # linear model): the change shrank x0.985 a round with a mean cosine of 1.00; at
    # GradientUpdate's noise floor (adam 0.05, 100 steps, 1 particle, Synchronous(0.5)) x0.99-1.01 a
    # round with cosines of -0.37 to -0.10.
    steady = [np.array([1.0, 0.5, -0.2]) * 0.985**r for r in range(6)]
    assert trend(steady)[0] == "still_moving"


def test_coordinate_drift_sees_a_drift_through_a_slip_and_not_the_noise_floor():
    """A drift shows through a move against it; jitter about a fixed point, of any size below tol,
    is not a drift.

    Jitter: q's coordinates (26, as the diabetes model's) are a fixed point plus iid N(0, 0.02)
    noise each round, so the moves (differences) are about 0.03 sds and the largest of a round about
    0.07: 200 seeded windows of 6 moves. Measured: no window flagged at noise sds 0.01 and 0.02 and
    0.8 % at 0.03 (500 windows each); the rule of main (one sign in each move, by more than tol / 2
    in all) missed the slipping drifts below.
    """
    to_go, coordinate = coordinate_drift(ONE_WAY_WITH_A_SLIP, DRIFT_FLOOR * 0.05)
    assert coordinate == 7 and to_go > 0.2  # 0.31 sds still to go, measured
    to_go, coordinate = coordinate_drift(SYNCHRONOUS_SLIP, DRIFT_FLOOR * 0.05)
    assert coordinate == 7 and to_go > 0.05
    jitter = 0.02 * np.random.default_rng(0).standard_normal((200, 7, 26))
    flagged = [
        coordinate_drift(list(np.diff(w, axis=0)), DRIFT_FLOOR * 0.05)[1] >= 0 for w in jitter
    ]
    assert not any(flagged)
    # a drift as slow as the jitter, one way for 6 rounds, is seen through it: 0.03 sds a round plus
    # N(0, 0.01)
    drift = 0.03 + np.random.default_rng(1).normal(0.0, 0.01, (6, 26))
    to_go, coordinate = coordinate_drift(list(drift), DRIFT_FLOOR * 0.05)
    assert coordinate >= 0 and to_go > 0.05


def test_a_client_failing_every_round_is_named(linear_data):
    X, y = linear_data
    inference = pvi.PVI(
        linear_model,
        pvi.FullRankGaussian(),
        UNEQUAL,
        FaultyUpdate(90, "raise"),
        pvi.Synchronous(1.0),
        backend="loop",
    )
    with pytest.warns(pvi.PVIWarning) as caught:
        result = inference.run(random.PRNGKey(0), 3, X, y=y, progress_bar=False, tol=0.05)
    # on main: no warning at all, and converged=True after round 2
    messages = caught_messages(caught)
    assert (
        sum(
            "Client(s) [1] failed in each of their last 3 updates (1: RAISED" in m for m in messages
        )
        == 1
    )
    assert (
        result.converged is False
        and result.stopped_because == "not_merged"
        and says_why(result, messages)
    )
    # NaN every round (NON_FINITE)
    nan = watch([round_info(0.001, rejection=[0, 0, 1, 0])] * 3, None)[2]
    assert any(
        "Client(s) [2] failed in each of their last 3 updates (2: NON_FINITE" in m for m in nan
    )
    skipped = [
        round_info(0.001, rejection=[0, 0, 1, 0]),
        round_info(0.001, attempts=[1, 1, 0, 1]),
    ] * 2
    # rounds it sat out do not reset/count
    assert not any("failed in each" in m for m in watch(skipped, None)[2])


def test_client_sampling_is_not_converged_before_every_client_was_merged(linear_data):
    X, y = linear_data
    inference = pvi.PVI(
        linear_model,
        pvi.FullRankGaussian(),
        np.array_split(np.arange(300), 50),
        ExactLinearUpdate(),
        pvi.Synchronous(clients_per_round=1),
    )
    with pytest.warns(pvi.PVIWarning) as caught:
        result = inference.run(random.PRNGKey(0), 8, X, y=y, progress_bar=False, tol=0.5)
    # on main: converged=True once one sampled client moved q by < 0.5 sd, with 40+ clients never
    # run
    assert (result.history.change <= 0.5).any()
    assert result.converged is False and result.stopped_because == "unmerged_clients"
    assert result.history.clients.shape == (8, 1)  # a sampled round records its client only
    never = 50 - int((result.history.dense(50).accepted.sum(0) > 0).sum())
    assert any(f"{never} of 50 clients were never merged" in m for m in caught_messages(caught))
    assert says_why(result, caught_messages(caught))


def test_a_sampled_rounds_record_names_its_clients_by_id():
    """Issue 27: a sampled round records its K clients only (``RoundInfo.clients``, ``(K,)``
    fields); the monitor reads it in O(K) and still names clients by id. Client 737 of 1,000, drawn
    in three rounds with two others and failing each time, is the one the warning names (not the
    record's entries 1, 0, 2), and after a clean round the run is not converged: 992 clients were
    never merged."""

    def sampled(ids, rejection=0):
        return round_info(0.001, num_clients=3, rejection=rejection)._replace(clients=np.array(ids))

    raised = pvi.state.Rejection.RAISED
    infos = [
        sampled([3, 737, 12], [0, raised, 0]),
        sampled([737, 40, 41], [raised, 0, 0]),
        sampled([999, 500, 737], [0, 0, raised]),
        sampled([1, 2, 3]),
    ]
    converged, reason, messages = watch(infos, 0.05, num_clients=1000)
    assert any(
        "Client(s) [737] failed in each of their last 3 updates (737: RAISED" in m for m in messages
    )
    assert converged is False and reason == "unmerged_clients"
    assert any("992 of 1000 clients were never merged" in m for m in messages)
    # the same rounds, dense over the 1,000 clients: the same verdict and warnings
    dense = [info.dense(1000) for info in infos]
    assert dense[0].attempts.shape == (1000,) and dense[0].rejection[737] == raised
    assert watch(dense, 0.05) == (converged, reason, messages)


class DriftingUpdate(ExactLinearUpdate):
    """The exact update, plus a shift of the factor's precision-times-mean that grows by 2 every
    round."""

    def init_state(self, problem):
        return jnp.zeros(())

    def bind(self, problem):
        exact = super().bind(problem)

        def client_update(rng_key, client, cavity, q, state, hyper=()):
            result = exact(rng_key, client, cavity, q, state)
            drift = NatParams(2.0 * (state + 1.0) * jnp.ones_like(q.eta1), jnp.zeros_like(q.eta2))
            return pvi.local_updates.ClientResult(
                result.delta + drift, result.free_energy, state + 1.0
            )

        return client_update


def test_a_falling_elbo_warns_and_is_not_converged(linear_data):
    X, y = linear_data
    inference = pvi.PVI(
        linear_model, pvi.FullRankGaussian(), UNEQUAL, DriftingUpdate(), pvi.Synchronous(1.0)
    )
    with pytest.warns(pvi.PVIWarning) as caught:
        result = inference.run(random.PRNGKey(0), 6, X, y=y, progress_bar=False, tol=0.05)
    # q drifts away from the exact posterior: the ELBO falls (RoundInfo.elbo is of the q each round
    # started from: from the prior's up to the first round's q, then down)
    assert (np.diff(result.history.elbo[1:]) < 0).all()
    messages = caught_messages(caught)
    # on main: no warning
    assert sum("The ELBO fell in each of the last 3 rounds" in m for m in messages) == 1
    assert (
        result.converged is False
        and result.stopped_because == "elbo_falling"
        and says_why(result, messages)
    )


def test_the_noise_floor_is_named_and_the_averaged_posterior_is_closer(linear_data):
    """GradientUpdate with 1 particle jitters q by 0.05-0.3 sds a round forever: tol=0.02 is never
    reached.

    The run says so, advises particles or steps rather than rounds, and the average of q's natural
    parameters over the last 15 rounds is closer to the optimum of the family (the exact mean, the
    precision's diagonal) than the last q. Measured with this test's settings (Sequential(), 30
    rounds, average_rounds=15), q_change from the optimum, seeds 0-7: last q 0.079 0.178 0.125 0.082
    0.189 0.156 0.102 0.152 (mean 0.133), averaged 0.051 0.036 0.038 0.058 0.049 0.071 0.044 0.046
    (mean 0.049); with Synchronous(0.5): last mean 0.082, averaged 0.048 (better in 7 of 8 seeds).
    Seeds 0-3 below: the mean ratio averaged / last is 0.40; the test asks for < 0.7.
    """
    X, y = linear_data
    inference = pvi.PVI(
        linear_model,
        pvi.MeanFieldGaussian(),
        FIVE,
        pvi.GradientUpdate(optax.adam(0.05), num_steps=100, num_particles=1),
        pvi.Sequential(),
    )
    mean, cov = exact_linear_posterior(X, y)
    optimum = inference.family.from_mean_precision(
        jnp.asarray(mean, jnp.float32), jnp.asarray(np.diag(np.linalg.inv(cov)), jnp.float32)
    )
    last, averaged = [], []
    for seed in range(4):
        with pytest.warns(pvi.PVIWarning) as caught:
            result = inference.run(
                random.PRNGKey(seed), 30, X, y=y, progress_bar=False, tol=0.02, average_rounds=15
            )
        messages = caught_messages(caught)
        assert (
            result.converged is False
            and result.stopped_because == "noise_floor"
            and says_why(result, messages)
        )
        assert not any("ELBO fell" in m for m in messages)  # jitter is not a falling ELBO
        assert any(
            "use more particles or local steps" in m and "Run more rounds" not in m
            for m in messages
        )
        last.append(q_change(inference.family, optimum, result.state.q))
        averaged.append(q_change(inference.family, optimum, result.averaged().state.q))
        assert result.averaged().average is None and result.averaged().history is result.history
    assert np.mean(averaged) < 0.7 * np.mean(last), (last, averaged)
    # the average is a consistent state
    factors = jax.tree.map(lambda f: f.sum(0), result.average.factors)
    np.testing.assert_allclose(
        result.average.q.eta1,
        (result.problem.prior + result.average.prior_factor).eta1 + factors.eta1,
        rtol=1e-5,
        atol=1e-3,
    )
    with pytest.raises(ValueError, match="average_rounds"):
        inference.run(random.PRNGKey(0), 1, X, y=y, progress_bar=False).averaged()
    with pytest.raises(ValueError, match="average_rounds must be a positive integer"):
        inference.run(random.PRNGKey(0), 1, X, y=y, average_rounds=0)
