import warnings

import numpy as np
import optax
import pytest
from jax import random
from scipy import optimize, stats
from scipy.integrate import quad

import numpyro_pvi as pvi
from numpyro_pvi.backends import failed_result, stack, take
from numpyro_pvi.privacy import accounting as privacy

from models import linear_model

dpa = pytest.importorskip("dp_accounting")  # the extra `dp`

DELTA, SIGMA, STEPS, BATCH, ROUNDS = 1e-5, 1.5, 10, 10, 5
SIZES = (60, 100, 140)
PARTS = [np.arange(0, 60), np.arange(60, 160), np.arange(160, 300)]


def _dp_sgd_epsilon(num_rows, releases):
    """The RDP accountant of dp-accounting on DP-SGD's event, built here from the mechanism's
    definition."""
    step = dpa.PoissonSampledDpEvent(BATCH / num_rows, dpa.GaussianDpEvent(SIGMA))
    accountant = dpa.rdp.RdpAccountant(orders=list(privacy.RDP_ORDERS))
    return accountant.compose(dpa.SelfComposedDpEvent(step, STEPS * releases)).get_epsilon(DELTA)


@pytest.fixture(scope="module")
def budget_run(linear_data):
    """Uneven clients under a budget of epsilon 2: by the accountant, client 0 (60 rows) may release
    nothing, client 1 (100 rows) 2 updates and client 2 (140 rows) 4 updates."""
    X, y = linear_data
    update = pvi.DPGradientUpdate(
        optax.adam(1e-2),
        num_steps=STEPS,
        batch_size=BATCH,
        clip_norm=1.0,
        noise_multiplier=SIGMA,
        privacy_budget=(2.0, DELTA),
    )
    inference = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), PARTS, update, pvi.Sequential())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = inference.run(random.PRNGKey(0), ROUNDS, X, y=y, progress_bar=False)
    return result, [str(w.message) for w in caught if issubclass(w.category, pvi.PVIWarning)]


def _releases(result):
    """Each client's releases in ``result``, as its state counts them."""
    return privacy.releases(
        result.config.local_update, result.state.client_states, result.num_clients
    )


def test_privacy_spent_equals_dp_accountings_epsilon(budget_run):
    result, _ = budget_run
    allowed = [
        max([r for r in range(ROUNDS + 1) if r == 0 or _dp_sgd_epsilon(n, r) <= 2.0]) for n in SIZES
    ]
    # the run exercises a client refused at once, one midway, one near the end
    assert allowed == [0, 2, 4]
    np.testing.assert_array_equal(_releases(result), allowed)
    expected = [_dp_sgd_epsilon(n, r) if r else 0.0 for n, r in zip(SIZES, allowed)]
    np.testing.assert_allclose(result.privacy_spent(DELTA), expected, rtol=1e-12)
    assert np.all(result.privacy_spent(DELTA) <= 2.0)
    # the PLD accountant (tight for this mechanism) never reports more than RDP (an upper bound)
    for n, r, eps in zip(SIZES[1:], allowed[1:], expected[1:]):
        step = dpa.PoissonSampledDpEvent(BATCH / n, dpa.GaussianDpEvent(SIGMA))
        pld = (
            dpa.pld.PLDAccountant()
            .compose(dpa.SelfComposedDpEvent(step, STEPS * r))
            .get_epsilon(DELTA)
        )
        assert pld <= eps


def test_a_client_over_budget_sends_nothing_and_is_named_once(budget_run):
    result, messages = budget_run
    codes = np.asarray(result.history.rejection)
    expected = np.array(
        [
            [0 if r < k else int(pvi.state.Rejection.BUDGET) for k in (0, 2, 4)]
            for r in range(ROUNDS)
        ]
    )
    np.testing.assert_array_equal(codes, expected)
    np.testing.assert_array_equal(np.asarray(result.state.client_states.releases), [0, 2, 4])
    # round 5: every client refused, q did not move
    assert np.asarray(result.history.change)[-1] == 0.0
    for client in range(3):
        assert sum(f"Client {client} has spent its privacy budget" in m for m in messages) == 1
    assert not any("Every client update" in m for m in messages)  # not mistaken for a failure


def test_updates_the_server_rejects_still_count_towards_the_budget(linear_data):
    # max_staleness=0 with three equally fast clients: the server rejects most updates as stale,
    # though they were sent; the budget must count them (before the fix the client's count missed
    # them and it overspent)
    X, y = linear_data
    update = pvi.DPGradientUpdate(
        optax.adam(1e-2),
        num_steps=STEPS,
        batch_size=BATCH,
        clip_norm=1.0,
        noise_multiplier=SIGMA,
        privacy_budget=(2.0, DELTA),
    )
    inference = pvi.PVI(
        linear_model, pvi.MeanFieldGaussian(), PARTS, update, pvi.Asynchronous(0.5, max_staleness=0)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)
        result = inference.run(random.PRNGKey(0), ROUNDS, X, y=y, progress_bar=False)
    codes = np.asarray(result.history.rejection)
    assert np.sum(codes == int(pvi.state.Rejection.STALE)) > 0  # the server did reject sent updates
    released = _releases(result)
    np.testing.assert_array_equal(np.asarray(result.state.client_states.releases), released)
    # what the budget allows (test_privacy_spent_equals_dp_accountings_epsilon)
    assert list(released) == [0, 2, 4]
    assert np.all(result.privacy_spent(DELTA) <= 2.0)


class TimingOutBackend:
    """The loop backend, except that client 1's first ``timeouts`` updates time out (as RayBackend
    reports an actor too slow for its ``timeout``: a failed result, the client's state kept)."""

    jit_group = False

    def __init__(self, timeouts):
        self.timeouts = timeouts

    def prepare(self, local_update, problem):
        run = pvi.backends.LoopBackend().prepare(local_update, problem)

        def timing_out(ids, keys, cavities, q, states, clients, hyper=()):
            if [int(m) for m in ids] == [1] and self.timeouts > 0:
                self.timeouts -= 1
                return stack(
                    [
                        failed_result(
                            take(cavities, 0), take(states, 0), hyper, pvi.state.Rejection.TIMEOUT
                        )
                    ]
                )
            return run(ids, keys, cavities, q, states, clients, hyper)

        return timing_out


def test_a_client_that_times_out_is_counted_once_by_budget_and_privacy_spent(linear_data):
    # before: privacy_spent counted the history's attempts (timeouts included: 5 for client 1,
    # epsilon over its budget of 2) while the budget gate counted the state's releases (2); one
    # count now drives both
    X, y = linear_data
    update = pvi.DPGradientUpdate(
        optax.adam(1e-2),
        num_steps=STEPS,
        batch_size=BATCH,
        clip_norm=1.0,
        noise_multiplier=SIGMA,
        privacy_budget=(2.0, DELTA),
    )
    inference = pvi.PVI(
        linear_model,
        pvi.MeanFieldGaussian(),
        PARTS,
        update,
        pvi.Sequential(),
        backend=TimingOutBackend(timeouts=3),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)
        result = inference.run(random.PRNGKey(0), ROUNDS, X, y=y, progress_bar=False)
    codes = np.asarray(result.history.rejection)[:, 1]
    np.testing.assert_array_equal(
        codes, [pvi.state.Rejection.TIMEOUT] * 3 + [pvi.state.Rejection.NONE] * 2
    )
    assert np.asarray(result.history.attempts)[:, 1].sum() == ROUNDS  # the history saw 5 attempts
    released = _releases(result)
    np.testing.assert_array_equal(released, np.asarray(result.state.client_states.releases))
    # client 1: its two rounds after the time-outs
    np.testing.assert_array_equal(released, [0, 2, 4])
    np.testing.assert_allclose(
        result.privacy_spent(DELTA),
        [0.0] + [_dp_sgd_epsilon(n, r) for n, r in zip(SIZES[1:], (2, 4))],
        rtol=1e-12,
    )
    assert np.all(result.privacy_spent(DELTA) <= 2.0)


def test_a_run_resumed_without_its_history_spends_what_its_releases_spent(
    sampled_inference, sampled_run, linear_data
):
    # before: privacy_spent read the history only, so a run resumed from a checkpoint without
    # init_history reported epsilon 0 for the rounds before the checkpoint
    X, y = linear_data
    # 2 of 3 clients a round for 5 rounds; the same inference and data: nothing recompiles
    first = sampled_run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)
        resumed = sampled_inference.run(
            random.PRNGKey(1), 1, X, y=y, progress_bar=False, init_state=first.state
        )
    made = np.sum(first.history.dense(3).attempts, 0) + np.sum(resumed.history.dense(3).attempts, 0)
    assert made.sum() == 2 * (ROUNDS + 1)
    np.testing.assert_array_equal(_releases(resumed), made)
    np.testing.assert_allclose(
        resumed.privacy_spent(DELTA),
        [_dp_sgd_epsilon(n, int(r)) for n, r in zip(SIZES, made)],
        rtol=1e-12,
    )
    # "secret" credits rounds the history lacks
    with pytest.raises(ValueError, match="pass init_history"):
        resumed.privacy_spent(DELTA, client_sampling="secret")
    whole = resumed._replace(
        history=type(first.history)(
            *(
                np.concatenate([np.asarray(a), np.asarray(b)])
                for a, b in zip(first.history, resumed.history)
            )
        )
    )
    update = first.config.local_update
    np.testing.assert_allclose(
        whole.privacy_spent(DELTA, client_sampling="secret"),
        [
            privacy.client_sampled_epsilon(update.dp_event(n, 1), 2 / 3, ROUNDS + 1, DELTA)
            for n in SIZES
        ],
        rtol=1e-12,
    )


def _gaussian_exact_epsilon(sigma, delta):
    """Balle & Wang (2018): the exact epsilon of the Gaussian mechanism of noise sigma (sensitivity
    1)."""

    def excess(eps):
        return (
            stats.norm.cdf(0.5 / sigma - eps * sigma)
            - np.exp(eps) * stats.norm.cdf(-0.5 / sigma - eps * sigma)
            - delta
        )

    return optimize.brentq(excess, 0.0, 100.0)


def test_local_averaging_is_the_gaussian_mechanism_per_release(budget_run):
    """Releases of DPLocalAveraging compose Gaussian mechanisms: R of noise sigma are one of noise
    sigma / sqrt(R).

    RDP's epsilon lies between the exact one (Balle & Wang) and Mironov's conversion of the
    Gaussian's RDP curve ``R alpha / (2 sigma^2)``; and equals dp-accounting's for the event built
    here.
    """
    result, _ = budget_run
    update = pvi.DPLocalAveraging(
        pvi.GradientUpdate(optax.adam(1e-2), 10), num_shards=4, clip_norm=1.0, noise_multiplier=3.0
    )
    # the clients' own counts
    counted = result.state.client_states._replace(releases=np.array([4, 2, 2]))
    averaged = result._replace(
        state=result.state._replace(client_states=counted),
        config=result.config._replace(local_update=update, server=pvi.Sequential()),
    )
    np.testing.assert_array_equal(_releases(averaged), [4, 2, 2])
    spent = averaged.privacy_spent(DELTA)
    for releases, eps in zip([4, 2, 2], spent):
        event = dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(3.0), releases)
        assert eps == pytest.approx(
            dpa.rdp.RdpAccountant(orders=list(privacy.RDP_ORDERS))
            .compose(event)
            .get_epsilon(DELTA),
            rel=1e-12,
        )
        alphas = np.asarray(privacy.RDP_ORDERS, float)
        mironov = np.min(releases * alphas / (2 * 3.0**2) + np.log(1 / DELTA) / (alphas - 1))
        assert _gaussian_exact_epsilon(3.0 / np.sqrt(releases), DELTA) <= eps <= mironov


def test_calibrated_noise_multiplier_is_the_smallest_that_meets_the_target():
    sigma = pvi.calibrate_noise_multiplier(1.0, DELTA, sampling_rate=0.05, num_steps=200)

    def eps(s):
        step = dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(s))
        return (
            dpa.rdp.RdpAccountant(orders=list(privacy.RDP_ORDERS))
            .compose(dpa.SelfComposedDpEvent(step, 200))
            .get_epsilon(DELTA)
        )

    assert eps(sigma) <= 1.0 < eps(0.99 * sigma)


def test_bad_requests_are_named(budget_run):
    result, _ = budget_run
    with pytest.raises(ValueError, match="delta"):
        result.privacy_spent(0.0)
    with pytest.raises(ValueError, match="target_epsilon"):
        pvi.calibrate_noise_multiplier(-1.0, DELTA, 0.1, 10)
    with pytest.raises(ValueError, match="sampling_rate"):
        pvi.calibrate_noise_multiplier(1.0, DELTA, 1.5, 10)
    plain = result._replace(
        config=result.config._replace(local_update=pvi.GradientUpdate(optax.adam(1e-2), 10))
    )
    with pytest.raises(TypeError, match="not differentially private"):
        plain.privacy_spent(DELTA)


# ---------------------------------------------------------------- client sampling (Synchronous,
# clients_per_round)
def _run_or_nothing_rdp(release_rdp, rate):
    """log(1 - p + p exp((a - 1) rho(a))) / (a - 1): the Renyi divergence of 'w.p. p the release,
    else nothing'."""
    alphas = np.asarray(privacy.RDP_ORDERS, float)
    # huge orders: the exponential overflows to inf, the divergence is inf
    with np.errstate(over="ignore"):
        return np.log(1 - rate + rate * np.exp((alphas - 1) * np.asarray(release_rdp))) / (
            alphas - 1
        )


@pytest.mark.parametrize("alpha", [2, 4, 10])
def test_client_sampled_rdp_is_the_renyi_divergence_of_run_or_nothing(alpha):
    """Integrate D_alpha(Q || P) for P = (1-p) nothing + p N(0, s^2), Q = (1-p) nothing + p N(1,
    s^2) numerically (the 'nothing' atom contributes (1-p) on both sides) and compare with the
    formula's value."""
    sigma, rate = 2.0, 0.2

    def integrand(x):
        return np.exp(
            alpha * stats.norm.logpdf(x, 1, sigma) + (1 - alpha) * stats.norm.logpdf(x, 0, sigma)
        )

    integral = (1 - rate) + rate * quad(integrand, -np.inf, np.inf)[0]
    numeric = np.log(integral) / (alpha - 1)
    got = privacy.client_sampled_rdp(privacy.rdp_curve(privacy.gaussian_event(sigma, 1)), rate)
    assert got[privacy.RDP_ORDERS.index(alpha)] == pytest.approx(numeric, rel=1e-8)


def test_client_sampled_epsilon_equals_dp_accountings_and_is_amplified():
    rounds, sigma = 20, 2.0
    accountant = lambda: dpa.rdp.RdpAccountant(orders=list(privacy.RDP_ORDERS))  # noqa: E731
    # one release
    dp_sgd = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.2)), 10)
    for release in (dpa.GaussianDpEvent(sigma), dp_sgd):
        unamplified = (
            accountant().compose(dpa.SelfComposedDpEvent(release, rounds)).get_epsilon(DELTA)
        )
        # rate 1: every round a release, exactly dp-accounting's composed event
        assert privacy.client_sampled_epsilon(release, 1.0, rounds, DELTA) == pytest.approx(
            unamplified, rel=1e-12
        )
        # the run-or-nothing RDP of the release's curve (dp-accounting's), composed, converted
        for rate in (0.5, 0.1):
            rho = _run_or_nothing_rdp(accountant().compose(release).rdp, rate)
            expected = dpa.rdp.compute_epsilon(list(privacy.RDP_ORDERS), rounds * rho, DELTA)[0]
            amplified = privacy.client_sampled_epsilon(release, rate, rounds, DELTA)
            assert amplified == pytest.approx(expected, rel=1e-10)
            assert amplified < unamplified
    # dp-accounting's record-level PoissonSampled(p, Gaussian) is a post-processing of
    # run-or-nothing: it would report less than the truth for a client that is in or out as a whole,
    # hence not used
    poisson = (
        accountant()
        .compose(
            dpa.SelfComposedDpEvent(
                dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(sigma)), rounds
            )
        )
        .get_epsilon(DELTA)
    )
    assert poisson < privacy.client_sampled_epsilon(dpa.GaussianDpEvent(sigma), 0.1, rounds, DELTA)


@pytest.fixture(scope="module")
def sampled_inference():
    """Synchronous PVI drawing 2 of the 3 clients a round, DP-SGD, no budget."""
    update = pvi.DPGradientUpdate(
        optax.adam(1e-2), num_steps=STEPS, batch_size=BATCH, clip_norm=1.0, noise_multiplier=SIGMA
    )
    return pvi.PVI(
        linear_model,
        pvi.MeanFieldGaussian(),
        PARTS,
        update,
        pvi.Synchronous(damping=0.5, clients_per_round=2),
    )


@pytest.fixture(scope="module")
def sampled_run(sampled_inference, linear_data):
    """5 rounds of ``sampled_inference``."""
    X, y = linear_data
    inference = sampled_inference
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)
        return inference.run(random.PRNGKey(0), ROUNDS, X, y=y, progress_bar=False)


def test_secret_client_sampling_credits_every_round_at_rate_k_over_m(sampled_run):
    result = sampled_run
    released = _releases(result)
    # 2 of 3 clients a round, every one drawn
    assert released.sum() == 2 * ROUNDS and np.all(released > 0)
    secret = result.privacy_spent(DELTA, client_sampling="secret")
    for n, eps in zip(SIZES, secret):
        release = dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(BATCH / n, dpa.GaussianDpEvent(SIGMA)), STEPS
        )
        rho = _run_or_nothing_rdp(
            dpa.rdp.RdpAccountant(orders=list(privacy.RDP_ORDERS)).compose(release).rdp, 2 / 3
        )
        assert eps == pytest.approx(
            dpa.rdp.compute_epsilon(list(privacy.RDP_ORDERS), ROUNDS * rho, DELTA)[0], rel=1e-10
        )
        assert eps < _dp_sgd_epsilon(n, ROUNDS)  # the same schedule without credit for the sampling
    known = [_dp_sgd_epsilon(n, int(r)) for n, r in zip(SIZES, released)]
    # the default counts the releases made
    np.testing.assert_allclose(result.privacy_spent(DELTA), known, rtol=1e-12)


def test_secret_client_sampling_of_all_clients_is_the_unamplified_epsilon(sampled_run):
    result = sampled_run  # the same history read as K = M: every client took part in every round
    every = result.history.dense(3)._replace(
        attempts=np.ones((ROUNDS, 3), int), rejection=np.zeros((ROUNDS, 3), int)
    )
    # and so the clients count
    counted = result.state.client_states._replace(releases=np.full(3, ROUNDS))
    everyone = result._replace(
        history=every,
        state=result.state._replace(client_states=counted),
        config=result.config._replace(server=pvi.Synchronous(damping=0.5)),
    )
    np.testing.assert_allclose(
        everyone.privacy_spent(DELTA, client_sampling="secret"),
        everyone.privacy_spent(DELTA),
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        everyone.privacy_spent(DELTA), [_dp_sgd_epsilon(n, ROUNDS) for n in SIZES], rtol=1e-12
    )


def test_client_sampling_requests_that_cannot_be_credited_are_named(sampled_run, budget_run):
    result = sampled_run
    with pytest.raises(ValueError, match="'known' or 'secret'"):
        result.privacy_spent(DELTA, client_sampling="hidden")
    with pytest.raises(ValueError, match="draw their clients afresh"):
        budget_run[0].privacy_spent(DELTA, client_sampling="secret")  # a Sequential run
    weighted = result._replace(
        config=result.config._replace(
            server=pvi.Synchronous(damping=0.5, clients_per_round=2, client_weights=[1.0, 2.0, 3.0])
        )
    )
    with pytest.raises(ValueError, match="client_rates"):
        weighted.privacy_spent(DELTA, client_sampling="secret")
    spent = weighted.privacy_spent(DELTA, client_sampling="secret", client_rates=[0.4, 0.7, 0.9])
    update = result.config.local_update
    np.testing.assert_allclose(
        spent,
        [
            privacy.client_sampled_epsilon(update.dp_event(n, 1), p, ROUNDS, DELTA)
            # the given rates
            for n, p in zip(SIZES, (0.4, 0.7, 0.9))
        ],
        rtol=1e-12,
    )
    with pytest.raises(ValueError, match="client_rates"):
        weighted.privacy_spent(DELTA, client_sampling="secret", client_rates=[0.4, 1.7, 0.9])


def test_calibration_with_client_sampling_meets_the_target_with_less_noise():
    plain = pvi.calibrate_noise_multiplier(1.0, DELTA, sampling_rate=0.1, num_steps=200)
    sigma = pvi.calibrate_noise_multiplier(
        1.0, DELTA, 0.1, 200, client_sampling_rate=0.2, num_rounds=10
    )
    release = lambda s: privacy.dp_sgd_event(0.1, s, 20)  # noqa: E731
    assert privacy.client_sampled_epsilon(release(sigma), 0.2, 10, DELTA) <= 1.0
    assert privacy.client_sampled_epsilon(release(0.999 * sigma), 0.2, 10, DELTA) > 1.0
    assert sigma < plain
    with pytest.raises(ValueError, match="multiple of num_rounds"):
        pvi.calibrate_noise_multiplier(1.0, DELTA, 0.1, 200, client_sampling_rate=0.2, num_rounds=7)
