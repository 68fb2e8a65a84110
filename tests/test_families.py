import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

import numpyro_pvi as pvi

FAMILIES = [pvi.MeanFieldGaussian(), pvi.FullRankGaussian()]


def random_loc_scale(family, key, dim=4):
    k1, k2 = jax.random.split(key)
    loc = jax.random.normal(k1, (dim,))
    if isinstance(family, pvi.FullRankGaussian):
        A = jax.random.normal(k2, (dim, dim))
        return loc, jnp.linalg.cholesky(A @ A.T + dim * jnp.eye(dim))
    return loc, jnp.exp(0.3 * jax.random.normal(k2, (dim,)))


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_natural_parameters_round_trip(family):
    with enable_x64(True):
        loc, scale = random_loc_scale(family, jax.random.PRNGKey(0))
        nat = family.from_loc_scale(loc, scale)
        loc2, scale2 = family.loc_scale(nat)
        np.testing.assert_allclose(loc2, loc, rtol=1e-10)
        np.testing.assert_allclose(scale2, scale, rtol=1e-10)
        d = family.to_dist(nat)
        np.testing.assert_allclose(d.mean, loc, rtol=1e-10)


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_product_and_quotient_are_sums_of_natural_parameters(family):
    with enable_x64(True):
        a = family.from_loc_scale(*random_loc_scale(family, jax.random.PRNGKey(1)))
        b = family.from_loc_scale(*random_loc_scale(family, jax.random.PRNGKey(2)))
        zeta = jnp.linspace(-1.0, 1.0, 4)
        # log N(z; a) + log N(z; b) - log N(z; a*b) is constant in z
        log_pdf = lambda nat, z: family.to_dist(nat).log_prob(z)  # noqa: E731
        gap = lambda z: log_pdf(a, z) + log_pdf(b, z) - log_pdf(a + b, z)  # noqa: E731
        assert float(gap(zeta)) == pytest.approx(float(gap(-2 * zeta)), rel=1e-10)
        cavity = (a + b) - b
        np.testing.assert_allclose(cavity.eta1, a.eta1, rtol=1e-10)
        np.testing.assert_allclose((0.5 * a).eta2, a.eta2 / 2)


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_validity_detects_non_positive_definite(family):
    q = family.from_loc_scale(*random_loc_scale(family, jax.random.PRNGKey(3)))
    assert bool(family.is_valid(q))
    assert not bool(family.is_valid(q - 2.0 * q))
    assert not bool(family.is_valid(q._replace(eta1=q.eta1.at[0].set(jnp.nan))))


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_site_update_of_a_gaussian_log_density_is_that_gaussian(family):
    """grad_mu E_q[log N(z; m, P^-1)] are the natural parameters of N(m, P^-1), whatever q is."""
    with enable_x64(True):
        target = family.from_loc_scale(*random_loc_scale(family, jax.random.PRNGKey(4)))
        loc, scale = random_loc_scale(family, jax.random.PRNGKey(5))
        half = jax.random.normal(jax.random.PRNGKey(6), (20000, 4))
        eps = jnp.concatenate([half, -half])
        zeta = loc + (eps * scale if scale.ndim == 1 else eps @ scale.T)
        grads = jax.vmap(jax.grad(family.to_dist(target).log_prob))(zeta)
        hess = family.stein_hessian(grads, eps, scale)
        got = family.site_update(grads.mean(0), hess, loc)
        np.testing.assert_allclose(got.eta2, target.eta2, atol=0.05 * np.abs(target.eta2).max())  # MC: ~1/sqrt(4e4)
        np.testing.assert_allclose(got.eta1, target.eta1, atol=0.05 * np.abs(target.eta1).max())
