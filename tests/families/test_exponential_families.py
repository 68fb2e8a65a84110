"""Gamma, Beta and Dirichlet factors: exact conjugate posteriors in one synchronous CVI round.

Each model has a conjugate prior and likelihood, so every client's natural-gradient site is exactly
linear in the family's sufficient statistics and the least-squares site recovers it to float
precision (float32: relative error ~1e-6 measured in one round; asserted at 1e-5 relative; a
continual pass, whose rounding grows client by client, says its own).
"""

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
from numpyro_pvi.families.exponential import regression_site
from numpyro_pvi.server.merge import merge

from models import bernoulli_model, categorical_model, poisson_model

SIZES = [3, 7, 12, 15, 20]  # five uneven clients
N = sum(SIZES)
PARTS = np.split(np.arange(N), np.cumsum(SIZES)[:-1])


def one_round(model, family, laplace_fallback=True, **data):
    """One synchronous round of CVI (step 1) from the prior.

    ``laplace_fallback=False`` where the test is about the family's site, not the update's
    defaults: every step of these conjugate rounds is exact and taken (``clamped`` 0, asserted),
    so the Laplace site, which a step takes only when no halving of it is acceptable, is never
    used; without it the round compiles in ~30 % less time (Beta: 7.0 -> 4.1 s of CPU). The
    default update (the fallback compiled in, and not taken) runs in
    ``test_poisson_gamma_exact_in_one_round``; the fallback itself is
    tests/local_updates/test_natural_gradient.py's (the Laplace sites of the exponential
    families)."""
    inference = pvi.PVI(
        model,
        family,
        partitions=PARTS,
        server=pvi.Synchronous(1.0),
        local_update=pvi.NaturalGradientUpdate(
            step_size=1.0, num_particles=16, laplace_fallback=laplace_fallback
        ),
    )
    result = inference.run(random.PRNGKey(1), 1, progress_bar=False, **data)
    assert int(np.sum(result.history.clamped)) == 0  # every step exact and taken whole
    return result


def test_poisson_gamma_exact_in_one_round():
    y = random.poisson(random.PRNGKey(0), 3.0, (N,)).astype(jnp.float32)
    result = one_round(poisson_model, pvi.Gamma(), y=y)
    shape, rate = pvi.Gamma().to_params(result.state.q)
    np.testing.assert_allclose(shape, [2.0 + float(y.sum())], rtol=1e-5)
    np.testing.assert_allclose(rate, [0.5 + N], rtol=1e-5)
    assert int(np.sum(result.history.accepted)) == len(SIZES)


def test_poisson_gamma_exact_after_one_continual_pass():
    # each client's conjugate site is exact whatever q it starts from, so a streaming pass is exact
    # too (the other servers: Synchronous above, Sequential/Synchronous/Asynchronous in
    # test_site_families.py)
    server = pvi.Continual()
    y = random.poisson(random.PRNGKey(0), 3.0, (N,)).astype(jnp.float32)
    inference = pvi.PVI(
        poisson_model,
        pvi.Gamma(),
        partitions=PARTS,
        server=server,
        # no Laplace fallback: never taken here (one_round's docstring)
        local_update=pvi.NaturalGradientUpdate(
            step_size=1.0, num_particles=16, laplace_fallback=False
        ),
    )
    result = inference.run(random.PRNGKey(1), 1, y=y, progress_bar=False)
    assert int(np.sum(result.history.clamped)) == 0
    shape, rate = pvi.Gamma().to_params(result.state.q)
    # float32 rounding, which grows along the pass: each client's site is a 2 x 2 solve against its
    # q's Fisher, whose condition number grows with the shape (2,300 at the last client's q, shape
    # 141: a normwise bound of cond * eps = 2.7e-4 on a site's relative error). Measured: 9.3e-6
    # relative (XLA at users' optimisation level, the Laplace fallback compiled in); at the suite's
    # level 0 (tests/conftest) 4.9e-6 with the fallback compiled in and 1.7e-6 without it (this
    # update); the one-round synchronous sites above: 2e-7 and 1e-6. Asserted at 5e-5; a pass that
    # dropped one row would be off by 1 / 57.5 = 1.7e-2 in the rate.
    np.testing.assert_allclose(shape, [2.0 + float(y.sum())], rtol=5e-5)
    np.testing.assert_allclose(rate, [0.5 + N], rtol=5e-5)


def test_beta_bernoulli_exact_in_one_round():
    y = random.bernoulli(random.PRNGKey(0), 0.3, (N,)).astype(jnp.float32)
    result = one_round(bernoulli_model, pvi.Beta(), laplace_fallback=False, y=y)
    a, b = pvi.Beta().to_params(result.state.q)
    np.testing.assert_allclose(a, [2.0 + float(y.sum())], rtol=1e-5)
    np.testing.assert_allclose(b, [3.0 + N - float(y.sum())], rtol=1e-5)


def test_dirichlet_categorical_exact_in_one_round():
    y = random.categorical(random.PRNGKey(0), jnp.log(jnp.array([0.1, 0.2, 0.3, 0.4])), shape=(N,))
    result = one_round(categorical_model, pvi.Dirichlet(), laplace_fallback=False, y=y)
    (alpha,) = pvi.Dirichlet().to_params(result.state.q)
    counts = np.bincount(np.asarray(y), minlength=4)
    np.testing.assert_allclose(alpha, np.array([1.0, 2.0, 0.5, 3.0]) + counts, rtol=1e-5)


def test_gradient_update_fits_the_gamma_posterior():
    """GradientUpdate (NumPyro's reparameterised Gamma) reaches the exact posterior within Monte
    Carlo error: the last-iterate noise of 4-particle ELBO gradients, measured over seeds at ~2 % of
    the mean and ~15 % of the variance, asserted at 5 % and 40 %."""
    y = random.poisson(random.PRNGKey(0), 3.0, (N,)).astype(jnp.float32)
    inference = pvi.PVI(
        poisson_model,
        pvi.Gamma(),
        partitions=PARTS,
        server=pvi.Sequential(),
        local_update=pvi.GradientUpdate(optax.adam(0.05), num_steps=400, num_particles=4),
    )
    result = inference.run(random.PRNGKey(2), 2, y=y, progress_bar=False)
    marg = pvi.Gamma().marginals(result.state.q)
    shape, rate = 2.0 + float(y.sum()), 0.5 + N
    np.testing.assert_allclose(marg.mean, [shape / rate], rtol=0.05)
    np.testing.assert_allclose(marg.variance, [shape / rate**2], rtol=0.4)


def test_invalid_cavity_is_rejected_like_a_gaussian_one():
    """A merge that would leave a cavity with Gamma shape <= 0 backtracks, and is rejected if no
    halving helps."""
    family = pvi.Gamma()
    q = family.from_params(jnp.array([3.0]), jnp.array([2.0]))
    factors = NatParams(jnp.zeros((2, 1)), jnp.zeros((2, 1)))
    # more shape and rate: valid at rho = 1
    delta = NatParams(jnp.array([[1.0]]), jnp.array([[-1.0]]))
    merged = merge(family, q, factors, jnp.array([0]), delta, jnp.array([True]), 1.0, 3)
    assert bool(merged.valid) and float(merged.damping) == 1.0
    # q (and client 1's cavity) get shape 3 - 5 rho
    bad = NatParams(jnp.array([[-5.0]]), jnp.array([[0.0]]))
    merged = merge(family, q, factors, jnp.array([0]), bad, jnp.array([True]), 1.0, 5)
    assert bool(merged.valid) and float(merged.damping) == 0.5
    # valid only below rho = 3e-4: rejected
    worse = NatParams(jnp.array([[-1e4]]), jnp.array([[0.0]]))
    merged = merge(family, q, factors, jnp.array([0]), worse, jnp.array([True]), 1.0, 3)
    assert not bool(merged.valid)
    np.testing.assert_array_equal(merged.q.eta1, q.eta1)


@pytest.mark.parametrize("family, params", [(pvi.Gamma(), (2.5, 1.5)), (pvi.Beta(), (2.0, 5.0))])
def test_marginals_and_validity(family, params):
    nat = family.from_params(*(jnp.array([p]) for p in params))
    d = family.to_dist(nat)
    marg = family.marginals(nat)
    np.testing.assert_allclose(marg.mean, d.mean, rtol=1e-6)
    np.testing.assert_allclose(marg.variance, d.variance, rtol=1e-6)
    # a zero shape / concentration
    improper = family.from_params(jnp.array([0.0]), jnp.array([1.0]))
    assert bool(family.is_valid(nat)) and not bool(family.is_valid(improper))
    assert np.isnan(family.marginals(improper).mean).all()


@pytest.mark.parametrize(
    "family, dim, mean, var",
    [
        (pvi.Gamma(), 8, 1.0, 0.5),  # Gamma(2, rate 2)
        (pvi.Beta(), 8, 0.5, 0.05),  # Beta(2, 2)
        (pvi.Dirichlet(), 8, 1 / 8, 2 * 14 / (16**2 * 17)),  # Dirichlet(2, ..., 2) on 8
    ],
)
def test_reference_draws_are_the_member_with_every_parameter_two(family, dim, mean, var):
    """The points an exponential-family block's prior is read off at (made from sums of
    exponentials, not by ``jax.random.gamma``): in the support, with the member's mean and variance.
    2,048 draws (256 x 8, fixed key): the mean's Monte Carlo sd is at most sqrt(0.5 / 2048) = 0.016
    (Gamma) and the variance's at most 0.5 * sqrt(5 / 2048) = 0.025 (Gamma's excess kurtosis 3);
    the tolerances are 4 of those, scaled to each member."""
    # no Gamma rejection sampler in the program (0.6-0.9 s of compilation in a fresh process)
    assert "random_gamma" not in str(jax.make_jaxpr(lambda: family.reference_draws(dim))())
    draws = np.asarray(family.reference_draws(dim))
    assert draws.shape == (256, dim) and np.all(draws > 0)
    if isinstance(family, pvi.Dirichlet):
        np.testing.assert_allclose(draws.sum(1), 1.0, rtol=1e-5)
    sd = np.sqrt(var / draws.size)
    assert abs(draws.mean() - mean) < 4 * sd
    assert abs(draws.var() - var) < 4 * var * np.sqrt(5 / draws.size)


def test_regression_site_is_the_natural_gradient_of_a_linear_function():
    """For f linear in the sufficient statistics the least-squares site is f's coefficients,
    whatever q is."""
    family = pvi.Gamma()
    q = family.from_params(jnp.array([4.0, 1.5]), jnp.array([2.0, 0.5]))
    theta = family.draw(q, random.PRNGKey(0), 16)
    values = jnp.sum(3.0 * jnp.log(theta) - 2.0 * theta, axis=1) + 7.0
    np.testing.assert_allclose(
        regression_site(family.stats(theta), values), [3.0, 3.0, -2.0, -2.0], rtol=1e-4
    )


def test_prior_of_another_family_and_wrong_support_are_refused():
    def lognormal_prior(y=None):
        rate = numpyro.sample("rate", dist.LogNormal(0.0, 1.0))
        with pvi.partition_plate("data", y.shape[0]):
            numpyro.sample("y", dist.Poisson(rate), obs=y)

    y = jnp.ones(N)
    inference = pvi.PVI(
        lognormal_prior, pvi.Gamma(), partitions=PARTS, local_update=pvi.NaturalGradientUpdate()
    )
    with pytest.raises(ValueError, match="not a Gamma distribution"):
        inference.build(y=y)
    inference = pvi.PVI(
        bernoulli_model, pvi.Gamma(), partitions=PARTS, local_update=pvi.NaturalGradientUpdate()
    )
    with pytest.raises(ValueError, match="has a prior on another support"):
        inference.build(y=y)
    # SNEP runs with Gamma (tests/local_updates/test_snep_blocks.py), but not with its Gaussian
    # site clamp
    inference = pvi.PVI(
        poisson_model,
        pvi.Gamma(),
        partitions=PARTS,
        local_update=pvi.SNEPUpdate(site_variance=(0.1, 1.0)),
    )
    with pytest.raises(ValueError, match="site_variance"):
        inference.init(random.PRNGKey(0), inference.build(y=y))


@pytest.mark.parametrize(
    "model, family", [(poisson_model, pvi.Gamma()), (categorical_model, pvi.Dirichlet())]
)
def test_moment_matching_is_exact_for_a_conjugate_likelihood(model, family):
    """EP matches the expected sufficient statistics; its proposal (cavity times the regression
    site) is the tilted distribution itself, so the weights are uniform and the control variate
    makes the match exact up to the Newton solve in float32 (measured 2e-5 relative; asserted at
    1e-4)."""
    if family.param_names == ("concentration",):
        y = random.categorical(
            random.PRNGKey(0), jnp.log(jnp.array([0.1, 0.2, 0.3, 0.4])), shape=(N,)
        )
        expected = np.array([1.0, 2.0, 0.5, 3.0]) + np.bincount(np.asarray(y), minlength=4)
    else:
        y = random.poisson(random.PRNGKey(0), 3.0, (N,)).astype(jnp.float32)
        expected = np.array([2.0 + float(y.sum()), 0.5 + N])
    inference = pvi.PVI(
        model,
        family,
        partitions=PARTS,
        server=pvi.Synchronous(1.0),
        local_update=pvi.MomentMatchingUpdate(tilted=pvi.Importance(num_particles=64)),
    )
    result = inference.run(random.PRNGKey(1), 1, y=y, progress_bar=False)
    np.testing.assert_allclose(
        np.concatenate(family.to_params(result.state.q)), expected, rtol=1e-4
    )


def test_refusals_name_the_site_the_family_and_the_alternative():
    """An exponential-family block has no prior factor: a LogNormal prior in a Gamma block is
    refused naming the site, the family and the Gaussian alternative; two simplex sites in one
    Dirichlet are refused too."""

    def lognormal_rate(y=None):
        rate = numpyro.sample("rate", dist.LogNormal(0.0, 1.0))
        with pvi.partition_plate("data", y.shape[0]):
            numpyro.sample("y", dist.Poisson(rate), obs=y)

    y = jnp.ones(N)
    inference = pvi.PVI(
        lognormal_rate,
        pvi.SiteFamilies({"rate": pvi.Gamma()}),
        partitions=PARTS,
        local_update=pvi.NaturalGradientUpdate(),
    )
    with pytest.raises(ValueError, match=r"\['rate'\].*Gamma\(\).*Gaussian family"):
        inference.build(y=y)
    with pytest.raises(ValueError, match="holds one simplex site; got 2 sites"):
        pvi.Dirichlet().with_layout(None, {"a": (4,), "b": (3,)})


def test_moment_matching_with_the_cavity_proposal():
    """proposal="cavity" is honoured (importance sampling from the cavity, not the regression site):
    no longer exact for a conjugate likelihood (the weights are not uniform), but close with 4096
    draws for 5 clients' Poisson counts. Measured over seeds 1-8 after 2 sequential rounds: E[rate]
    within 0.35 % of the exact posterior's, its shape within 9.2 % (the shape rests on E[log rate],
    which the importance weights estimate less well); asserted at 1 % and 20 %."""
    y = random.poisson(random.PRNGKey(0), 3.0, (N,)).astype(jnp.float32)
    exact = np.array([2.0 + float(y.sum()), 0.5 + N])
    inference = pvi.PVI(
        poisson_model,
        pvi.Gamma(),
        partitions=PARTS,
        server=pvi.Sequential(),
        local_update=pvi.MomentMatchingUpdate(
            tilted=pvi.Importance(num_particles=4096), proposal="cavity"
        ),
    )
    result = inference.run(random.PRNGKey(1), 2, y=y, progress_bar=False)
    shape, rate = pvi.Gamma().to_params(result.state.q)
    np.testing.assert_allclose(float(shape[0] / rate[0]), exact[0] / exact[1], rtol=0.01)
    np.testing.assert_allclose(float(shape[0]), exact[0], rtol=0.2)


def batched_categorical_model(group, y=None):
    probs = numpyro.sample(
        "probs", dist.Dirichlet(jnp.array([[1.0, 2.0, 0.5], [3.0, 1.0, 1.0]])).to_event(1)
    )
    with pvi.partition_plate("data", y.shape[0]):
        numpyro.sample("y", dist.Categorical(probs[group]), obs=y)


def test_batched_dirichlet_is_exact_in_one_round():
    """A (2, 3) batch of simplices (one per group) with categorical counts: each row's posterior is
    its prior's concentrations plus its group's counts, after one synchronous CVI round (float32
    precision, as above)."""
    group = (jnp.arange(N) % 2).astype(jnp.int32)
    y = random.categorical(random.PRNGKey(0), jnp.log(jnp.array([0.2, 0.3, 0.5])), shape=(N,))
    counts = np.zeros((2, 3))
    np.add.at(counts, (np.asarray(group), np.asarray(y)), 1.0)
    result = one_round(
        batched_categorical_model, pvi.Dirichlet(), laplace_fallback=False, group=group, y=y
    )
    family = result.family  # laid out: it records the (2, 3) shape
    expected = np.array([[1.0, 2.0, 0.5], [3.0, 1.0, 1.0]]) + counts
    np.testing.assert_allclose(family.to_params(result.state.q)[0], expected.reshape(-1), rtol=1e-5)
    marg = family.marginals(result.state.q)
    np.testing.assert_allclose(
        marg.mean.reshape(2, 3), expected / expected.sum(1, keepdims=True), rtol=1e-5
    )
    samples = result.sample_posterior(random.PRNGKey(3), 100)["probs"]
    assert samples.shape == (100, 2, 3)
    np.testing.assert_allclose(samples.sum(-1), 1.0, rtol=1e-5)
    # per-row means, alpha_0 = 99
    start = family.initial_q(jnp.array([0.2, 0.3, 0.5, 1.0, 1.0, 2.0]), 0.1)
    np.testing.assert_allclose(
        start.eta1 + 1.0, 99.0 * np.array([0.2, 0.3, 0.5, 0.25, 0.25, 0.5]), rtol=1e-5
    )
