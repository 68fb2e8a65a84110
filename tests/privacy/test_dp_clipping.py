import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import random

import numpyro_pvi as pvi
from numpyro_pvi.privacy import clipping as dp_clipping

from models import normal_gamma_model, poisson_model, scale_model

# uneven clients: client 0 (60 rows) is padded to 140 rows; scale_model has two global sites (w,
# sigma)
PARTS = [np.arange(0, 60), np.arange(60, 160), np.arange(160, 300)]


def _setup(family, X, y):
    update = pvi.DPGradientUpdate(
        optax.adam(1e-2), num_steps=1, batch_size=50, clip_norm=1.0, noise_multiplier=0.0
    )
    problem = pvi.PVI(scale_model, family, PARTS, update, pvi.Sequential()).build(X, y=y)
    client = jax.tree.map(lambda a: a[0], problem.clients)
    cp = problem.client_problem
    loc = random.normal(random.PRNGKey(1), (cp.dim,))
    u = (
        0.3 * random.normal(random.PRNGKey(2), (cp.dim,))
        if isinstance(family, pvi.MeanFieldGaussian)
        else 0.3 * random.normal(random.PRNGKey(2), (cp.dim * (cp.dim + 1) // 2,))
    )
    assert not np.all(client.mask) and len(cp.sites.globals) == 2
    return cp, client, (loc, u)


@pytest.mark.parametrize("family", [pvi.MeanFieldGaussian(), pvi.FullRankGaussian()])
@pytest.mark.parametrize("num_draws", [1, 3])
def test_the_factorised_clipped_sum_equals_clipping_the_direct_per_row_gradients(
    linear_data, family, num_draws
):
    """``clipped_sum`` (per-row gradients in zeta, closed-form or pulled-back norms, one reweighted
    backward pass) against the direct computation: ``jax.vmap(jax.grad)`` of every row's data term
    in ``(loc, u)``, clipped row by row and summed over the chosen rows. Exact up to float32
    rounding."""
    X, y = linear_data
    cp, client, params = _setup(family, X, y)
    eps = random.normal(random.PRNGKey(3), (num_draws, cp.dim))
    chosen = client.mask & random.bernoulli(random.PRNGKey(4), 0.5, client.mask.shape)
    direct = dp_clipping.row_gradients(cp, params, eps, client)
    norms = np.sqrt(
        sum(np.sum(np.asarray(g, np.float64).reshape(g.shape[0], -1) ** 2, axis=1) for g in direct)
    )
    # about half the rows clipped; none
    for clip_norm in (0.5 * np.median(norms[np.asarray(client.mask)]), 1e9):
        factors = np.where(
            np.asarray(chosen), np.minimum(1.0, clip_norm / np.maximum(norms, 1e-30)), 0.0
        )
        expected = [np.tensordot(factors, np.asarray(g), axes=1) for g in direct]
        got = jax.jit(
            lambda p, c=clip_norm: dp_clipping.clipped_sum(cp, p, eps, client, chosen, c)
        )(params)
        for e, g in zip(expected, got):
            np.testing.assert_allclose(g, e, rtol=2e-4, atol=2e-4 * np.max(np.abs(e)))


@pytest.mark.parametrize("family", [pvi.MeanFieldGaussian(), pvi.FullRankGaussian()])
def test_row_norms_from_zeta_gradients_equal_the_direct_norms(linear_data, family):
    X, y = linear_data
    cp, client, params = _setup(family, X, y)
    eps = random.normal(random.PRNGKey(6), (2, cp.dim))
    got = dp_clipping.row_squared_norms(cp, params, eps, client)
    direct = dp_clipping.row_gradients(cp, params, eps, client)
    expected = sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in direct)
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    assert np.all(np.asarray(got)[~np.asarray(client.mask)] == 0)  # padded rows weigh nothing


# ---------------------------------------------------------------- the generic path (any
# FactorFamily) Normal-gamma regression (SiteFamilies: full-rank Gaussian w, Gamma tau) and
# Poisson-Gamma (Gamma alone): the guide's unconstrained param sites, draws by the guide's rsample
# at fixed per-draw keys, norms by jax.vjp.


def _generic_setup(model, family, q_of, data):
    update = pvi.DPGradientUpdate(
        optax.adam(1e-2), num_steps=1, batch_size=50, clip_norm=1.0, noise_multiplier=0.0
    )
    problem = pvi.PVI(model, family, GENERIC_PARTS, update, pvi.Sequential()).build(**data)
    cp = problem.client_problem
    client = jax.tree.map(lambda a: a[0], problem.clients)
    assert not np.all(client.mask)  # padded rows
    return cp, client, cp.family.reparameterised(cp.dim).init(q_of(family))


def _normal_gamma_q(family):
    return family.join(
        [
            pvi.FullRankGaussian().from_loc_scale(
                jnp.array([0.8, -0.3]), jnp.array([[0.3, 0.0], [0.1, 0.2]])
            ),
            pvi.Gamma().from_params(jnp.array([4.0]), jnp.array([3.0])),
        ]
    )


GENERIC_PARTS = [np.arange(0, 20), np.arange(20, 50)]  # client 0 (20 rows) is padded to 30


@pytest.fixture(scope="module", params=["site_families", "gamma"])
def generic(request):
    if request.param == "site_families":
        X = random.normal(random.PRNGKey(7), (50, 2))
        y = X @ jnp.array([1.0, -0.5]) + 0.7 * random.normal(random.PRNGKey(8), (50,))
        family = pvi.SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})
        return _generic_setup(normal_gamma_model, family, _normal_gamma_q, dict(X=X, y=y))
    y = random.poisson(random.PRNGKey(9), 3.0, (50,)).astype(jnp.float32)
    q_of = lambda family: family.from_params(jnp.array([5.0]), jnp.array([2.0]))  # noqa: E731
    return _generic_setup(poisson_model, pvi.Gamma(), q_of, dict(y=y))


def test_generic_row_norms_equal_the_direct_norms(generic):
    cp, client, params = generic
    eps = random.split(random.PRNGKey(10), 3)  # one key per draw
    got = jax.jit(lambda p: dp_clipping.row_squared_norms(cp, p, eps, client))(params)
    direct = jax.jit(lambda p: dp_clipping.row_gradients(cp, p, eps, client))(params)
    expected = sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree.leaves(direct))
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    assert np.all(np.asarray(got)[~np.asarray(client.mask)] == 0)  # padded rows weigh nothing
    assert np.all(np.asarray(got)[np.asarray(client.mask)] > 0)


def test_generic_clipped_sum_equals_clipping_the_direct_per_row_gradients(generic):
    cp, client, params = generic
    eps = random.split(random.PRNGKey(11), 2)
    chosen = client.mask & random.bernoulli(random.PRNGKey(12), 0.5, client.mask.shape)
    direct = jax.tree.leaves(
        jax.jit(lambda p: dp_clipping.row_gradients(cp, p, eps, client))(params)
    )
    norms = np.sqrt(
        sum(np.sum(np.asarray(g, np.float64).reshape(g.shape[0], -1) ** 2, axis=1) for g in direct)
    )
    # about half the rows clipped; none
    for clip_norm in (0.5 * np.median(norms[np.asarray(client.mask)]), 1e9):
        factors = np.where(
            np.asarray(chosen), np.minimum(1.0, clip_norm / np.maximum(norms, 1e-30)), 0.0
        )
        expected = [np.tensordot(factors, np.asarray(g), axes=1) for g in direct]
        got = jax.jit(
            lambda p, c=clip_norm: dp_clipping.clipped_sum(cp, p, eps, client, chosen, c)
        )(params)
        for e, g in zip(expected, jax.tree.leaves(got)):
            np.testing.assert_allclose(g, e, rtol=2e-4, atol=2e-4 * np.max(np.abs(e)))
