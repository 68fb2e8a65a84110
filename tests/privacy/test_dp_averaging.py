import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import random

import numpyro_pvi as pvi

from fakes import assert_checkpoint_resumes
from models import linear_model, normal_gamma_model, poisson_model

PARTS = pvi.split_iid(random.PRNGKey(5), 300, 3)  # three clients of 100 rows
# the options of a DPLocalAveraging whose numbers do not matter to the test
SHARDS = dict(num_shards=2, clip_norm=1.0, noise_multiplier=1.0)


def _setup(update, X, y):
    """The client problem, client 0's data and a q (= its cavity: no factor yet) for calling updates
    directly."""
    problem = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), PARTS, update, pvi.Sequential()).build(
        X, y=y
    )
    family, dim = problem.client_problem.family, problem.client_problem.dim
    q = family.from_loc_scale(jnp.zeros(dim), jnp.ones(dim))
    return problem.client_problem, jax.tree.map(lambda a: a[0], problem.clients), q


def _delta(update, client_problem, client, q, key):
    return update.bind(client_problem)(key, client, q, q, update.init_state(client_problem)).delta


# the wrapped update of the two tests below (one compiled program of it, shared)
INNER = pvi.GradientUpdate(optax.adam(2e-2), num_steps=400, num_particles=4)


@pytest.fixture(scope="module")
def one_coordinate(linear_data):
    """Client 0 of the linear regression on its first coordinate (``_setup``) and the wrapped
    update's delta there, ``key -> delta``, compiled once for both tests."""
    X, y = linear_data
    client_problem, client, q = _setup(INNER, X[:, :1], y)
    whole = jax.jit(lambda k: _delta(INNER, client_problem, client, q, k))
    return client_problem, client, q, whole


def test_one_shard_without_noise_is_the_wrapped_update(one_coordinate):
    client_problem, client, q, whole = one_coordinate
    averaged = pvi.DPLocalAveraging(INNER, num_shards=1, clip_norm=1e9, noise_multiplier=0.0)
    key = random.PRNGKey(0)
    got = jax.jit(lambda k: _delta(averaged, client_problem, client, q, k))(key)
    # shard s runs with split(key, num_shards + 1)[s]
    want = whole(random.split(key, 2)[0])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_shards_with_scaled_likelihoods_average_to_the_whole_clients_update(one_coordinate):
    """One coordinate, Gaussian likelihood: each shard's tilted posterior has natural parameters
    ``cavity + S * stats_s``, so the mean of the shards' deltas is the whole client's (exactly, for
    exact fits)."""
    client_problem, client, q, whole = one_coordinate
    averaged = pvi.DPLocalAveraging(INNER, num_shards=4, clip_norm=1e9, noise_multiplier=0.0)
    family = client_problem.family
    whole = family.loc_scale(q + whole(random.PRNGKey(1)))
    shards = family.loc_scale(
        q + jax.jit(lambda k: _delta(averaged, client_problem, client, q, k))(random.PRNGKey(2))
    )
    # Measured over 6 pairs of keys: the averaged fit's mean 0.01-0.22 of the whole client's
    # posterior sd off, its sd within 13 % (the shards' Monte Carlo noise, amplified in the
    # factors). Without the S-scaling the shards' average would carry a quarter of the data (sd
    # ~2x).
    assert abs(float(shards[0][0] - whole[0][0])) < 0.4 * float(whole[1][0])
    np.testing.assert_allclose(shards[1], whole[1], rtol=0.25)


@pytest.fixture(scope="module")
def quick(linear_data):
    """The noisy and the noiseless averaging (4 shards clipped to C = 0.05, 5 steps each) on client
    0, and both's deltas at 500 keys (the shards' fits use the same keys: only the noise differs),
    computed by one program for the tests below."""
    inner = pvi.GradientUpdate(optax.adam(2e-2), num_steps=5)
    kwargs = dict(num_shards=4, clip_norm=0.05)
    noisy, exact = (pvi.DPLocalAveraging(inner, noise_multiplier=s, **kwargs) for s in (2.0, 0.0))
    client_problem, client, q = _setup(exact, *linear_data)

    def deltas(key):
        return [jnp.concatenate(_delta(u, client_problem, client, q, key)) for u in (noisy, exact)]

    keys = random.split(random.PRNGKey(4), 500)
    return noisy, [np.asarray(d) for d in jax.jit(jax.vmap(deltas))(keys)]


def test_each_shard_is_clipped(quick):
    _, (_, deltas) = quick
    norms = np.linalg.norm(deltas, axis=1)
    assert np.all(norms <= 0.05 * (1 + 1e-5))  # a mean of vectors of norm <= C
    # near C: every shard's delta (far longer than C) was clipped, all alike
    assert np.all(norms > 0.5 * 0.05)


def test_noise_sd_is_noise_multiplier_times_the_sensitivity(quick):
    noisy, (with_noise, without) = quick
    assert noisy.sensitivity == pytest.approx(2 * 0.05 / 4)
    noise = with_noise - without
    # 500 x 6 draws: the sample sd is within ~1.3 % of the truth (1 sd)
    np.testing.assert_allclose(noise.std(), 2.0 * noisy.sensitivity, rtol=0.05)


def test_bad_arguments_are_named():
    inner = pvi.GradientUpdate(optax.adam(1e-2), num_steps=10)
    with pytest.raises(TypeError, match="LocalUpdate"):
        pvi.DPLocalAveraging(object(), **SHARDS)
    dp = pvi.DPGradientUpdate(
        optax.adam(1e-2), num_steps=10, batch_size=10, clip_norm=1.0, noise_multiplier=1.0
    )
    with pytest.raises(TypeError, match="non-private"):
        pvi.DPLocalAveraging(dp, **SHARDS)
    with pytest.raises(ValueError, match="num_shards"):
        pvi.DPLocalAveraging(inner, **{**SHARDS, "num_shards": 0})
    with pytest.raises(ValueError, match="clip_norm"):
        pvi.DPLocalAveraging(inner, **{**SHARDS, "clip_norm": -1.0})


# ---------------------------------------------------------------- any family the wrapped update
# supports
def _cvi(num_particles=16, laplace_fallback=True):
    return pvi.NaturalGradientUpdate(
        step_size=1.0, num_particles=num_particles, laplace_fallback=laplace_fallback
    )


def test_conjugate_shards_release_the_whole_clients_delta_and_the_exact_posterior():
    """Poisson-Gamma with ``pvi.Gamma()`` and CVI (step 1): each shard's site is exactly linear in
    (log rate, rate) and its likelihood is scaled by S, so the mean of the shards' deltas is the
    whole client's non-private delta, its conjugate statistics ``(sum y_m, -n_m)`` (empty shards
    included), and one round gives the exact Gamma posterior (float32 rounding: ~1e-6 relative)."""
    y = random.poisson(random.PRNGKey(0), 3.0, (40,)).astype(jnp.float32)
    # every shard's step is exact and taken whole (clamped 0, asserted): without the Laplace
    # fallback, which such a step never takes, the round compiles in ~25 % less time
    inner = _cvi(laplace_fallback=False)
    averaged = pvi.DPLocalAveraging(inner, num_shards=4, clip_norm=1e9, noise_multiplier=0.0)
    parts = [np.arange(0, 12), np.arange(12, 40)]
    result = pvi.PVI(poisson_model, pvi.Gamma(), parts, averaged, pvi.Synchronous(1.0)).run(
        random.PRNGKey(3), 1, y=y, progress_bar=False
    )
    assert int(np.sum(result.history.clamped)) == 0
    # one round from t_m = 0 with damping 1: each factor is the released delta
    factors = result.state.factors
    np.testing.assert_allclose(factors.eta1[:2, 0], [float(y[p].sum()) for p in parts], rtol=1e-5)
    np.testing.assert_allclose(factors.eta2[:2, 0], [-12.0, -28.0], rtol=1e-5)
    shape, rate = pvi.Gamma().to_params(result.state.q)
    np.testing.assert_allclose(shape, [2.0 + float(y.sum())], rtol=1e-5)
    np.testing.assert_allclose(rate, [0.5 + 40], rtol=1e-5)


def test_site_families_clip_every_block_and_checkpoint_resumes_exactly(tmp_path):
    """Normal-Gamma regression, ``SiteFamilies`` (full-rank w, Gamma tau), one client, one shard
    clipped to C = 0.5: the first round's factor (the released delta) has norm C over every leaf
    (eta1 and each block's eta2: the whole client's delta is far longer) with no leaf zeroed; the
    run resumes exactly from a checkpoint."""
    X = random.normal(random.PRNGKey(4), (40, 2))
    y = X @ jnp.array([1.0, -0.5]) + 0.7 * random.normal(random.PRNGKey(5), (40,))
    family = pvi.SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})
    # CVI's steps from the prior are often clamped here
    inner = pvi.GradientUpdate(optax.adam(0.05), num_steps=50)
    update = pvi.DPLocalAveraging(inner, num_shards=1, clip_norm=0.5, noise_multiplier=0.0)
    inference = pvi.PVI(normal_gamma_model, family, [np.arange(40)], update, pvi.Sequential())
    result = inference.run(random.PRNGKey(7), 1, X, y=y, progress_bar=False)
    leaves = [np.asarray(leaf[0], np.float64) for leaf in jax.tree.leaves(result.state.factors)]
    # eta1, w's eta2 (2 x 2), tau's eta2
    assert len(leaves) == 3 and all(np.any(leaf != 0) for leaf in leaves)
    np.testing.assert_allclose(np.sqrt(sum(np.sum(leaf**2) for leaf in leaves)), 0.5, rtol=1e-5)
    assert bool(result.family.is_valid(result.state.q))
    assert_checkpoint_resumes(inference, result, tmp_path / "run.npz")


class _GaussianOnlyUpdate(pvi.local_updates.LocalUpdate):
    """A local update that declares no support for non-Gaussian families (it keeps
    ``LocalUpdate``'s default ``supports_factor_families = False``)."""

    def init_state(self, problem):
        return ()

    def bind(self, problem):
        raise AssertionError("not reached: PVI refuses the family first")


def test_factor_family_support_is_the_wrapped_updates():
    assert pvi.DPLocalAveraging(_cvi(), **SHARDS).supports_factor_families
    assert not pvi.DPLocalAveraging(_GaussianOnlyUpdate(), **SHARDS).supports_factor_families
    inference = pvi.PVI(
        poisson_model,
        pvi.Gamma(),
        [np.arange(4)],
        pvi.DPLocalAveraging(_GaussianOnlyUpdate(), **SHARDS),
        pvi.Synchronous(1.0),
    )
    with pytest.raises(NotImplementedError, match="DPLocalAveraging needs a Gaussian family"):
        inference.build(y=jnp.ones(4))
