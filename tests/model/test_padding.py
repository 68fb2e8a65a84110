"""Padding is invisible: clients are padded (to their bucket's largest client) with copies of a real
row (masked), so a row argument the model uses as a scale never reaches it as 0; uneven clients give
exactly the answer."""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import enable_x64, random

import numpyro_pvi as pvi

# eight schools: effects and their standard errors; sigma is a row argument used as a scale
Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
PRIOR_SD = 10.0


def schools(sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SD))
    with pvi.partition_plate("schools", sigma.shape[0]):
        numpyro.sample("y", dist.Normal(mu, sigma), obs=y)


def exact_posterior():
    precision = 1 / PRIOR_SD**2 + np.sum(1 / SIGMA**2)
    return np.sum(Y / SIGMA**2) / precision, precision**-0.5


@pytest.mark.parametrize("sizes", [(3, 2, 3), (2, 3, 3)], ids=["small-middle", "small-first"])
def test_uneven_clients_with_a_row_scale_give_the_exact_posterior(sizes):
    with enable_x64(True):
        cuts = np.cumsum(sizes)[:-1]
        clients = pvi.ClientData(
            [
                ((jnp.asarray(s),), {"y": jnp.asarray(y)})
                for s, y in zip(np.split(SIGMA, cuts), np.split(Y, cuts))
            ]
        )
        # exact in one step: Gaussian likelihood
        update = pvi.NaturalGradientUpdate(step_size=1.0, num_particles=8)
        inference = pvi.PVI(schools, pvi.MeanFieldGaussian(), clients, update, pvi.Sequential())
        problem = inference.build()
        small = int(np.argmin(sizes))
        # sigma of the small client, padded to 3 rows
        padded = np.asarray(problem.clients.arrays[0][small])
        assert padded.shape == (3,) and np.all(padded > 0)  # copies of a real row, not zeros
        result = inference.run(random.PRNGKey(0), 1, problem, progress_bar=False)
        assert result.history.num_rejected.sum() == 0
        loc, scale = inference.family.loc_scale(result.state.q)
        mean, sd = exact_posterior()
        np.testing.assert_allclose([float(loc[0]), float(scale[0])], [mean, sd], rtol=1e-6)


# 2 rounds: enough to compare backends
@pytest.mark.filterwarnings("ignore:The run ended far from converged")
def test_a_skewed_split_is_bucketed_by_size_and_gives_the_loop_backends_q(linear_data):
    """One client of 200 rows and 20 of one row: the vmap backend stacks them in two buckets (200
    rows, 1 row) instead of 21 clients of 200 rows; the loop backend runs each client alone on the
    old padding to the largest. Both hand every client the same key, so q agrees to float64
    round-off (the only difference is the order of the masked sums over padded rows)."""
    from models import linear_model

    with enable_x64(True):
        X, y = (jnp.asarray(a, jnp.float64)[:220] for a in linear_data)
        parts = [np.arange(200)] + [np.array([200 + i]) for i in range(20)]
        update = pvi.GradientUpdate(optax.adam(0.05), num_steps=30, num_particles=2)
        qs = []
        for backend in ("vmap", "loop"):
            inference = pvi.PVI(
                linear_model,
                pvi.MeanFieldGaussian(),
                parts,
                update,
                pvi.Synchronous(0.5),
                backend=backend,
            )
            problem = inference.build(X, y=y)
            if backend == "vmap":
                assert [b.clients.mask.shape for b in problem.buckets] == [(20, 1), (1, 200)]
                np.testing.assert_array_equal(problem.buckets[1].ids, [0])
            else:
                assert [b.clients.mask.shape for b in problem.buckets] == [(21, 200)]
            result = inference.run(random.PRNGKey(0), 2, problem, progress_bar=False)
            assert result.history.accepted.all()
            qs.append(result.state.q)
        np.testing.assert_allclose(qs[0].eta1, qs[1].eta1, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(qs[0].eta2, qs[1].eta2, rtol=1e-9, atol=1e-12)
