"""Bad input is a clear error naming the site, client or argument, raised before anything
compiles."""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_pvi as pvi
from numpyro_pvi.model import problem as problems

from models import linear_model, logistic_model, poisson_model

UPDATE = pvi.GradientUpdate(optax.adam(1e-2), num_steps=5)


def pvi_for(model, partitions=None, update=UPDATE):
    return pvi.PVI(model, pvi.MeanFieldGaussian(), partitions, update, pvi.Sequential())


def test_observations_that_broadcast_against_the_batch(linear_data):
    X, y = linear_data
    with pytest.raises(
        ValueError,
        match=r"Observed site 'y' has 90000 likelihood terms for 300 "
        r"rows.*\(n, 1\)",
    ):
        # (n, 1) under a plate of n: an (n, n) likelihood
        pvi_for(linear_model).build(X, y=y[:, None])


def test_every_path_that_takes_a_client_refuses_y_of_shape_n_by_1(linear_data):
    # before the shared check, a later client's y of shape (n, 1) was accepted (add_client: q's mean
    # -0.02 against the exact 1.06); only the data the model is read on (pooled, client 0's) was
    # checked
    X, y = linear_data
    first, second = ((X[:100],), {"y": y[:100]}), ((X[100:160],), {"y": y[100:160, None]})
    message = r"Client 1's data does not fit the model: its row argument 'y' has shape \(60, 1\)"
    with pytest.raises(ValueError, match=message):
        pvi_for(linear_model, pvi.ClientData([first, second])).build()
    start = pvi.PVI(
        linear_model, pvi.MeanFieldGaussian(), pvi.ClientData([first]), UPDATE, pvi.Continual()
    )
    problem = start.build()
    with pytest.raises(ValueError, match=message):
        start.add_client(start.init(random.PRNGKey(0), problem), problem, *second[0], **second[1])
    # a Flower site reads the model on its own data
    with pytest.raises(ValueError, match=r"\(n, 1\)"):
        pvi_for(linear_model).build(*second[0], **second[1])


def test_nested_partition_plates():
    def model(y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with pvi.partition_plate("data", y.shape[0]):
            with pvi.partition_plate("data", y.shape[0]):
                numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    with pytest.raises(ValueError, match="'y' is inside partition plate 'data' more than once"):
        pvi_for(model).build(y=jnp.zeros(5))


def test_a_plate_inside_the_partition_plate_is_exact_and_a_second_partition_plate_is_named():
    # each row of the partition plate holds K observations under an inner numpyro.plate: the
    # likelihood counts all n * K of them, so one round of CVI (step 1, exact on a Gaussian
    # likelihood) gives the exact posterior
    n, k = 40, 5
    y = 1.0 + random.normal(random.PRNGKey(1), (n, k))

    def inner_plate(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with pvi.partition_plate("data", y.shape[0], dim=-2):
            with numpyro.plate("inner", y.shape[1], dim=-1):
                numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    def two_partition_plates(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with pvi.partition_plate("data", y.shape[0], dim=-2):
            with pvi.partition_plate("columns", y.shape[1], dim=-1):
                numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    parts = [np.arange(0, 5), np.arange(5, 12), np.arange(12, 40)]  # uneven: padded rows are masked
    update = pvi.NaturalGradientUpdate(step_size=1.0, num_steps=1, num_particles=16)
    result = pvi.PVI(inner_plate, pvi.MeanFieldGaussian(), parts, update, pvi.Sequential()).run(
        random.PRNGKey(0), 1, y=y, progress_bar=False
    )
    loc, scale = pvi.MeanFieldGaussian().loc_scale(result.state.q)
    precision = 1.0 + n * k  # N(0, 1) prior, n * k unit-variance observations
    np.testing.assert_allclose(loc, [float(y.sum()) / precision], rtol=1e-5)
    np.testing.assert_allclose(scale, [precision**-0.5], rtol=1e-5)
    with pytest.raises(
        ValueError, match="partition_plate 'data' holds another partition_plate, 'columns'"
    ):
        pvi.PVI(
            two_partition_plates, pvi.MeanFieldGaussian(), parts, update, pvi.Sequential()
        ).build(y=y)


@pytest.mark.parametrize("client", [0, 2])
def test_non_finite_observations_name_the_client_and_site(linear_data, client):
    X, y = linear_data
    parts = np.array_split(np.arange(300), 3)
    ys = [np.asarray(y[p]).copy() for p in parts]
    ys[client][3] = np.nan
    clients = pvi.ClientData([((X[p],), {"y": ys[m]}) for m, p in enumerate(parts)])
    with pytest.raises(
        ValueError, match=f"Client {client}'s data: observed site 'y' holds NaN or inf"
    ):
        pvi_for(linear_model, clients).build()
    if client > 0:  # a client that joins later is checked the same way
        start = pvi.PVI(
            linear_model,
            pvi.MeanFieldGaussian(),
            pvi.ClientData(clients[:client]),
            UPDATE,
            pvi.Continual(),
        )
        problem = start.build()
        with pytest.raises(
            ValueError, match=f"Client {client}'s data: observed site 'y' holds NaN or inf"
        ):
            start.add_client(
                start.init(random.PRNGKey(0), problem),
                problem,
                *clients[client][0],
                **clients[client][1],
            )
    pooled = np.concatenate(ys)
    with pytest.raises(ValueError, match="The pooled data: observed site 'y' holds NaN or inf"):
        pvi_for(linear_model, parts).build(X, y=jnp.asarray(pooled))


@pytest.mark.parametrize("labels", [(0.0, 2.0), (-1.0, 1.0)], ids=["0-2", "plus-minus-1"])
def test_observations_outside_the_support(logistic_data, labels):
    X, y = logistic_data
    bad = jnp.where(y > 0, labels[1], labels[0])
    with pytest.raises(
        ValueError,
        match=r"observed site 'y' has values outside the support "
        r".*Bernoulli labels",
    ):
        pvi_for(logistic_model, pvi.split_iid(random.PRNGKey(0), 400, 4)).build(X, y=bad)
    parts = np.array_split(np.arange(400), 2)
    clients = pvi.ClientData(
        [((X[p],), {"y": (y if m == 0 else bad)[p]}) for m, p in enumerate(parts)]
    )
    with pytest.raises(
        ValueError, match="Client 1's data: observed site 'y' has values outside the support"
    ):
        pvi_for(logistic_model, clients).build()


def test_an_improper_prior_is_named():
    def model(y=None):
        mu = numpyro.sample("mu", dist.ImproperUniform(dist.constraints.real, (), ()))
        with pvi.partition_plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    with pytest.raises(ValueError, match="Global site 'mu' has an improper prior"):
        pvi_for(model).build(y=jnp.zeros(5))


def test_a_client_missing_an_observation(linear_data):
    X, y = linear_data
    clients = pvi.ClientData([((X[:10],), {"y": y[:10]}), ((X[10:20],), {"y": None})])
    with pytest.raises(
        ValueError, match="client 1's arguments have structure .*missing observation"
    ):
        pvi_for(linear_model, clients).build()


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="num_particles must be a positive integer, got 0"):
        pvi.GradientUpdate(optax.adam(1e-2), num_steps=5, num_particles=0)
    with pytest.raises(TypeError, match="optimizer must be an optax.GradientTransformation"):
        pvi.GradientUpdate(lambda g: g, num_steps=5)
    pvi.GradientUpdate(numpyro.optim.Adam(1e-2), num_steps=5)  # numpyro's optimisers are accepted
    with pytest.raises(TypeError, match="hyper_optimizer must be an optax.GradientTransformation"):
        pvi.PVI(linear_model, pvi.MeanFieldGaussian(), None, UPDATE, hyper_optimizer="adam")
    with pytest.raises(ValueError, match="num_elbo_particles must be a positive integer"):
        pvi.PVI(linear_model, pvi.MeanFieldGaussian(), None, UPDATE, num_elbo_particles=0)


def test_a_state_too_large_for_memory_is_named_before_anything_compiles(monkeypatch):
    # before: a FullRankGaussian at D = 20,000 died in XLA with a raw out-of-memory error
    def wide_model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with pvi.partition_plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled before the memory check")

    # the same figure on every machine
    monkeypatch.setattr(problems, "available_memory", lambda: 8 * 10**9)
    monkeypatch.setattr(problems, "compile_steps", no_compiling)
    X, y = jnp.zeros((8, 20_000)), jnp.zeros(8)
    # 6 factors (4 clients, q, the prior's) of 20,000 x 20,001 float32, twice: 19.2 GB
    with pytest.raises(
        MemoryError,
        match=r"D = 20000 coordinates with 4 client factors needs at "
        r"least 19.20 GB "
        r".*only 8.00 GB are available",
    ):
        pvi.PVI(wide_model, pvi.FullRankGaussian(), np.array_split(np.arange(8), 4), UPDATE).build(
            X, y=y
        )
    # 1.9 MB: it fits
    assert problems.state_bytes(pvi.MeanFieldGaussian(), 20_000, 4) == 2 * 6 * 2 * 20_000 * 4


@pytest.mark.parametrize("site_variance", [1.0, (1.0,), (2.0, 1.0), ("a", 1.0), (0.0, 1.0)])
def test_snep_site_variance_must_be_an_interval(site_variance):
    # before: site_variance=1.0 raised a bare "TypeError: object of type 'float' has no len()"
    with pytest.raises(
        ValueError,
        match=r"SNEPUpdate: site_variance must be None or a pair "
        r"\(v_min, v_max\)",
    ):
        pvi.SNEPUpdate(site_variance=site_variance)
    assert pvi.SNEPUpdate(site_variance=[0.1, 10]).site_variance == (0.1, 10)


@pytest.mark.parametrize("num_rounds", [0, -1, 2.5, "3"])
def test_num_rounds_must_be_a_positive_integer(linear_data, num_rounds):
    X, y = linear_data
    with pytest.raises(ValueError, match="num_rounds must be a positive integer"):
        pvi_for(linear_model).run(random.PRNGKey(0), num_rounds, X, y=y)


class _UndeclaredUpdate:
    """``init_state`` and ``bind`` but none of ``LocalUpdate``'s ``supports_*`` attributes (neither
    set nor inherited)."""

    def init_state(self, problem):
        return ()

    def bind(self, problem):
        raise AssertionError("not reached: PVI refuses the update first")


class _DeclaresNothing(_UndeclaredUpdate, pvi.local_updates.LocalUpdate):
    """The same update as a ``LocalUpdate`` subclass: it inherits the defaults (all false)."""


def test_what_an_update_supports_is_declared_not_guessed():
    # on main an update without the attributes was accepted (each read as False by getattr); now
    # the attributes are LocalUpdate's contract: without them it is no LocalUpdate, and a subclass
    # that sets none gets the defaults, read directly
    with pytest.raises(TypeError, match="local_update must be"):
        pvi_for(linear_model, update=_UndeclaredUpdate())
    update = _DeclaresNothing()
    assert not (
        update.supports_local_latents
        or update.supports_hyperparameters
        or update.supports_factor_families
    )
    inference = pvi.PVI(poisson_model, pvi.Gamma(), [np.arange(4)], update, pvi.Sequential())
    with pytest.raises(NotImplementedError, match="_DeclaresNothing needs a Gaussian family"):
        inference.build(y=jnp.ones(4))
