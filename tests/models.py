"""Shared models of the tests, their data and their exact references (closed form or quadrature,
float64).

Tests import these directly (``from models import linear_model``); no test imports another test
module.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from numpyro.distributions import constraints
from scipy.optimize import minimize, minimize_scalar

import numpyro_pvi as pvi
from numpyro_pvi.families import NatParams

NOISE = 0.5  # known noise sd of the linear-regression model


def make_linear_data():
    """300 rows, 3 features, ``y = X (1, -0.5, 0.3) + N(0, NOISE^2)``: the ``linear_data``
    fixture."""
    X = random.normal(random.PRNGKey(0), (300, 3))
    y = X @ jnp.array([1.0, -0.5, 0.3]) + NOISE * random.normal(random.PRNGKey(1), (300,))
    return X, y


def make_logistic_data():
    """400 rows, 3 features, logits ``X (1.5, -1, 0.5) - 0.3``: the ``logistic_data`` fixture."""
    X = random.normal(random.PRNGKey(2), (400, 3))
    logits = X @ jnp.array([1.5, -1.0, 0.5]) - 0.3
    y = random.bernoulli(random.PRNGKey(3), jax.nn.sigmoid(logits)).astype(jnp.float32)
    return X, y


def make_heavy_tailed_data():
    """40 rows, 2 features, noise sd 0.1, and the first 10 responses replaced by 30: outliers for
    ``robust_model``."""
    X = random.normal(random.PRNGKey(0), (40, 2))
    y = (
        (X @ jnp.array([1.0, -0.5]) + 0.1 * random.normal(random.PRNGKey(1), (40,)))
        .at[:10]
        .set(30.0)
    )
    return X, y


def linear_model(X, y=None):
    """Bayesian linear regression with known noise: conjugate, so the exact posterior is known."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, NOISE), obs=y)


def logistic_model(X, y=None):
    """Bayesian logistic regression with an intercept."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def scale_model(X, y=None):
    """Linear regression with an unknown noise scale: a constrained global site with a non-Gaussian
    prior.

    "w" comes before "sigma" in the model, the reverse of sorted order: PVI's flat vector keeps
    model order.
    """
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def normal_gamma_model(X, y=None):
    """Linear regression with an unknown noise precision: w ~ N(0, 4 I), tau ~ Gamma(2, 1)
    (conjugate per block)."""
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
    tau = numpyro.sample("tau", dist.Gamma(2.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0 / jnp.sqrt(tau)), obs=y)


def normal_gamma_vb(X, y, iters=200):
    """Coordinate-ascent mean-field VB for w ~ N(0, 4 I), tau ~ Gamma(2, 1), y ~ N(X w, 1 / tau)."""
    X, y = np.asarray(X, np.float64), np.asarray(y, np.float64)
    a = 2.0 + 0.5 * len(y)
    e_tau = 1.0
    for _ in range(iters):
        cov = np.linalg.inv(e_tau * X.T @ X + np.eye(2) / 4.0)
        mean = cov @ (e_tau * X.T @ y)
        b = 1.0 + 0.5 * (np.sum((y - X @ mean) ** 2) + np.trace(X.T @ X @ cov))
        e_tau = a / b
    return mean, cov, a, b


def exact_linear_posterior(X, y):
    """Mean and covariance of w under linear_model (prior N(0, I), noise NOISE)."""
    X, y = np.asarray(X, np.float64), np.asarray(y, np.float64)
    precision = np.eye(X.shape[1]) + X.T @ X / NOISE**2
    cov = np.linalg.inv(precision)
    return cov @ X.T @ y / NOISE**2, cov


# ---- more models ----


def robust_model(X, y=None):
    """Cauchy-noise regression: not log-concave, so a full CVI step can make the site precision
    negative."""
    w = numpyro.sample("w", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.StudentT(1.0, X @ w, 0.1), obs=y)


def noise_model(X, y=None):
    """Bayesian linear regression whose noise scale is a learned hyperparameter."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def type_ii_ml_sigma(X, y):
    """The type-II maximum-likelihood noise scale of ``noise_model``, by a bounded scalar search
    (float64)."""
    X, y = (np.asarray(a, np.float64) for a in (X, y))
    n = X.shape[0]

    def nll(log_sigma):
        cov = X @ X.T + np.exp(2 * log_sigma) * np.eye(n)
        return 0.5 * (np.linalg.slogdet(cov)[1] + y @ np.linalg.solve(cov, y))

    return float(
        np.exp(minimize_scalar(nll, bounds=(-5, 2), method="bounded", options={"xatol": 1e-8}).x)
    )


# ---- conjugate exponential-family models (Gamma, Beta, Dirichlet factors) ----

CONCENTRATION = np.array([1.0, 2.0, 0.5, 3.0])  # the Dirichlet prior of categorical_model


def poisson_model(y=None):
    rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
    with pvi.partition_plate("data", y.shape[0]):
        numpyro.sample("y", dist.Poisson(rate), obs=y)


def bernoulli_model(y=None):
    p = numpyro.sample("p", dist.Beta(2.0, 3.0))
    with pvi.partition_plate("data", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(p), obs=y)


def categorical_model(y=None):
    probs = numpyro.sample("probs", dist.Dirichlet(jnp.asarray(CONCENTRATION)))
    with pvi.partition_plate("data", y.shape[0]):
        numpyro.sample("y", dist.Categorical(probs), obs=y)


# ---- EP on the families beyond one Gaussian: data, runs and exact references (test_snep_blocks and
# test_site_moment_matching) ----

EP_SIZES = [9, 10, 12, 14, 16]  # five uneven clients (one vmap bucket: one compiled shape)
EP_N = sum(EP_SIZES)
EP_PARTS = np.split(np.arange(EP_N), np.cumsum(EP_SIZES)[:-1])


def categorical_data():
    return random.categorical(
        random.PRNGKey(0), jnp.log(jnp.array([0.1, 0.2, 0.3, 0.4])), shape=(EP_N,)
    )


def normal_gamma_data():
    X = random.normal(random.PRNGKey(4), (EP_N, 2))
    return X, X @ jnp.array([1.0, -0.5]) + 0.7 * random.normal(random.PRNGKey(5), (EP_N,))


def dirichlet_errors(q, y):
    """Max over categories of ``|mean error| / sd`` and ``|sd ratio - 1|`` against the exact
    posterior."""
    exact = pvi.Dirichlet().marginals(
        pvi.Dirichlet().from_params(
            jnp.asarray(CONCENTRATION + np.bincount(np.asarray(y), minlength=4), jnp.float32)
        )
    )
    marginals = pvi.Dirichlet().marginals(q)
    sd = np.sqrt(exact.variance)
    return (
        float(np.max(np.abs(marginals.mean - exact.mean) / sd)),
        float(np.max(np.abs(np.sqrt(marginals.variance) / sd - 1.0))),
    )


def normal_gamma_ep(X, y, grid=20000):
    """EP's fixed point with one client: the exact posterior's moments of ``w`` and ``E[tau]``,
    ``E[log tau]``.

    ``p(tau | y) ∝ Gamma(tau; 2, 1) N(y; 0, I / tau + 4 X X^T)`` on a grid (float64), and ``w | tau,
    y`` is Gaussian.
    """
    X, y = np.asarray(X, np.float64), np.asarray(y, np.float64)
    tau = np.linspace(1e-3, 12.0, grid)
    # X X^T = u diag(s^2) u^T; the rest of C is I / tau
    u, s, _ = np.linalg.svd(X, full_matrices=False)
    proj, rest = u.T @ y, y @ y - np.sum((u.T @ y) ** 2)
    var = 1.0 / tau[:, None] + 4.0 * s**2
    log_post = (np.log(tau) - tau) - 0.5 * (
        np.sum(np.log(var), 1)
        + (len(y) - len(s)) * np.log(1.0 / tau)
        + np.sum(proj**2 / var, 1)
        + tau * rest
    )
    weights = np.exp(log_post - log_post.max())
    weights /= weights.sum()
    precision = tau[:, None, None] * (X.T @ X) + np.eye(2) / 4.0
    cov = np.linalg.inv(precision)
    means = np.einsum("gij,gj->gi", cov, tau[:, None] * (X.T @ y))
    mean = weights @ means
    second = np.einsum("g,gij->ij", weights, cov + np.einsum("gi,gj->gij", means, means))
    return mean, second - np.outer(mean, mean), weights @ tau, weights @ np.log(tau)


def ng_errors(family, q, reference):
    """Errors of ``SiteFamilies({"w": FullRankGaussian(), "tau": Gamma()})``'s ``q`` against EP's
    fixed point: ``w``'s mean (in sds) and sds (relative), and the Gamma's mean and sd (relative to
    the moment-matched Gamma's)."""
    mean, cov, e_tau, e_log_tau = reference
    w_block, tau_block = family.split(q)
    w_mean, w_cov = pvi.FullRankGaussian().moments(w_block)
    sd = np.sqrt(np.diag(cov))
    matched = pvi.Gamma().from_mean_params(
        NatParams(jnp.array([e_log_tau], jnp.float32), jnp.array([e_tau], jnp.float32)), tau_block
    )
    exact, got = pvi.Gamma().marginals(matched), pvi.Gamma().marginals(tau_block)
    return (
        float(np.max(np.abs(np.asarray(w_mean) - mean) / sd)),
        float(np.max(np.abs(np.sqrt(np.diag(np.asarray(w_cov))) / sd - 1.0))),
        abs(float(got.mean[0] / exact.mean[0]) - 1.0),
        abs(float(np.sqrt(got.variance[0] / exact.variance[0])) - 1.0),
    )


def poisson_data():
    return random.poisson(random.PRNGKey(0), 3.0, (EP_N,)).astype(jnp.float32)


def gamma_errors(q, y, prior=(2.0, 0.5)):
    """``(|mean error| / sd, |sd ratio - 1|)`` of a Gamma ``q`` against the exact posterior of
    ``poisson_model``."""
    a, b = prior[0] + float(np.sum(y)), prior[1] + len(y)
    marginals = pvi.Gamma().marginals(q)
    sd = np.sqrt(a) / b
    return abs(float(marginals.mean[0]) - a / b) / sd, abs(
        float(np.sqrt(marginals.variance[0])) / sd - 1.0
    )


def poisson_pvi(server, backend="vmap", update=None):
    return pvi.PVI(
        poisson_model,
        pvi.Gamma(),
        partitions=EP_PARTS,
        server=server,
        backend=backend,
        local_update=update or pvi.SNEPUpdate(),
    )


def categorical_pvi(update=None):
    return pvi.PVI(
        categorical_model,
        pvi.Dirichlet(),
        partitions=EP_PARTS,
        server=pvi.Synchronous(1.0),
        local_update=update or pvi.SNEPUpdate(),
    )


def normal_gamma_pvi(update=None):
    family = pvi.SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})
    return pvi.PVI(
        normal_gamma_model,
        family,
        partitions=[np.arange(EP_N)],
        server=pvi.Sequential(),
        local_update=update or pvi.SNEPUpdate(),
    )


# intercept_model's groups, rows each, noise sd
INTERCEPT_GROUPS, INTERCEPT_PER_GROUP, INTERCEPT_NOISE = 12, 4, 1.0


def intercept_model(x, y=None):
    """y[g, i] = b + u[g] + w x[g, i] + noise: the group intercepts u are local to the client
    holding the group."""
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    w = numpyro.sample("w", dist.Normal(0.0, 2.0))
    with pvi.partition_plate("groups", x.shape[0]):
        u = numpyro.sample("u", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(b + u[:, None] + w * x, INTERCEPT_NOISE).to_event(1), obs=y)


def make_intercept_data():
    """``INTERCEPT_GROUPS`` groups of ``INTERCEPT_PER_GROUP`` rows: ``y = 0.5 + u[g] + 1.2 x +
    noise``, ``u[g] ~ N(0, 1)`` (the ``data`` of test_local_latents)."""
    x = random.normal(random.PRNGKey(0), (INTERCEPT_GROUPS, INTERCEPT_PER_GROUP))
    u = random.normal(random.PRNGKey(1), (INTERCEPT_GROUPS,))
    noise = INTERCEPT_NOISE * random.normal(
        random.PRNGKey(2), (INTERCEPT_GROUPS, INTERCEPT_PER_GROUP)
    )
    return x, 0.5 + u[:, None] + 1.2 * x + noise


def make_skewed_logistic_data():
    """A small, skewed logistic regression (N = 60, d = 2 + intercept), where the posterior is
    visibly non-Gaussian: for ``logistic_model``."""
    X = random.normal(random.PRNGKey(10), (60, 2))
    y = random.bernoulli(
        random.PRNGKey(11), jax.nn.sigmoid(X @ jnp.array([2.0, -1.5]) + 0.5)
    ).astype(jnp.float32)
    return X, y


NB_PHI = 2.25  # the negative-binomial dispersion, where it is fixed


def nb_model(X, y=None, phi=None):
    """Negative-binomial regression, log link, a wide intercept prior ``Normal(0, 10)``; ``phi`` a
    global site (``HalfNormal(10)``) unless given."""
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    if phi is None:
        phi = numpyro.sample("phi", dist.HalfNormal(10.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.NegativeBinomial2(jnp.exp(b + X @ w), phi), obs=y)


def nb_fixed_model(X, y=None):
    """``nb_model`` with the dispersion known (``NB_PHI``)."""
    nb_model(X, y, NB_PHI)


def make_nb_data():
    """2000 rows, 3 covariates: true mean ``exp(2 + x.(0.5, -0.3, 0.2))``, dispersion ``NB_PHI``."""
    k1, k2 = random.split(random.PRNGKey(1))
    X = random.normal(k1, (2000, 3))
    y = dist.NegativeBinomial2(jnp.exp(2.0 + X @ jnp.array([0.5, -0.3, 0.2])), NB_PHI).sample(k2)
    return X, y


# ---------------------------------------------------------------------- SiteFamilies' models
UNEVEN_N = 48  # rows of the SiteFamilies tests' regressions
UNEVEN_PARTS = np.split(np.arange(UNEVEN_N), [5, 14, 30])  # four uneven clients


def intercept_regression_model(X, y=None):
    """Linear regression with weights ``w`` (2,), an intercept ``b`` and known noise ``NOISE``
    (tests/families/test_site_families.py; benchmarks/adaptive_damping_tolerance.py)."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + b, NOISE), obs=y)


def make_intercept_regression_data():
    """``UNEVEN_N`` rows of shifted features (``w`` and ``b`` are correlated a posteriori)."""
    X = 0.3 + random.normal(random.PRNGKey(0), (UNEVEN_N, 2))
    y = X @ jnp.array([1.0, -0.5]) + 0.3 + NOISE * random.normal(random.PRNGKey(1), (UNEVEN_N,))
    return X, y


def intercept_regression_posterior(X, y):
    """``(precision, mean)`` of ``intercept_regression_model``'s exact posterior over ``(w, b)``,
    float64."""
    A = np.concatenate([np.asarray(X, np.float64), np.ones((len(y), 1))], axis=1)
    precision = A.T @ A / NOISE**2 + np.diag([1.0, 1.0, 0.25])
    return precision, np.linalg.solve(precision, A.T @ np.asarray(y, np.float64) / NOISE**2)


def halfnormal_scale_model(X, y=None):
    """Linear regression whose noise scale has a ``HalfNormal(1)`` prior."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def make_three_linear_sites():
    """30 rows of the linear data (2 columns) split iid over 3 sites of 10 rows (so an in-process
    run's clients are not padded, draw for draw with Flower's sites): each site's ``((X,), {"y":
    y})`` (tests/flower/)."""
    X, y = make_linear_data()
    parts = pvi.split_iid(random.PRNGKey(1), 30, 3)
    return [((np.asarray(X[:30, :2][p]),), {"y": np.asarray(y[:30][p])}) for p in parts]


def halfnormal_offset_model(X, y=None):
    """``halfnormal_scale_model`` with a learned offset (a ``numpyro.param`` hyperparameter): a
    non-Gaussian prior and a hyperparameter in one model (tests/flower/test_flower.py)."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    offset = numpyro.param("offset", 0.0)
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + offset, sigma), obs=y)


def block_diagonal_vi_optimum(X, y):
    """The optimum of the ELBO over q(w) = N(m, S) (full rank) times q(log sigma) = N(mu, s^2), in
    closed form.

    Every expectation is analytic (``E[sigma^-2] = exp(-2 mu + 2 s^2)``, ``E[sigma^2] = exp(2 mu + 2
    s^2)``), q(w) is optimal in closed form given q(log sigma), and the remaining 2-d ELBO is
    maximised by Nelder-Mead in float64.
    """
    X, y = np.asarray(X, np.float64), np.asarray(y, np.float64)

    def w_given(mu, s):
        inv_var = np.exp(-2 * mu + 2 * s**2)
        cov = np.linalg.inv(inv_var * X.T @ X + np.eye(2))
        return cov @ (inv_var * X.T @ y), cov

    def negative_elbo(params):
        mu, s = params[0], np.exp(params[1])
        m, cov = w_given(mu, s)
        inv_var = np.exp(-2 * mu + 2 * s**2)
        likelihood = -len(y) * mu - 0.5 * inv_var * (
            np.sum((y - X @ m) ** 2) + np.trace(X @ cov @ X.T)
        )
        # HalfNormal(1) in log space
        prior = -0.5 * (m @ m + np.trace(cov)) - 0.5 * np.exp(2 * mu + 2 * s**2) + mu
        entropy = 0.5 * np.linalg.slogdet(cov)[1] + np.log(s)
        return -(likelihood + prior + entropy)

    opt = minimize(
        negative_elbo,
        np.array([-0.5, np.log(0.1)]),
        method="Nelder-Mead",
        options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 5000},
    )
    m, cov = w_given(opt.x[0], np.exp(opt.x[1]))
    return m, cov, opt.x[0], np.exp(opt.x[1])


# ---------------------------------------------------------------------- the Flower set-up
FLOWER_SITES, FLOWER_GROUPS = 4, 3  # Flower sites, intercept_model's groups per site


def make_flower_data():
    """``(x, y, parts)``: ``FLOWER_SITES * FLOWER_GROUPS`` groups of 4 rows for
    ``intercept_model`` (``y = 0.5 + u[g] + 1.2 x + N(0, 1)``) and their iid split over the
    ``FLOWER_SITES`` sites (tests/flower/test_flower.py, benchmarks/flower.py)."""
    groups = FLOWER_SITES * FLOWER_GROUPS
    kx, ku, ky = random.split(random.PRNGKey(0), 3)
    x = random.normal(kx, (groups, 4))
    u = random.normal(ku, (groups,))
    y = 0.5 + u[:, None] + 1.2 * x + random.normal(ky, x.shape)
    return x, y, pvi.split_iid(random.PRNGKey(1), groups, FLOWER_SITES)
