"""HeavyBall, ``Synchronous()``'s default: damping and momentum from the spectrum of the round.

The exact tests use a closed-form mean-field local update on a linear-Gaussian model with correlated
features: the mean-field optimum of a Gaussian target has the target's mean and the diagonal of its
precision, so a synchronous round is an exactly linear (Jacobi) map and global mean-field VI's
optimum is known in closed form.
"""

import warnings
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import enable_x64, random
from sklearn.datasets import load_breast_cancer

import numpyro_pvi as pvi
from numpyro_pvi.families import NatParams
from numpyro_pvi.server.damping import SWING_ROUNDS
from numpyro_pvi.server.heavy_ball import DROP_ROUNDS, polyak_parameters, ritz_bounds

from models import NOISE, linear_model
from references import BREAST_CANCER_MEAN_FIELD_VI_MEAN, BREAST_CANCER_MEAN_FIELD_VI_SD

NUM_CLIENTS = 6


class MeanFieldLinearUpdate(pvi.local_updates.LocalUpdate):
    """The exact mean-field optimum of cavity x likelihood for `linear_model`: its mean and diagonal
    precision."""

    def init_state(self, problem):
        return ()

    def bind(self, problem):
        def client_update(rng_key, client, cavity, q, state, hyper=()):
            X, y = client.arrays
            Xm = X * client.mask[:, None]
            precision = jnp.diag(-2.0 * cavity.eta2) + Xm.T @ X / NOISE**2
            mean = jnp.linalg.solve(precision, cavity.eta1 + Xm.T @ y / NOISE**2)
            diagonal = jnp.diag(precision)
            return pvi.local_updates.ClientResult(
                NatParams(diagonal * mean, -0.5 * diagonal) - q, jnp.zeros(()), state
            )

        return client_update


@pytest.fixture(scope="module")
def correlated_data():
    """300 rows, 6 features with correlation 0.9: the linearised round has spectrum about [0.12,
    3.1]."""
    correlation = 0.9 * np.ones((6, 6)) + 0.1 * np.eye(6)
    X = np.asarray(random.normal(random.PRNGKey(0), (300, 6))) @ np.linalg.cholesky(correlation).T
    y = X @ np.linspace(-1.0, 1.0, 6) + NOISE * np.asarray(random.normal(random.PRNGKey(1), (300,)))
    return X, y


def _rounds_to_optimum(server, data, max_rounds, tol=1e-6, num_clients=NUM_CLIENTS):
    """Rounds until q is within ``tol`` (relative) of mean-field VI's optimum: the exact posterior
    mean, and the diagonal of the posterior precision; None if not within ``max_rounds``."""
    with enable_x64(True):
        X, y = (jnp.asarray(a, jnp.float64) for a in data)
        precision = np.eye(X.shape[1]) + np.asarray(X.T @ X) / NOISE**2
        mean = np.linalg.solve(precision, np.asarray(X.T @ y) / NOISE**2)
        partitions = np.array_split(np.arange(X.shape[0]), num_clients)
        inference = pvi.PVI(
            linear_model, pvi.MeanFieldGaussian(), partitions, MeanFieldLinearUpdate(), server
        )
        problem = inference.build(X, y=y)
        state = inference.init(random.PRNGKey(0), problem)
        for r in range(1, max_rounds + 1):
            state, _ = inference.update(state, problem)
            loc = np.asarray(inference.family.loc_scale(state.q)[0])
            q_precision = -2.0 * np.asarray(state.q.eta2)
            if (
                np.max(np.abs(loc - mean)) <= tol * np.max(np.abs(mean))
                and np.max(np.abs(q_precision / np.diag(precision) - 1.0)) <= tol
            ):
                return r
        return None


def test_heavy_ball_reaches_mean_field_vi_within_twice_the_sequential_rounds(correlated_data):
    sequential = _rounds_to_optimum(pvi.Sequential(), correlated_data, 200)
    heavy_ball = _rounds_to_optimum(pvi.Synchronous(), correlated_data, 2 * sequential)
    assert heavy_ball is not None and heavy_ball <= 2 * sequential, (heavy_ball, sequential)
    # the test can fail: neither the ELBO-driven damping nor the best fixed one gets there in that
    # many rounds
    lam_min, lam_max = 0.12, 3.1
    best_fixed = 2.0 / (lam_min + lam_max)
    for slower in (pvi.Synchronous(pvi.AdaptiveDamping()), pvi.Synchronous(best_fixed)):
        assert _rounds_to_optimum(slower, correlated_data, 2 * sequential) is None


@pytest.fixture(scope="module")
def overshooting_data():
    """300 rows, 10 features with correlation 0.9, 10 clients: the linearised round's largest
    eigenvalue is about 5, so a fixed damping of 0.5 overshoots (|1 - 0.5 * 5| > 1) and the means
    swing back and forth."""
    correlation = 0.9 * np.ones((10, 10)) + 0.1 * np.eye(10)
    X = np.asarray(random.normal(random.PRNGKey(2), (300, 10))) @ np.linalg.cholesky(correlation).T
    y = X @ np.linspace(-1.0, 1.0, 10) + NOISE * np.asarray(
        random.normal(random.PRNGKey(3), (300,))
    )
    return X, y


def test_a_fixed_damping_that_overshoots_says_it_is_oscillating(overshooting_data):
    """Issue 23, problem 4: Synchronous(0.5) cycled on the quickstart data with no warning. Here 0.5
    overshoots an exactly linear round; the run must say so by name and not claim convergence."""
    X, y = overshooting_data
    inference = pvi.PVI(
        linear_model,
        pvi.MeanFieldGaussian(),
        np.array_split(np.arange(300), 10),
        MeanFieldLinearUpdate(),
        pvi.Synchronous(0.5),
    )
    with enable_x64(True), pytest.warns(pvi.PVIWarning, match=r"oscillating.*damping <= 0\.25"):
        result = inference.run(
            random.PRNGKey(0), 12, jnp.asarray(X), y=jnp.asarray(y), tol=1e-3, progress_bar=False
        )
    assert result.converged is False
    assert int(result.state.damping.swings) >= 4


def test_heavy_ball_converges_where_a_fixed_half_damping_overshoots(overshooting_data):
    """The default reaches mean-field VI's optimum on the same data, within twice Sequential's
    rounds, and never says it oscillates."""
    sequential = _rounds_to_optimum(pvi.Sequential(), overshooting_data, 200, num_clients=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pvi.PVIWarning)
        heavy_ball = _rounds_to_optimum(
            pvi.Synchronous(), overshooting_data, 2 * sequential, num_clients=10
        )
    assert heavy_ball is not None and heavy_ball <= 2 * sequential, (heavy_ball, sequential)


def test_an_elbo_drop_restarts_the_momentum_and_halves_the_damping():
    """Adaptive restart (O'Donoghue & Candes 2015) on the global ELBO: a drop beyond
    ``elbo_tolerance`` drops the velocity, and after a round without momentum caps the damping at
    half the round's; a round without a drop regrows the cap by ``grow``."""
    heavy_ball = pvi.HeavyBall(elbo_tolerance=0.1, grow=1.25)
    q = NatParams(jnp.ones(3), -0.5 * jnp.ones(3))
    state = heavy_ball.init(q, NatParams(jnp.ones((2, 3)), jnp.ones((2, 3))), None)
    state = state._replace(rho=jnp.asarray(0.8), beta=jnp.asarray(0.6))
    state = heavy_ball.after_round(state, -100.0, False)  # the first ELBO: nothing to compare with
    assert float(state.ceiling) == 1.0 and int(state.restarts) == 0
    state = heavy_ball.after_round(state, -100.05, False)  # within the tolerance: not a drop
    assert int(state.restarts) == 0 and float(state.beta) == pytest.approx(0.6)
    state = heavy_ball.after_round(
        state, -101.0, False
    )  # a drop in a round with momentum: restart it
    assert int(state.restarts) == 1 and int(state.drops) == 1 and float(state.beta) == 0.0
    assert float(jnp.abs(state.velocity.eta1).max()) == 0.0 and float(state.ceiling) == 1.0
    # RoundInfo.elbo is that of the q the round started from: each ELBO judges the round before's
    # step. A drop (NaN is one) judging the step that restarted (it still had momentum): no halving
    state = heavy_ball.after_round(state, float("nan"), False)
    assert int(state.drops) == 2 and float(state.elbo) == -101.0 and float(state.ceiling) == 1.0
    # a drop judging a step without momentum: halve the damping
    state = heavy_ball.after_round(state, float("nan"), False)
    assert int(state.drops) == 3 and float(state.elbo) == -101.0
    assert float(state.ceiling) == pytest.approx(0.4) and float(state.rho) == pytest.approx(0.4)
    state = heavy_ball.after_round(state, -100.0, False)
    assert int(state.drops) == 0 and float(state.ceiling) == pytest.approx(0.5)


def test_the_damping_warnings_name_the_cause_and_the_remedy():
    """Heavy ball whose ELBO kept falling through its restarts, and a fixed damping that keeps
    swinging, each say so (the run passes these to its PVIWarning); fewer rounds in a row say
    nothing."""
    heavy_ball = pvi.HeavyBall()
    q = NatParams(jnp.ones(3), -0.5 * jnp.ones(3))
    state = heavy_ball.init(q, NatParams(jnp.ones((2, 3)), jnp.ones((2, 3))), None)
    assert heavy_ball.warning(state._replace(drops=jnp.asarray(DROP_ROUNDS - 1))) is None
    cause, message = heavy_ball.warning(state._replace(drops=jnp.asarray(DROP_ROUNDS)))
    assert cause == "elbo falling" and "Sequential()" in message
    half = pvi.Fixed(0.5)
    fixed = half.init(q, None, pvi.MeanFieldGaussian())
    assert fixed.step.shape == (6,) and half.warning(fixed._replace(swings=jnp.asarray(3))) is None
    cause, message = half.warning(fixed._replace(swings=jnp.asarray(SWING_ROUNDS)))
    assert cause == "oscillating" and "damping <= 0.25" in message


def test_heavy_ball_keeps_one_round_exact_when_the_round_is_exact(linear_data):
    """Independent features, one client: a round is exact (P = I), and heavy ball adds no
    momentum."""
    X, y = linear_data
    X = np.asarray(X)
    Q = np.linalg.qr(X)[0] * np.sqrt(X.shape[0])  # orthogonal columns: the posterior is mean-field
    server = pvi.Synchronous(pvi.HeavyBall(initial=1.0))
    inference = pvi.PVI(
        linear_model, pvi.MeanFieldGaussian(), [np.arange(300)], MeanFieldLinearUpdate(), server
    )
    with enable_x64(True):
        Qx, yx = jnp.asarray(Q, jnp.float64), jnp.asarray(y, jnp.float64)
        result = inference.run(random.PRNGKey(0), 4, Qx, y=yx, progress_bar=False)
        mean = np.linalg.solve(np.eye(3) + Q.T @ Q / NOISE**2, Q.T @ np.asarray(y) / NOISE**2)
        np.testing.assert_allclose(inference.family.loc_scale(result.state.q)[0], mean, rtol=1e-9)
        assert float(result.state.damping.beta) == 0.0


def test_ritz_bounds_and_polyak_parameters():
    operator = np.diag([0.1, 1.0, 3.0])
    steps = random.normal(random.PRNGKey(0), (3, 3))  # rows are steps, spanning the space
    assert ritz_bounds(np.asarray(steps), np.asarray(steps) @ operator.T) == pytest.approx(
        (0.1, 3.0)
    )
    # on a subspace the Ritz values lie inside the spectrum
    low, high = ritz_bounds(np.asarray(steps[:2]), np.asarray(steps[:2]) @ operator.T)
    assert 0.1 <= low <= high <= 3.0
    assert polyak_parameters(1.0, 1.0) == pytest.approx((1.0, 0.0))
    rho, beta = polyak_parameters(0.139, 4.61)
    assert rho == pytest.approx(0.630, abs=1e-3) and beta == pytest.approx(0.496, abs=1e-3)


def _spectral_radius(rho, beta, eigenvalues):
    """The largest modulus of heavy ball's linear map ``x_{k+1} = x_k - rho lam x_k + beta (x_k -
    x_{k-1})`` over the eigenvalues ``lam`` (below 1: every mode contracts)."""
    return max(
        float(
            np.max(np.abs(np.linalg.eigvals(np.array([[1 + beta - rho * lam, -beta], [1.0, 0.0]]))))
        )
        for lam in eigenvalues
    )


def test_a_capped_momentum_lowers_the_damping_so_every_mode_contracts():
    """Measured: mean field on sklearn's diabetes data (10 clients, GradientUpdate, Synchronous())
    estimated the spectrum [1e-3, 3.24] (widened: [5e-4, 4.05]); Polyak's momentum there is 0.96,
    capped at 0.7, and with the damping left at Polyak's (0.96, capped at 1) the top mode diverged:
    the ELBO fell from -501 to -10,205 in 10 rounds (Sequential() and Synchronous(0.5) converged).
    The damping must keep rho * lambda_max <= (1 + sqrt(beta))^2 on the estimated spectrum."""
    heavy_ball = pvi.HeavyBall()
    q = NatParams(jnp.zeros(3), -0.5 * jnp.ones(3))
    state = heavy_ball.init(q, NatParams(jnp.zeros((2, 3)), jnp.zeros((2, 3))), None)
    for low, high in [(1e-3, 3.24), (0.01, 8.0), (0.139, 4.61), (0.5, 1.0)]:
        memory = jnp.full((heavy_ball.memory,), jnp.nan)
        state = state._replace(
            lambda_min=memory.at[-1].set(low), lambda_max=memory.at[-1].set(high)
        )
        rho, beta = heavy_ball._parameters(state, 0.5)
        assert beta <= heavy_ball.max_momentum
        # the spectrum the parameters are made for
        widened = np.linspace(0.5 * low, 1.25 * high, 200)
        assert _spectral_radius(rho, beta, widened) < 1.0, (low, high, rho, beta)
    assert polyak_parameters(0.139, 4.61, 0.3) == pytest.approx((0.5196, 0.3), abs=1e-4)


class _Merged(NamedTuple):
    """What :meth:`HeavyBall.after_merge` reads of a ``PVIState``."""

    q: NatParams
    factors: NatParams
    damping: object


def test_a_drop_in_the_round_after_a_restart_halves_the_damping():
    """A restart drops the velocity, so the next round adds no momentum whatever beta the spectrum
    gives; if the ELBO drops again there, the damping itself overshot and its ceiling is halved.
    (main recorded the spectrum's beta for that round, took it for a round with momentum, and never
    halved: on the diabetes data rho stayed 1 through 18 restarts while the ELBO fell to
    -10,205.)"""
    heavy_ball = pvi.HeavyBall(elbo_tolerance=0.1)
    family = pvi.MeanFieldGaussian()
    q = NatParams(jnp.zeros(3), -0.5 * jnp.ones(3))
    factors = NatParams(jnp.zeros((2, 3)), jnp.zeros((2, 3)))
    state = heavy_ball.init(q, factors, None)  # no velocity yet, as after a restart
    memory = jnp.full((heavy_ball.memory,), jnp.nan)
    state = state._replace(
        lambda_min=memory.at[-1].set(0.01),
        lambda_max=memory.at[-1].set(3.0),
        elbo=jnp.asarray(-100.0),
        rho=jnp.asarray(0.8),
    )
    step = NatParams(0.1 * jnp.ones((2, 3)), jnp.zeros((2, 3)))
    before = _Merged(q, factors, state)
    after = _Merged(NatParams(q.eta1 + step.eta1.sum(0), q.eta2), step, state)
    merged = heavy_ball.after_merge(family, before, after, True, 0.8).damping
    assert float(merged.beta) == 0.0  # the momentum this round applied: none
    # this round's ELBO is of the q it started from; the next round's judges this round's step
    judged = heavy_ball.after_round(merged, -100.0, False)
    dropped = heavy_ball.after_round(judged, -105.0, False)
    assert int(dropped.restarts) == 1
    assert float(dropped.ceiling) == pytest.approx(0.5 * float(merged.rho))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: pvi.HeavyBall(initial=0.0), "initial"),
        (lambda: pvi.HeavyBall(window=1), "window"),
        (lambda: pvi.HeavyBall(max_momentum=1.0), "max_momentum"),
        (lambda: pvi.HeavyBall(elbo_tolerance=-1.0), "elbo_tolerance"),
        (lambda: pvi.HeavyBall(grow=0.5), "grow"),
        (lambda: pvi.HeavyBall(minimum=0.0), "minimum"),
        (lambda: pvi.Asynchronous(pvi.HeavyBall()), "synchronous rounds"),
        (lambda: pvi.Sequential(pvi.HeavyBall()), "synchronous rounds"),
        (lambda: pvi.Synchronous(pvi.HeavyBall(), clients_per_round=2), "every client"),
    ],
)
def test_bad_heavy_ball_arguments_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_adaptive_damping_ignores_falls_within_its_tolerance():
    """An ELBO fall up to ``elbo_tolerance`` nats grows the damping like a rise; a larger fall, or a
    backtracked merge, halves it. Before (16f0d19) every fall halved it: the asynchronous
    SiteFamilies run of tests/families/test_site_families.py, whose ELBO falls by 0.003-0.9 nats
    while the
    slow client's update is in flight, drove it to its floor 1/64 by round 12. The default 1 nat:
    see ``AdaptiveDamping``'s docstring for the measured spread."""
    adaptive = pvi.AdaptiveDamping(initial=0.5, elbo_tolerance=1.0)
    state = adaptive.init(None, None, None)
    rhos = []
    for elbo, backtracked in [(-100.0, False), (-100.9, False), (-102.0, False), (-101.9, True)]:
        state = adaptive.after_round(state, elbo, backtracked)
        rhos.append(float(adaptive.rho(state)))
    # first ELBO: a rise; 0.9 below it: within the tolerance; 1.1 below: a fall; then backtracked
    assert rhos == pytest.approx([0.625, 0.78125, 0.390625, 0.1953125])
    strict = pvi.AdaptiveDamping(initial=0.5, elbo_tolerance=0.0)
    state = strict.after_round(
        strict.after_round(strict.init(None, None, None), -100.0, False), -100.01, False
    )
    assert float(strict.rho(state)) == pytest.approx(0.3125)
    with pytest.raises(ValueError, match="elbo_tolerance"):
        pvi.AdaptiveDamping(elbo_tolerance=-1.0)


def test_defaults():
    assert isinstance(pvi.Synchronous().damping, pvi.HeavyBall)
    assert isinstance(pvi.Synchronous(clients_per_round=2).damping, pvi.AdaptiveDamping)
    assert isinstance(pvi.Asynchronous().damping, pvi.AdaptiveDamping)
    # a float is resolved once, in the constructor; damping=None means one thing per server
    assert repr(pvi.Synchronous(0.5).damping) == "Fixed(0.5)"
    assert repr(pvi.Sequential().damping) == repr(pvi.Continual().damping) == "Fixed(1.0)"
    with pytest.raises(ValueError, match="needs synchronous rounds"):
        pvi.Asynchronous(pvi.HeavyBall())
    with pytest.raises(ValueError, match="needs synchronous rounds"):
        pvi.Synchronous(pvi.HeavyBall(), clients_per_round=2)
    with pytest.raises(ValueError, match="damping must be"):
        pvi.Sequential("0.5")


# -- the case: breast cancer, correlated standardised features, stochastic CVI local updates
# ------------


def _breast_cancer_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def _first_round_within(server, X, y, optimum, max_rounds, threshold=0.2):
    mean, sd = optimum
    update = pvi.NaturalGradientUpdate(step_size=0.5, num_steps=10, num_particles=64)
    inference = pvi.PVI(
        _breast_cancer_model,
        pvi.MeanFieldGaussian(),
        pvi.split_iid(random.PRNGKey(1), len(y), 10),
        update,
        server,
    )
    problem = inference.build(X, y=y)
    state = inference.init(random.PRNGKey(0), problem)
    for r in range(1, max_rounds + 1):
        state, _ = inference.update(state, problem)
        if (
            np.max(np.abs(np.asarray(inference.family.loc_scale(state.q)[0]) - mean) / sd)
            <= threshold
        ):
            return r
    return None


@pytest.mark.slow
def test_breast_cancer_synchronous_reaches_global_vi_within_twice_the_sequential_rounds():
    """The issue's test, paper-scale (30 weights; 55 s of the default run under load), so ``slow``:
    the default run checks the same property (the default Synchronous reaches mean-field VI's
    optimum within twice Sequential's rounds) on smaller data in
    ``test_heavy_ball_converges_where_a_fixed_half_damping_overshoots``. Here: means within 0.2
    posterior sd of global VI's optimum in at most twice Sequential's rounds (measured over
    split/run seeds 0-3: Sequential 7-8 rounds, heavy ball 11-14; AdaptiveDamping not in 30).
    Global VI's optimum is tests/references.py's (Gauss-Hermite expectations, BFGS in float64)."""
    X, y = load_breast_cancer(return_X_y=True)
    X, y = ((X - X.mean(0)) / X.std(0)).astype(np.float32), y.astype(np.float32)
    optimum = BREAST_CANCER_MEAN_FIELD_VI_MEAN, BREAST_CANCER_MEAN_FIELD_VI_SD
    sequential = _first_round_within(pvi.Sequential(), X, y, optimum, 30)
    heavy_ball = _first_round_within(pvi.Synchronous(), X, y, optimum, 2 * sequential)
    assert heavy_ball is not None, sequential
