"""``NaturalGradientUpdate`` (CVI): exact on a conjugate model, the global VI fixed point, safe
steps."""

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
from numpyro_pvi.local_updates._numerics import laplace_site

from models import (
    exact_linear_posterior,
    linear_model,
    logistic_model,
    normal_gamma_model,
    normal_gamma_vb,
    robust_model,
)


@pytest.mark.parametrize(
    "server", [pvi.Sequential(), pvi.Synchronous(1.0)], ids=["sequential", "synchronous"]
)
def test_cvi_step_one_is_exact_after_one_round(linear_data, server):
    """4 clients. (A single client is a case of both: the sequential round's first client updates
    from the prior, alone in its group, as one client does; the one-client cases ran no code these
    do not, and compiled programs of their own.)"""
    X, y = linear_data
    mean, cov = exact_linear_posterior(X, y)
    partitions = pvi.split_iid(random.PRNGKey(4), X.shape[0], 4)
    inference = pvi.PVI(
        linear_model, pvi.FullRankGaussian(), partitions, pvi.NaturalGradientUpdate(1.0), server
    )
    state = inference.run(random.PRNGKey(0), 1, X, y=y, progress_bar=False).state
    loc, scale_tril = inference.family.loc_scale(state.q)
    # Antithetic pairs make the Bonnet/Price estimates exact for a quadratic log-likelihood: only
    # float32 error.
    np.testing.assert_allclose(loc, mean, atol=1e-5)
    np.testing.assert_allclose(scale_tril @ scale_tril.T, cov, atol=1e-6)


@pytest.mark.parametrize(
    "family", [pvi.MeanFieldGaussian(), pvi.FullRankGaussian()], ids=["mean_field", "full_rank"]
)
def test_cvi_and_gradient_updates_share_the_fixed_point(logistic_data, family):
    X, y = logistic_data
    partitions = pvi.split_iid(random.PRNGKey(3), X.shape[0], 10)
    results = []
    for update in (
        pvi.NaturalGradientUpdate(0.5, num_steps=5, num_particles=64),
        pvi.GradientUpdate(optax.adam(3e-2), num_steps=500, num_particles=8),
    ):
        inference = pvi.PVI(logistic_model, family, partitions, update, pvi.Sequential())
        state = inference.run(random.PRNGKey(0), 4, X, y=y, progress_bar=False).state
        results.append(family.loc_scale(state.q))
    (loc_ng, scale_ng), (loc_gd, scale_gd) = results
    sd_ng, sd_gd = (np.sqrt(np.diag(s @ s.T)) if s.ndim == 2 else s for s in (scale_ng, scale_gd))
    # Both are stochastic fixed points of the same free energy: over seeds 0-4 their means differed
    # by at most 0.019 posterior sd and their sds by at most 2.2 % (mean field) / 4.4 % (full rank,
    # where Adam's noisy Cholesky factor is the larger error); twice that is the tolerance.
    assert np.max(np.abs(loc_ng - loc_gd) / sd_gd) < 0.04
    np.testing.assert_allclose(sd_ng, sd_gd, rtol=0.09)


@pytest.mark.parametrize(
    "family", [pvi.MeanFieldGaussian(), pvi.FullRankGaussian()], ids=["mean_field", "full_rank"]
)
def test_cvi_halves_steps_that_would_make_q_improper(family):
    X = random.normal(random.PRNGKey(0), (40, 2))
    y = (
        (X @ jnp.array([1.0, -0.5]) + 0.1 * random.normal(random.PRNGKey(1), (40,)))
        .at[:10]
        .set(30.0)
    )
    inference = pvi.PVI(
        robust_model,
        family,
        pvi.split_iid(random.PRNGKey(3), 40, 4),
        pvi.NaturalGradientUpdate(1.0, num_steps=3),
        pvi.Synchronous(1.0),
    )
    result = inference.run(random.PRNGKey(0), 5, X, y=y, progress_bar=False)
    # the outliers push the first steps out of the PD cone
    assert result.history.clamped[0].sum() > 0
    assert result.history.accepted.all() and bool(family.is_valid(result.state.q))
    assert np.isfinite(result.history.elbo).all()
    loc, _ = family.loc_scale(result.state.q)
    # The Cauchy likelihood ignores the 10 outliers: w is recovered to within 0.05 (its posterior sd
    # is ~0.03).
    np.testing.assert_allclose(loc, [1.0, -0.5], atol=0.05)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(step_size=0.0), "step_size"),
        (dict(step_size=1.5), "step_size"),
        (dict(num_steps=0), "num_steps"),
        (dict(num_particles=1), "num_particles"),
    ],
)
def test_natural_gradient_update_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pvi.NaturalGradientUpdate(**kwargs)


def poisson_model(X, y=None):
    """Poisson log-link regression with a wide intercept prior, N(0, 10^2) (issue 23, problem 3)."""
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(b + X @ w)), obs=y)


# NUTS (500 warm-up + 500 draws, one chain, seeds 0 and 1) on the data below, (b, w): the seeds'
# means differ by at most 0.1 sd, their sds by at most 8 %; seed 0 is stored. Command: the script in
# the commit that added this test (MCMC(NUTS(poisson_model), num_warmup=500,
# num_samples=500).run(PRNGKey(seed), X, y=y)).
POISSON_NUTS_MEAN = np.array([2.3898, 0.4588, -0.2919, 0.2144])
POISSON_NUTS_SD = np.array([0.0149, 0.0290, 0.0312, 0.0294])


# Issue 23, problem 3 (Synchronous(0.5)) and problem 1, second bullet
# (Synchronous(AdaptiveDamping())). Measured with this set-up and run(PRNGKey(0), 20, ..., tol=0.05)
# under AdaptiveDamping: at dce833c converged=True after 15 rounds, 1.7 NUTS sds off (b and w), no
# warning; now converged after 4 rounds, every mean within 0.04 sd.
@pytest.mark.parametrize(
    "server, tol",
    [(pvi.Synchronous(0.5), None), (pvi.Synchronous(pvi.AdaptiveDamping()), 0.05)],
    ids=["half", "adaptive"],
)
def test_cvi_from_a_wide_prior_on_a_poisson_log_link_reaches_nuts(server, tol):
    k1, k2 = random.split(random.PRNGKey(0))
    X = 0.5 * random.normal(k1, (400, 3))
    y = dist.Poisson(jnp.exp(2.4 + X @ jnp.array([0.5, -0.3, 0.2]))).sample(k2)
    family = pvi.FullRankGaussian()
    inference = pvi.PVI(
        poisson_model,
        family,
        pvi.split_iid(random.PRNGKey(4), 400, 4),
        pvi.NaturalGradientUpdate(step_size=0.5, num_steps=5),
        server,
        # one client's update compiled once for both servers (the vmap backend compiles the four
        # clients' batch into each server's group step); the same q to 4 digits
        backend="loop",
    )
    result = inference.run(random.PRNGKey(0), 6, X, y=y, progress_bar=False, tol=tol)
    assert tol is None or result.converged is True  # with tol: converged, and (below) right
    loc, scale_tril = family.loc_scale(result.state.q)
    sd = np.sqrt(np.diag(np.asarray(scale_tril @ scale_tril.T)))
    # Before: the first step's Bonnet/Price site (E_q[exp(b)] under b ~ N(0, 10^2)) collapsed q to b
    # = -1 with sds of 1e-4, an accepted step that raised the estimated F_m, and q stayed there
    # (nothing clamped, no warning). Now the Laplace site, which beats that step on F_m, is taken
    # (counted in clamped). Measured (seed 0): means within 0.05 NUTS sd, sds within 5 %; asserted
    # at the bar (0.25 sd, 25 %).
    assert np.max(np.abs(np.asarray(loc) - POISSON_NUTS_MEAN) / POISSON_NUTS_SD) < 0.25
    np.testing.assert_allclose(sd, POISSON_NUTS_SD, rtol=0.25)
    assert result.history.clamped[0].sum() > 0 and result.history.clamped[1:].sum() == 0


@jax.jit
def _gamma_sites(q, coefficients, keys, pairs=16):
    a, b, d, g, e = coefficients

    def f(theta, c):
        t = theta[0]
        return a * jnp.log(t) - (b + d * c) * t - g * t**2 + e * c

    def one(key):
        family = pvi.Gamma()
        theta = family.draw(q, key, pairs)
        c = random.normal(random.fold_in(key, 1), (theta.shape[0],))
        values, grads = jax.vmap(jax.value_and_grad(f))(theta, c)
        site = family.site_from_draws(q, theta, values, grads, jax.vmap(jax.hessian(f))(theta, c))
        return jnp.stack([site.eta1[0], site.eta2[0]])

    return jax.vmap(one)(keys)


def gamma_sites(q, coefficients, num_sites=200):
    """``num_sites`` Gamma sites of ``f(theta, c) = a log t - (b + d c) t - g t^2 + e c`` (``t =
    theta[0]``, ``(a, b, d, g, e) = coefficients``) from 32 draws each (16 antithetic pairs), ``c ~
    N(0, 1)`` (another block's draw). One compiled program serves every ``q`` and ``f`` (eagerly,
    each of its ~200 operations compiles one of its own; one per ``f``, each compiled again)."""
    keys = random.split(random.PRNGKey(0), num_sites)
    return np.asarray(_gamma_sites(q, jnp.asarray(coefficients, jnp.float32), keys))


def test_gamma_site_is_exact_where_conjugate_and_unbiased_otherwise():
    """The Gamma block's CVI site (pathwise, control variates): 200 sites of 32 draws each, c ~ N(0,
    1) standing for another block's draw. Measured (python: these calls, and
    ExponentialFamily.site_from_draws for the least-squares site that Gamma used before): sds (eta1,
    eta2) below."""
    family = pvi.Gamma()
    # as a Normal precision's q is
    concentrated = family.from_params(jnp.array([80.0]), jnp.array([40.0]))
    # Conjugate, the other block additive: exact (sds 6e-4, 3e-4; least squares: 97, 49 with a bias
    # of 8 and 4).
    got = gamma_sites(concentrated, [20.0, 25.0, 0.0, 0.0, 3.0])  # 20 log t - 25 t + 3 c
    np.testing.assert_allclose(got, np.broadcast_to([20.0, -25.0], got.shape), rtol=1e-3)
    # Conjugate, the other block in the coefficient (a Normal likelihood's precision t times a
    # residual sum of squares): sds 6.1, 3.1 against least squares' 129, 66. Asserted: the mean
    # within 3 se, sds below 10 and 5.
    got = gamma_sites(concentrated, [20.0, 25.0, 2.0, 0.0, 0.0])  # 20 log t - (25 + 2 c) t
    assert np.all(np.abs(got.mean(0) - [20.0, -25.0]) < 3 * got.std(0) / np.sqrt(len(got)))
    assert got.std(0)[0] < 10.0 and got.std(0)[1] < 5.0
    # Not conjugate: f = -t^2 under Gamma(4, 2), whose site F^-1 d E_q[f] / d eta is known in closed
    # form; unbiased (measured: 0.3 and 0.2 se off; least squares 1.4 and 1.9 se off, the O(1/S)
    # bias of a ratio estimator).
    q = family.from_params(jnp.array([4.0]), jnp.array([2.0]))

    def expected(nat):  # E_q[-t^2] = -(Var t + E[t]^2)
        mean, var = family.mean_var(family.to_params(nat))
        return -jnp.sum(var + mean**2)

    grad = jax.grad(expected)(q)
    fisher = jax.jacfwd(lambda v: family.mean_stats(family.to_params(NatParams(v[:1], v[1:]))))(
        jnp.concatenate([q.eta1, q.eta2])
    )
    exact = np.linalg.solve(fisher, np.concatenate([grad.eta1, grad.eta2]))
    got = gamma_sites(q, [0.0, 0.0, 0.0, 1.0, 0.0])  # -t^2
    assert np.all(np.abs(got.mean(0) - exact) < 3 * got.std(0) / np.sqrt(len(got))), (
        got.mean(0),
        exact,
    )


def test_cvi_normal_gamma_is_within_half_a_percent_of_mean_field_vb():
    """Issue 23, problem 7: the Gamma block's shape and rate were 1.8 % low at 1,000 draws (a bias:
    the least-squares site's noise along the collinear (log tau, tau) direction, filtered by the
    step's backtracking). Measured with the pathwise site (seeds 0-2, 10 rounds): shape and rate
    within 0.14-0.37 %; w's means within 0.01 sd."""
    X = random.normal(random.PRNGKey(4), (48, 2))
    y = X @ jnp.array([1.0, -0.5]) + 0.7 * random.normal(random.PRNGKey(5), (48,))
    mean, cov, a, b = normal_gamma_vb(X, y)
    family = pvi.SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})
    inference = pvi.PVI(
        normal_gamma_model,
        family,
        np.split(np.arange(48), [5, 14, 30]),
        pvi.NaturalGradientUpdate(1.0, num_particles=1000),
        pvi.Sequential(),
    )
    result = inference.run(random.PRNGKey(0), 10, X, y=y, progress_bar=False)
    w_block, tau_block = result.family.split(result.state.q)
    shape, rate = pvi.Gamma().to_params(tau_block)
    np.testing.assert_allclose([float(shape[0]), float(rate[0])], [a, b], rtol=0.005)
    w_mean, _ = pvi.FullRankGaussian().moments(w_block)
    np.testing.assert_allclose(w_mean, mean, atol=0.05 * np.sqrt(np.diag(cov)).min())


def negbin_model(X, y=None):
    """Negative-binomial log-link regression from wide priors (the sweep's "wide": N(0, 10^2),
    Gamma(1, 0.1))."""
    w = numpyro.sample("w", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    phi = numpyro.sample("phi", dist.Gamma(1.0, 0.1))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.NegativeBinomial2(jnp.exp(X @ w + b), phi), obs=y)


def negbin_data(n=1500):
    k1, k2, k3 = random.split(random.PRNGKey(5), 3)
    X = 0.5 * random.normal(k1, (n, 3))
    mean = jnp.exp(X @ jnp.array([0.6, -0.4, 0.3]) + 1.0)
    y = random.poisson(k3, random.gamma(k2, 3.0, mean.shape) * mean / 3.0).astype(jnp.float32)
    return X, y


# NUTS on negbin_data(): MCMC(NUTS(negbin_model), num_warmup=500, num_samples=1000).run(PRNGKey(2),
# X, y=y) (the script /tmp/cvi2/nb.py of the commit that added this test), (w, b, phi):
NEGBIN_NUTS_MEAN = np.array([0.5731, -0.3199, 0.2696, 1.0113, 3.0386])
NEGBIN_NUTS_SD = np.array([0.0424, 0.0443, 0.0418, 0.0214, 0.2395])


# 510 s on this shared 2-core machine (load 12; the Poisson test above took 103 s)
@pytest.mark.slow
def test_cvi_with_a_gamma_block_from_a_wide_prior_on_a_negbin_log_link_reaches_nuts():
    """Issue 23, build item 3: CVI with SiteFamilies({"phi": Gamma()}) from wide priors. Before,
    every step was clamped (the step's F_m estimate is -inf or far below the current one at the
    prior's sds of 10) and q stayed at the prior, flagged (measured: sds 10.0, 10 rounds, 120 steps
    clamped a round). Now the Laplace site of cavity * p(y_m | theta) (Newton in (w, b, log phi)) is
    taken on the first round and CVI refines it."""
    X, y = negbin_data()
    family = pvi.SiteFamilies({"phi": pvi.Gamma()})
    inference = pvi.PVI(
        negbin_model,
        family,
        pvi.split_iid(random.PRNGKey(3), X.shape[0], 4),
        pvi.NaturalGradientUpdate(step_size=0.5, num_steps=5, num_particles=32),
        pvi.Synchronous(),
    )
    result = inference.run(random.PRNGKey(0), 4, X, y=y, progress_bar=False)
    # the flat layout: the default block (w, b), then phi
    marginals = result.family.marginals(result.state.q)
    mean, sd = marginals.mean, np.sqrt(marginals.variance)
    assert np.max(np.abs(mean - NEGBIN_NUTS_MEAN) / NEGBIN_NUTS_SD) < 0.25, mean
    np.testing.assert_allclose(sd, NEGBIN_NUTS_SD, rtol=0.25)
    assert result.history.clamped[0].sum() > 0  # the Laplace site, counted


def test_laplace_site_of_a_gamma_block_is_the_conjugate_posterior():
    """A Poisson likelihood of a Gamma block's rate: the tilted cavity * p(y | lam) is Gamma(a0 +
    sum y, b0 + n), in log lam exactly a u - b exp(u), so its Laplace site is (sum y, -n); with a
    Gaussian block beside it whose likelihood is Gaussian, that block's site is that Gaussian's (the
    joint is a product, the mode exact)."""
    y = jnp.array([3.0, 0.0, 5.0, 2.0, 7.0])
    gamma = pvi.Gamma()
    cavity = gamma.from_params(jnp.array([1.0]), jnp.array([0.1]))
    # a start far from the mode (80 against 17 / 5.1)
    q = gamma.from_params(jnp.array([40.0]), jnp.array([0.5]))
    loglik = lambda lam: jnp.sum(y * jnp.log(lam[0]) - lam[0])  # noqa: E731
    # each site compiled as one program (eagerly, each of its operations compiles one of its own)
    site = jax.jit(lambda c, q: laplace_site(gamma, c, q, loglik, 20))(cavity, q)
    np.testing.assert_allclose(np.concatenate([site.eta1, site.eta2]), [17.0, -5.0], rtol=1e-4)
    # SiteFamilies: a Gaussian block w (likelihood N(w; 2, 0.5^2): site eta1 = 8, eta2 = -2) and the
    # Gamma block
    family = pvi.SiteFamilies({"lam": pvi.Gamma()}, default=pvi.FullRankGaussian()).with_layout(
        [(("w",), 1), (("lam",), 1)], {"w": (1,), "lam": ()}
    )
    gauss = pvi.FullRankGaussian()
    cavity = family.join([gauss.from_loc_scale(jnp.zeros(1), 10.0 * jnp.eye(1)), cavity])
    q = family.join([gauss.from_loc_scale(jnp.full(1, -20.0), 10.0 * jnp.eye(1)), q])
    loglik = lambda z: jnp.sum(y * jnp.log(z[1]) - z[1]) - 2.0 * (z[0] - 2.0) ** 2  # noqa: E731
    site = jax.jit(lambda c, q: laplace_site(family, c, q, loglik, 20))(cavity, q)
    w_site, lam_site = family.split(site)
    np.testing.assert_allclose(
        [float(w_site.eta1[0]), float(w_site.eta2[0, 0])], [8.0, -2.0], rtol=1e-4
    )
    np.testing.assert_allclose(
        np.concatenate([lam_site.eta1, lam_site.eta2]), [17.0, -5.0], rtol=1e-4
    )


def test_laplace_coordinates_of_every_exponential_family_round_trip():
    """Each family's Laplace members agree: laplace_start is the mode of laplace_log_density (zero
    gradient), laplace_precision its negative Hessian there, and from_laplace of the two is the
    member itself."""
    dirichlet = pvi.Dirichlet().with_layout(None, {"probs": (2, 3)})  # two simplices of three
    cases = [
        (pvi.Gamma(), (jnp.array([3.0, 0.5]), jnp.array([2.0, 4.0]))),
        (pvi.Beta(), (jnp.array([3.0, 1.5]), jnp.array([2.0, 4.0]))),
        (dirichlet, (jnp.array([3.0, 1.5, 2.0, 1.0, 2.0, 5.0]),)),
    ]
    for family, params in cases:
        # one compiled program per family (eagerly, each of its operations compiles one of its own)
        @jax.jit
        def coordinates(params, family=family):
            nat = family.from_params(*params)
            x = family.laplace_start(nat)
            log_density = lambda v: family.laplace_log_density(nat, v)[1]  # noqa: E731
            precision = family.laplace_precision(nat)
            got = family.to_params(family.from_laplace(x, precision))
            return jax.grad(log_density)(x), jax.hessian(log_density)(x), precision, got

        grad, hessian, precision, got = coordinates(params)
        np.testing.assert_allclose(grad, 0.0, atol=1e-5)
        np.testing.assert_allclose(-hessian, precision, atol=1e-4)
        np.testing.assert_allclose(np.concatenate(got), np.concatenate(params), rtol=1e-5)
