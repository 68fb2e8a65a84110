import warnings

import numpy as np
import optax
import pytest
from jax import random
from scipy import optimize, stats

import numpyro_pvi as pvi
from numpyro_pvi import privacy

from conftest import linear_model

dpa = pytest.importorskip("dp_accounting")  # the extra `dp`

DELTA, SIGMA, STEPS, BATCH, ROUNDS = 1e-5, 1.5, 10, 10, 5
SIZES = (60, 100, 140)
PARTS = [np.arange(0, 60), np.arange(60, 160), np.arange(160, 300)]


def _dp_sgd_epsilon(num_rows, releases):
    """The RDP accountant of dp-accounting on DP-SGD's event, built here from the mechanism's definition."""
    step = dpa.PoissonSampledDpEvent(BATCH / num_rows, dpa.GaussianDpEvent(SIGMA))
    accountant = dpa.rdp.RdpAccountant(orders=list(privacy.RDP_ORDERS))
    return accountant.compose(dpa.SelfComposedDpEvent(step, STEPS * releases)).get_epsilon(DELTA)


@pytest.fixture(scope="module")
def budget_run(linear_data):
    """Uneven clients under a budget of epsilon 2: by the accountant, client 0 (60 rows) may release
    nothing, client 1 (100 rows) 2 updates and client 2 (140 rows) 4 updates."""
    X, y = linear_data
    update = pvi.DPGradientUpdate(optax.adam(1e-2), num_steps=STEPS, batch_size=BATCH, clip_norm=1.0,
                                  noise_multiplier=SIGMA, privacy_budget=(2.0, DELTA))
    inference = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), PARTS, update, pvi.Sequential())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = inference.run(random.PRNGKey(0), ROUNDS, X, y=y, progress_bar=False)
    return result, [str(w.message) for w in caught if issubclass(w.category, pvi.PVIWarning)]


def test_privacy_spent_equals_dp_accountings_epsilon(budget_run):
    result, _ = budget_run
    allowed = [max([r for r in range(ROUNDS + 1) if r == 0 or _dp_sgd_epsilon(n, r) <= 2.0]) for n in SIZES]
    assert allowed == [0, 2, 4]  # the run exercises a client refused at once, one midway, one near the end
    np.testing.assert_array_equal(privacy.releases(result), allowed)
    expected = [_dp_sgd_epsilon(n, r) if r else 0.0 for n, r in zip(SIZES, allowed)]
    np.testing.assert_allclose(result.privacy_spent(DELTA), expected, rtol=1e-12)
    assert np.all(result.privacy_spent(DELTA) <= 2.0)
    # the PLD accountant (tight for this mechanism) never reports more than RDP (an upper bound)
    for n, r, eps in zip(SIZES[1:], allowed[1:], expected[1:]):
        step = dpa.PoissonSampledDpEvent(BATCH / n, dpa.GaussianDpEvent(SIGMA))
        pld = dpa.pld.PLDAccountant().compose(dpa.SelfComposedDpEvent(step, STEPS * r)).get_epsilon(DELTA)
        assert pld <= eps


def test_a_client_over_budget_sends_nothing_and_is_named_once(budget_run):
    result, messages = budget_run
    codes = np.asarray(result.history.rejection)
    expected = np.array([[0 if r < k else int(pvi.Rejection.BUDGET) for k in (0, 2, 4)] for r in range(ROUNDS)])
    np.testing.assert_array_equal(codes, expected)
    np.testing.assert_array_equal(np.asarray(result.state.client_states.releases), [0, 2, 4])
    assert np.asarray(result.history.change)[-1] == 0.0  # round 5: every client refused, q did not move
    for client in range(3):
        assert sum(f"Client {client} has spent its privacy budget" in m for m in messages) == 1
    assert not any("Every client update" in m for m in messages)  # not mistaken for a failure


def test_updates_the_server_rejects_still_count_towards_the_budget(linear_data):
    # max_staleness=0 with three equally fast clients: the server rejects most updates as stale, though they
    # were sent; the budget must count them (before the fix the client's count missed them and it overspent)
    X, y = linear_data
    update = pvi.DPGradientUpdate(optax.adam(1e-2), num_steps=STEPS, batch_size=BATCH, clip_norm=1.0,
                                  noise_multiplier=SIGMA, privacy_budget=(2.0, DELTA))
    inference = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), PARTS, update,
                        pvi.Asynchronous(0.5, max_staleness=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)
        result = inference.run(random.PRNGKey(0), ROUNDS, X, y=y, progress_bar=False)
    codes = np.asarray(result.history.rejection)
    assert np.sum(codes == int(pvi.Rejection.STALE)) > 0  # the server did reject sent updates
    released = privacy.releases(result)
    np.testing.assert_array_equal(np.asarray(result.state.client_states.releases), released)
    assert list(released) == [0, 2, 4]  # what the budget allows (test_privacy_spent_equals_dp_accountings_epsilon)
    assert np.all(result.privacy_spent(DELTA) <= 2.0)


def _gaussian_exact_epsilon(sigma, delta):
    """Balle & Wang (2018): the exact epsilon of the Gaussian mechanism of noise sigma (sensitivity 1)."""
    def excess(eps):
        return stats.norm.cdf(0.5 / sigma - eps * sigma) - np.exp(eps) * stats.norm.cdf(-0.5 / sigma - eps * sigma) \
            - delta
    return optimize.brentq(excess, 0.0, 100.0)


def test_local_averaging_is_the_gaussian_mechanism_per_release(budget_run):
    """Releases of DPLocalAveraging compose Gaussian mechanisms: R of noise sigma are one of noise sigma / sqrt(R).

    RDP's epsilon lies between the exact one (Balle & Wang) and Mironov's conversion of the Gaussian's
    RDP curve ``R alpha / (2 sigma^2)``; and equals dp-accounting's for the event built here.
    """
    result, _ = budget_run
    update = pvi.DPLocalAveraging(pvi.GradientUpdate(optax.adam(1e-2), 10), num_shards=4, clip_norm=1.0,
                                  noise_multiplier=3.0)
    history = result.history._replace(attempts=np.array([[1, 1, 1], [2, 0, 1], [1, 1, 1]]),
                                      rejection=np.array([[0, 0, 0], [0, 0, 0], [0, 0, int(pvi.Rejection.BUDGET)]]))
    averaged = result._replace(history=history, inference=result.inference.__class__(
        linear_model, pvi.MeanFieldGaussian(), PARTS, update, pvi.Sequential()))
    np.testing.assert_array_equal(privacy.releases(averaged), [4, 2, 2])
    spent = averaged.privacy_spent(DELTA)
    for releases, eps in zip([4, 2, 2], spent):
        event = dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(3.0), releases)
        assert eps == pytest.approx(dpa.rdp.RdpAccountant(orders=list(privacy.RDP_ORDERS)).compose(event)
                                    .get_epsilon(DELTA), rel=1e-12)
        alphas = np.asarray(privacy.RDP_ORDERS, float)
        mironov = np.min(releases * alphas / (2 * 3.0**2) + np.log(1 / DELTA) / (alphas - 1))
        assert _gaussian_exact_epsilon(3.0 / np.sqrt(releases), DELTA) <= eps <= mironov


def test_calibrated_noise_multiplier_is_the_smallest_that_meets_the_target():
    sigma = pvi.calibrate_noise_multiplier(1.0, DELTA, sampling_rate=0.05, num_steps=200)

    def eps(s):
        step = dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(s))
        return dpa.rdp.RdpAccountant(orders=list(privacy.RDP_ORDERS)).compose(
            dpa.SelfComposedDpEvent(step, 200)).get_epsilon(DELTA)

    assert eps(sigma) <= 1.0 < eps(0.99 * sigma)


def test_bad_requests_are_named(budget_run):
    result, _ = budget_run
    with pytest.raises(ValueError, match="delta"):
        result.privacy_spent(0.0)
    with pytest.raises(ValueError, match="target_epsilon"):
        pvi.calibrate_noise_multiplier(-1.0, DELTA, 0.1, 10)
    with pytest.raises(ValueError, match="sampling_rate"):
        pvi.calibrate_noise_multiplier(1.0, DELTA, 1.5, 10)
    plain = result._replace(inference=result.inference.__class__(
        linear_model, pvi.MeanFieldGaussian(), PARTS, pvi.GradientUpdate(optax.adam(1e-2), 10), pvi.Sequential()))
    with pytest.raises(TypeError, match="not differentially private"):
        plain.privacy_spent(DELTA)
