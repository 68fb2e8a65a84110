"""Hyperparameters (numpyro.param outside the partition plate): clients' gradients, the server's
optimiser."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_pvi as pvi
from numpyro_pvi.families import NatParams

from models import noise_model, type_ii_ml_sigma

N = 60


def log_evidence(X, y, log_sigma):
    """log p(y | sigma) = log N(y; 0, X X^T + sigma^2 I): the type-II likelihood, in closed form."""
    cov = X @ X.T + jnp.exp(2 * log_sigma) * jnp.eye(X.shape[0])
    return dist.MultivariateNormal(jnp.zeros(X.shape[0]), cov).log_prob(y)


@pytest.fixture(scope="module")
def data():
    X = random.normal(random.PRNGKey(0), (N, 3))
    y = X @ jnp.array([1.0, -0.5, 0.3]) + 0.5 * random.normal(random.PRNGKey(1), (N,))
    return X, y


@pytest.fixture(scope="module")
def type_ii_sigma(data):
    return type_ii_ml_sigma(*data)


PARTS = pvi.split_iid(random.PRNGKey(2), N, 3)


def test_clients_gradients_sum_to_the_evidence_gradient(data):
    """Bui et al. 2018, eq. 5: at the exact posterior, sum_m E_q[d log p(y_m | w, s) / d s] = d log
    p(y | s) / d s.

    The state is put at the exact posterior in closed form (float64, then float32): sigma at its
    initial 1, each client's factor its exact Gaussian likelihood, q the prior times the factors
    (what one sequential natural-gradient round of step 1 gives on this model, to float32
    rounding)."""
    X, y = data
    update = pvi.NaturalGradientUpdate(step_size=1.0, num_particles=512)
    inference = pvi.PVI(noise_model, pvi.FullRankGaussian(), PARTS, update, pvi.Sequential())
    problem = inference.build(X, y=y)
    start = inference.init(random.PRNGKey(0), problem)
    assert float(start.hyper["sigma"]) == 0.0  # log sigma: sigma = 1
    Xn, yn = np.asarray(X, np.float64), np.asarray(y, np.float64)
    factors = NatParams(  # N(y_m; X_m w, 1) in w: (X_m^T y_m, -X_m^T X_m / 2)
        jnp.asarray(np.stack([Xn[p].T @ yn[p] for p in PARTS]), jnp.float32),
        jnp.asarray(np.stack([-0.5 * Xn[p].T @ Xn[p] for p in PARTS]), jnp.float32),
    )
    assert factors.eta2.shape == start.factors.eta2.shape  # one slot per client
    state = start._replace(
        q=problem.prior + jax.tree.map(lambda f: f.sum(0), factors), factors=factors
    )
    client_update = jax.jit(update.bind(problem.client_problem))
    total = 0.0
    for m in range(3):
        client = jax.tree.map(lambda a, m=m: a[m], problem.clients)
        cavity = jax.tree.map(lambda a, f, m=m: a - f[m], state.q, state.factors)
        result = client_update(random.PRNGKey(m), client, cavity, state.q, (), state.hyper)
        total = total + result.hyper_grad["sigma"]
    expected = jax.jit(jax.grad(lambda s: log_evidence(X, y, s)))(state.hyper["sigma"])
    # at sigma = 1 the gradient is -40.2; with 512 antithetic draws the sum is 0.21 % smaller in
    # size (it was within 0.5 % over seeds 0-3 with q from a natural-gradient round)
    assert float(total) == pytest.approx(float(expected), rel=0.02)


def _noise_scale_run(data, kind):
    X, y = data
    if kind == "natural_gradient":
        update, server, rounds, lr = (
            pvi.NaturalGradientUpdate(step_size=1.0, num_particles=32),
            pvi.Synchronous(1.0),
            100,
            0.05,
        )
    else:
        update = pvi.GradientUpdate(
            optax.adam(optax.exponential_decay(2e-2, 200, 0.05)), num_steps=200, num_particles=8
        )
        server, rounds, lr = pvi.Synchronous(0.5), 100, 0.05
    inference = pvi.PVI(
        noise_model,
        pvi.FullRankGaussian(),
        PARTS,
        update,
        server,
        hyper_optimizer=optax.adam(optax.exponential_decay(lr, rounds, 0.05)),
    )
    return inference, inference.run(random.PRNGKey(0), rounds, X, y=y, progress_bar=False)


@pytest.fixture(scope="module")
def noise_scale_run(data):
    """``kind -> (inference, result)`` of test_noise_scale_reaches_type_ii_maximum_likelihood's run:
    each built once (test_hyperparameters_reach_predictive_and_checkpoints reads the
    natural-gradient one)."""
    runs = {}

    def run(kind):
        if kind not in runs:
            runs[kind] = _noise_scale_run(data, kind)
        return runs[kind]

    return run


@pytest.mark.parametrize("kind", ["natural_gradient", "gradient"])
def test_noise_scale_reaches_type_ii_maximum_likelihood(noise_scale_run, type_ii_sigma, kind):
    inference, result = noise_scale_run(kind)
    assert result.history.num_rejected.sum() == 0
    sigma = float(result.hyperparameters["sigma"])
    # type-II ML sigma = 0.5431 (from 1.0); natural-gradient PVI in 100 rounds ended 0.18-0.23 %
    # above it over seeds 0-7 (0.01-0.04 % in 200 rounds, 2.1 % below in 60), gradient PVI (MC-noisy
    # q and gradients) 0.30-0.35 % above over seeds 0-3 (3-4 % in 50 rounds)
    assert sigma == pytest.approx(type_ii_sigma, rel=0.005 if kind == "natural_gradient" else 0.02)
    # learned in log space: positive
    assert float(jnp.exp(result.state.hyper["sigma"])) == pytest.approx(sigma)


@pytest.fixture(scope="module")
def item_7_data():
    """Issue 23, item 7: 40 rows, 8 weights, 4 clients (type-II ML sigma 0.4517, from 1.0)."""
    X = random.normal(random.PRNGKey(10), (40, 8))
    y = X @ random.normal(random.PRNGKey(20), (8,)) + 0.5 * random.normal(random.PRNGKey(30), (40,))
    return X, y, pvi.split_iid(random.PRNGKey(2), 40, 4)


@pytest.mark.parametrize("kind", ["natural_gradient", "gradient"])
def test_defaults_reach_type_ii_maximum_likelihood_in_40_rounds(item_7_data, kind):
    """Item 7 with the default hyper_optimizer (pvi.rprop) and num_hyper_particles: within 1 % after
    40 rounds.

    Measured (this run with keys 0-3, sigma read every round): the gradient update ended 0.15-0.95 %
    away (key 1: -0.52 %), the natural-gradient one 0.03-0.32 % (key 1: -0.03 %). On the previous
    defaults (optax.rprop(0.1), whose update is the previous round's step, and the step's 8 / 16
    draws for the hyperparameters' gradient) key 1 ended -1.11 % and +1.20 % away (this test fails
    there), keys 0-3 up to 1.7 % and 2.1 %.
    """
    X, y, parts = item_7_data
    update = (
        pvi.NaturalGradientUpdate()
        if kind == "natural_gradient"
        else pvi.GradientUpdate(optax.adam(1e-2), num_steps=200, num_particles=8)
    )
    inference = pvi.PVI(noise_model, pvi.FullRankGaussian(), parts, update, pvi.Synchronous(0.5))
    result = inference.run(random.PRNGKey(1), 40, X, y=y, progress_bar=False)
    assert float(result.hyperparameters["sigma"]) == pytest.approx(type_ii_ml_sigma(X, y), rel=0.01)


def test_default_hyper_optimizer_steps_on_the_rounds_own_gradient():
    """pvi.rprop is optax.rprop's rule without its delay: optax's update k + 1 is pvi.rprop's update
    k."""
    grads = jnp.array([3.0, 2.0, 1.0, -1.0, -2.0, 0.5, 0.7, 0.2])
    ours, theirs = pvi.rprop(0.1), optax.rprop(0.1)
    state, optax_state, x = ours.init(jnp.zeros(())), theirs.init(jnp.zeros(())), jnp.zeros(())
    steps, optax_steps = [], []
    for g in grads:
        update, state = ours.update(g, state)
        optax_update, optax_state = theirs.update(g, optax_state, x)
        steps.append(float(update)), optax_steps.append(float(optax_update))
    assert steps[0] == pytest.approx(-0.1) and optax_steps[0] == 0.0
    # away from a sign flip the two agree a round apart; at a flip neither steps
    np.testing.assert_allclose(steps[:2], optax_steps[1:3], rtol=1e-6)
    assert steps[3] == 0.0 and optax_steps[3] == 0.0


@pytest.mark.parametrize("update", [pvi.GradientUpdate, pvi.NaturalGradientUpdate])
def test_num_hyper_particles_is_checked(update):
    args = (optax.adam(1e-2), 10) if update is pvi.GradientUpdate else ()
    with pytest.raises(ValueError, match="num_hyper_particles must be an integer"):
        update(*args, num_hyper_particles=0)


def test_hyperparameters_reach_predictive_and_checkpoints(data, noise_scale_run, tmp_path):
    """On the natural-gradient run of test_noise_scale_reaches_type_ii_maximum_likelihood."""
    X, y = data
    inference, result = noise_scale_run("natural_gradient")
    # the data pull the noise down from its initial 1
    assert float(result.hyperparameters["sigma"]) < 1.0
    # SVI.get_params' counterpart: constrained values by site (the state holds log sigma,
    # constraints.positive)
    params = inference.get_params(result.state)
    assert list(params) == ["sigma"]
    np.testing.assert_allclose(params["sigma"], jnp.exp(result.state.hyper["sigma"]), rtol=1e-6)
    posterior = inference.get_posterior(result.state)
    np.testing.assert_allclose(posterior.mean, result.get_posterior().mean)
    pvi.save(result.state, tmp_path / "state.npz")
    loaded = pvi.load(tmp_path / "state.npz")
    np.testing.assert_allclose(loaded.hyper["sigma"], result.state.hyper["sigma"])
    predictive = numpyro.infer.Predictive(
        noise_model,
        guide=result.guide(),
        params=result.hyperparameters,
        num_samples=2000,
        return_sites=["y"],
    )
    draws = predictive(random.PRNGKey(1), X[:3])["y"]
    sd = float(jnp.std(draws[:, 0] - draws[:, 0].mean()))
    # noise dominates the spread
    assert sd == pytest.approx(float(result.hyperparameters["sigma"]), rel=0.15)


def test_param_inside_the_partition_plate_is_refused(data):
    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with pvi.partition_plate("data", X.shape[0]):
            offset = numpyro.param("offset", jnp.zeros(X.shape[0]))
            numpyro.sample("y", dist.Normal(X @ w + offset, 1.0), obs=y)

    inference = pvi.PVI(model, pvi.MeanFieldGaussian(), PARTS, pvi.NaturalGradientUpdate())
    with pytest.raises(
        ValueError, match="numpyro.param site 'offset' is inside partition plate 'data'"
    ):
        inference.init(random.PRNGKey(0), *data[:1], y=data[1])
