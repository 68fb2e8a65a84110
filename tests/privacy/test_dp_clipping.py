from typing import NamedTuple

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


class Computed(NamedTuple):
    """One setup's direct and factorised results: the direct per-row gradients (float64 norms),
    the two clip norms (about half the rows clipped; none), the chosen rows, and what
    ``row_squared_norms`` and ``clipped_sum`` (at each clip norm) return."""

    direct: list
    norms: np.ndarray
    clip_norms: np.ndarray
    chosen: np.ndarray
    got_norms: np.ndarray
    got_sums: list


def _compute(cp, client, params, eps, chosen):
    """:class:`Computed` in two programs: the direct per-row gradients (the reference), then
    ``row_squared_norms`` and ``clipped_sum`` (one program, run at each clip norm; not op by op)."""
    direct = jax.jit(lambda p, e: dp_clipping.row_gradients(cp, p, e, client))(params, eps)
    direct = [np.asarray(g, np.float64) for g in jax.tree.leaves(direct)]
    norms = np.sqrt(sum(np.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in direct))
    clip_norms = np.array([0.5 * np.median(norms[np.asarray(client.mask)]), 1e9], np.float32)

    @jax.jit
    def factorised(params, eps, chosen, clip_norm):
        return dp_clipping.row_squared_norms(cp, params, eps, client), dp_clipping.clipped_sum(
            cp, params, eps, client, chosen, clip_norm
        )

    got_norms, got_sums = factorised(params, eps, chosen, clip_norms[0])
    got_sums = [got_sums, factorised(params, eps, chosen, clip_norms[1])[1]]
    return Computed(direct, norms, clip_norms, np.asarray(chosen), np.asarray(got_norms), got_sums)


def _check_clipped_sums(computed):
    """Each clip norm's ``clipped_sum`` against clipping the direct gradients row by row and summing
    the chosen rows (exact up to float32 rounding)."""
    for clip_norm, got in zip(computed.clip_norms, computed.got_sums):
        factors = np.where(
            computed.chosen,
            np.minimum(1.0, float(clip_norm) / np.maximum(computed.norms, 1e-30)),
            0.0,
        )
        expected = [np.tensordot(factors, g, axes=1) for g in computed.direct]
        for e, g in zip(expected, jax.tree.leaves(got)):
            np.testing.assert_allclose(g, e, rtol=2e-4, atol=2e-4 * np.max(np.abs(e)))


@pytest.fixture(scope="module")
def gaussian(linear_data):
    """``(family, num_draws) -> (client, Computed)`` on the linear data, at ``num_draws`` standard
    normal draws; each computed once for the module's tests."""
    built = {}

    def compute(family, num_draws):
        name = type(family).__name__
        if name not in built:
            built[name] = _setup(family, *linear_data)
        if (name, num_draws) not in built:
            cp, client, params = built[name]
            eps = random.normal(random.PRNGKey(3), (num_draws, cp.dim))
            chosen = client.mask & random.bernoulli(random.PRNGKey(4), 0.5, client.mask.shape)
            built[name, num_draws] = client, _compute(cp, client, params, eps, chosen)
        return built[name, num_draws]

    return compute


@pytest.mark.parametrize("family", [pvi.MeanFieldGaussian(), pvi.FullRankGaussian()])
@pytest.mark.parametrize("num_draws", [1, 3])
def test_the_factorised_clipped_sum_equals_clipping_the_direct_per_row_gradients(
    gaussian, family, num_draws
):
    """``clipped_sum`` (per-row gradients in zeta, closed-form or pulled-back norms, one reweighted
    backward pass) against the direct computation: ``jax.vmap(jax.grad)`` of every row's data term
    in ``(loc, u)``, clipped row by row and summed over the chosen rows. Exact up to float32
    rounding."""
    _check_clipped_sums(gaussian(family, num_draws)[1])


@pytest.mark.parametrize("family", [pvi.MeanFieldGaussian(), pvi.FullRankGaussian()])
def test_row_norms_from_zeta_gradients_equal_the_direct_norms(gaussian, family):
    client, computed = gaussian(family, 3)  # the draws of the test above
    np.testing.assert_allclose(computed.got_norms, computed.norms**2, rtol=1e-4)
    # padded rows weigh nothing
    assert np.all(computed.got_norms[~np.asarray(client.mask)] == 0)


# ---------------------------------------------------------------- the generic path (any
# FactorFamily) Normal-gamma regression (SiteFamilies: full-rank Gaussian w, Gamma tau) and
# Poisson-Gamma (Gamma alone): the guide's unconstrained param sites, draws by the guide's rsample
# at fixed per-draw keys, norms by jax.vjp.


def _generic_setup(model, family, q_of, data):
    """Client 0 and its :class:`Computed` at the guide's params of ``q_of(family)`` and three draws'
    keys."""
    update = pvi.DPGradientUpdate(
        optax.adam(1e-2), num_steps=1, batch_size=50, clip_norm=1.0, noise_multiplier=0.0
    )
    problem = pvi.PVI(model, family, GENERIC_PARTS, update, pvi.Sequential()).build(**data)
    cp = problem.client_problem
    client = jax.tree.map(lambda a: a[0], problem.clients)
    assert not np.all(client.mask)  # padded rows
    params = cp.family.reparameterised(cp.dim).init(q_of(family))
    eps = random.split(random.PRNGKey(10), 3)  # one key per draw
    chosen = client.mask & random.bernoulli(random.PRNGKey(12), 0.5, client.mask.shape)
    return client, _compute(cp, client, params, eps, chosen)


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
    client, computed = generic
    got, mask = computed.got_norms, np.asarray(client.mask)
    np.testing.assert_allclose(got, computed.norms**2, rtol=1e-4)
    assert np.all(got[~mask] == 0)  # padded rows weigh nothing
    assert np.all(got[mask] > 0)


def test_generic_clipped_sum_equals_clipping_the_direct_per_row_gradients(generic):
    _check_clipped_sums(generic[1])
