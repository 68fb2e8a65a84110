"""``GradientUpdate``: the client fits its local free energy with NumPyro's ``SVI`` and an optax
optimiser."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import optax
from numpyro.infer import SVI, TraceEnum_ELBO, TraceMeanField_ELBO
from numpyro.infer.elbo import ELBO

# the base class of numpyro.optim's optimisers (no public name)
from numpyro.optim import _NumPyroOptim

from numpyro_pvi.families import NatParams
from numpyro_pvi.families.tilted import (
    cavity_distribution,
    client_guide,
    from_client_guide,
    tilted_params,
)
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult, LocalUpdate
from numpyro_pvi.model.local_latents import init_local_state, local_guide, state_from_params


class GradientUpdate(LocalUpdate):
    """Optimise the local free energy with a NumPyro ELBO and an optax optimiser (Bui et al. 2018,
    Alg. 1).

    The client fits ``q_new`` on the *tilted model*: the cavity ``q / t_m`` as the prior over the
    flat unconstrained vector, times its own likelihood ``p(y_m | theta)``, i.e. it maximises
    ``F_m(q) = E_q[log p(y_m | theta)] - KL(q || cavity)``. The guide starts at the current ``q``:
    ``Normal(loc, scale)`` for mean field (parameterised like ``AutoNormal``); for full rank a
    Gaussian whitened by the cavity, ``zeta = loc + C^{-T} W^T eps`` with ``C C^T`` the cavity's
    precision and ``W`` lower triangular, so that the KL to the cavity and a draw cost ``O(D^2)``
    per step and a visit a few ``O(D^3)`` factorisations (:mod:`numpyro_pvi.families.whitened`; a
    family chooses its guide through :mod:`numpyro_pvi.families.tilted`); for another family
    (:class:`~numpyro_pvi.SiteFamilies`, ``Gamma``...) its own reparameterised guide
    (:meth:`~numpyro_pvi.families.FactorFamily.guide`). ``num_steps`` of ``SVI.update`` run in one
    ``lax.scan``.

    **Steps that follow a client's size.** With ``num_epochs=E`` (and ``batch_size=B``) in place of
    ``num_steps``, a client of ``n_m`` real rows takes ``ceil(E n_m / min(B, n_m))`` steps
    (:meth:`steps_for`): ``E`` passes over its rows in batches of ``B`` (a client smaller than a
    batch takes ``E`` steps on all of its rows). Clients updated together (a size bucket, vmapped)
    run the scan to the bucket's largest count; a client's later steps are masked (its optimiser
    state and parameters frozen) and its Polyak window is the last ``average_fraction`` of its *own*
    steps, so the result is the one of a visit of exactly its count of steps.

    Any NumPyro model (see :mod:`numpyro_pvi.model.local_latents`): local latent sites get the
    client's
    own ``AutoNormal``-like guide, optimised jointly with ``q`` and kept in the client's state
    (never in ``delta``); discrete local sites marked for enumeration are summed out with
    ``TraceEnum_ELBO`` (the default ELBO then); for hyperparameters the client also returns the
    gradient of its local free energy at the new ``q``, which the server's ``hyper_optimizer`` uses.

    :param optimizer: an ``optax.GradientTransformation`` (or a ``numpyro.optim`` optimiser).
    :param int num_steps: optimisation steps per client visit (or give ``num_epochs``).
    :param int num_particles: ELBO particles (ignored if ``elbo`` is given).
    :param int batch_size: if set, each step uses ``batch_size`` random rows of the client, scaled
        up to the client's size; otherwise every step uses all of them.
    :param elbo: a NumPyro ELBO; default ``TraceMeanField_ELBO(num_particles)`` whose KL to the
        cavity is analytic (``TraceEnum_ELBO(num_particles)`` for a model with enumerated sites).
    :param float average_fraction: average the guide's (unconstrained) parameters over this last
        fraction of the steps (Polyak averaging) to tame Monte Carlo noise, which the factor
        ``q_new / cavity`` amplifies about ``M``-fold. ``0`` keeps the last iterate.
    :param int num_epochs: in place of ``num_steps``: passes over each client's rows per visit in
        batches of ``batch_size`` (required), so that a client's steps follow its size.
    :param int num_hyper_particles: draws of the hyperparameters' gradient, one estimate per visit
        (with the default ``elbo``; at least ``num_particles``). The server steps on the sum of the
        clients' estimates once a round, so their Monte Carlo noise is what is left near the
        optimum: on the 40-row, 8-weight noise-scale model of ``tests/test_hyperparameters.py`` 8
        draws gave the summed gradient an sd of 1.5 (2.3 % of the noise scale at the evidence's
        curvature), 256 draws 0.37; they cost one gradient, against ``num_steps`` of them.

    **Example:**

    .. doctest::

        >>> import optax, numpyro_pvi as pvi
        >>> update = pvi.GradientUpdate(optax.adam(1e-2), num_steps=200, num_particles=4)
        >>> by_size = pvi.GradientUpdate(optax.adam(1e-2), num_epochs=10, batch_size=100)
        >>> [int(by_size.steps_for(n)) for n in (1, 100, 150, 1000)]
        [10, 10, 15, 100]
    """

    supports_local_latents = True
    supports_hyperparameters = True
    supports_factor_families = True

    def __init__(
        self,
        optimizer: Any,
        num_steps: int | None = None,
        num_particles: int = 1,
        batch_size: int | None = None,
        elbo: ELBO | None = None,
        average_fraction: float = 0.5,
        num_epochs: int | None = None,
        num_hyper_particles: int = 256,
    ) -> None:
        check_schedule("GradientUpdate", num_steps, num_epochs, batch_size)
        check_step_arguments(
            "GradientUpdate", 1 if num_steps is None else num_steps, num_particles, average_fraction
        )
        check_hyper_particles("GradientUpdate", num_hyper_particles, 1)
        if not isinstance(optimizer, (optax.GradientTransformation, _NumPyroOptim)):
            raise TypeError(
                "GradientUpdate: optimizer must be an optax.GradientTransformation (e.g. "
                f"optax.adam(1e-2)) or a numpyro.optim optimiser, got {optimizer!r}."
            )
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(
                "GradientUpdate: batch_size must be a positive integer or None, got "
                f"{batch_size!r}."
            )
        self.optimizer = optimizer
        self.num_steps, self.num_epochs = num_steps, num_epochs
        self.batch_size, self.average_fraction = batch_size, average_fraction
        self.elbo = elbo if elbo is not None else TraceMeanField_ELBO(num_particles=num_particles)
        self.num_particles, self.default_elbo = num_particles, elbo is None
        self.num_hyper_particles = num_hyper_particles
        self.num_average = (
            None if num_steps is None else max(1, int(round(average_fraction * num_steps)))
        )

    def steps_for(self, size: Any) -> Any:
        """The steps of a visit to a client of ``size`` real rows: ``num_steps``, or with
        ``num_epochs=E`` and ``batch_size=B``, ``ceil(E size / min(B, size))`` (none for a
        placeholder of no rows).

        Works on Python/NumPy integers (exactly, in integers) and on traced arrays.

        **Example:** ``GradientUpdate(optax.adam(1e-2), num_epochs=2,
        batch_size=100).steps_for(150)`` is 3.
        """
        if self.num_epochs is None:
            return self.num_steps
        rows = (
            np.maximum(np.minimum(size, self.batch_size), 1)
            if isinstance(size, (int, np.integer))
            else jnp.maximum(jnp.minimum(size, self.batch_size), 1)
        )
        return (self.num_epochs * size + rows - 1) // rows

    def init_state(self, problem: ClientProblem) -> Any:
        """The client's persistent state: its local guides (``site -> (loc, scale)``), none without
        local latents."""
        return init_local_state(problem.sites) if problem.has_local else ()

    def bind(self, problem: ClientProblem) -> Callable:
        """Return the pure ``client_update(rng_key, client, cavity, q, state, hyper=()) ->
        ClientResult``."""
        family, sites, live, has_hyper = (
            problem.family,
            problem.sites,
            problem.has_local,
            problem.has_hyper,
        )
        if live and self.batch_size is not None:
            raise NotImplementedError(
                "GradientUpdate(batch_size=...) with local latent variables is not supported: "
                "each step uses all of a client's rows."
            )
        elbo = self.elbo
        enumerate_ = live and sites.enumerated and self.default_elbo
        if enumerate_:
            elbo = TraceEnum_ELBO(num_particles=self.num_particles)
        # the hyperparameters' gradient: one estimate per visit, so more draws than a step's (a
        # custom elbo's own)
        hyper_elbo = elbo
        if self.default_elbo and self.num_hyper_particles > self.num_particles:
            hyper_elbo = (TraceEnum_ELBO if enumerate_ else TraceMeanField_ELBO)(
                num_particles=self.num_hyper_particles
            )

        tilted_model, tilted_guide = _tilted_model_and_guide(problem)
        svi = SVI(tilted_model, tilted_guide, self.optimizer, elbo)

        def client_update(
            rng_key: jax.Array,
            client: Client,
            cavity: NatParams,
            q: NatParams,
            state: Any,
            hyper: Any = (),
        ) -> ClientResult:
            cavity_params, q_params = tilted_params(family, cavity, q)
            init_key, batch_key = jax.random.split(rng_key)
            extra = (state, hyper)
            # a batch as large as the (padded) client is the whole client: no sampling needed
            batch_size = (
                None
                if self.batch_size is not None and self.batch_size >= client.mask.shape[0]
                else self.batch_size
            )
            svi_state = svi.init(init_key, client, 1.0, cavity_params, q_params, *extra)
            get = svi.optim.get_params
            # the scan runs to the largest count of the clients updated together (their padded rows)
            length = int(self.steps_for(int(client.mask.shape[0])))
            count, num_average = self.step_counts(client.size)
            # epochs: the client's real rows shuffled once per visit and swept in batches (a step's
            # batch costs its B rows, not the client's); fixed steps: independent batches of B
            # distinct rows
            order = None if self.num_epochs is None else shuffled_rows(batch_key, client.mask)

            def batch(i: jax.Array, key: jax.Array) -> tuple:
                if batch_size is None:
                    return client, 1.0
                if order is None:
                    return problem.minibatch(key, client, batch_size)
                return epoch_batch(problem.is_row, client, order, i, batch_size)

            def step(carry: tuple, xs: tuple) -> tuple:
                svi_state, average = carry
                data, scale = batch(*xs)
                i = xs[0]
                new_state, loss = svi.update(
                    svi_state, data, scale, cavity_params, q_params, *extra
                )
                svi_state = (
                    new_state
                    if self.num_epochs is None
                    else freeze_after(count, i, new_state, svi_state)
                )
                average = running_average(
                    average, get(svi_state.optim_state), i, count, num_average
                )
                return (svi_state, average), loss

            xs = (jnp.arange(length), jax.random.split(batch_key, length))
            (svi_state, average), losses = jax.lax.scan(
                step, (svi_state, get(svi_state.optim_state)), xs
            )
            params = svi.constrain_fn(average)
            q_new = from_client_guide(family, "_pvi_", cavity_params, params)
            new_state = state_from_params(sites, params) if live else state
            hyper_grad = ()
            # d F_m / d hyper at the new q (and local guides), by the reparameterised ELBO
            if has_hyper:
                hyper_grad = jax.grad(
                    lambda h: (
                        -hyper_elbo.loss(
                            jax.random.fold_in(rng_key, 2),
                            params,
                            tilted_model,
                            tilted_guide,
                            client,
                            1.0,
                            cavity_params,
                            q_params,
                            new_state,
                            h,
                        )
                    )
                )(hyper)
            return ClientResult(
                q_new - q, -window_mean(losses, count, num_average), new_state, 0, hyper_grad
            )

        return client_update

    def step_counts(self, size: Any) -> tuple:
        """A visit's steps and the length of its Polyak window, for a client of ``size`` rows (maybe
        traced).

        **Example:** ``update.step_counts(client.size)`` inside ``client_update``.
        """
        if self.num_epochs is None:
            return self.num_steps, self.num_average
        count = self.steps_for(size)
        return count, jnp.maximum(1, jnp.round(self.average_fraction * count)).astype(count.dtype)


def check_schedule(
    name: str, num_steps: int | None, num_epochs: int | None, batch_size: int | None
) -> None:
    """Name a visit length that is not exactly one of ``num_steps`` or ``num_epochs`` (with a
    ``batch_size``).

    **Example:** ``check_schedule("GradientUpdate", None, 10, None)`` raises a ``ValueError`` (no
    batch size).
    """
    if (num_steps is None) == (num_epochs is None):
        raise ValueError(
            f"{name}: give exactly one of num_steps (a fixed number of steps per visit) or "
            f"num_epochs (steps that follow the client's size), got num_steps={num_steps!r}, "
            f"num_epochs={num_epochs!r}."
        )
    if num_epochs is None:
        return
    if (
        not isinstance(num_epochs, (int, np.integer))
        or isinstance(num_epochs, bool)
        or num_epochs < 1
    ):
        raise ValueError(f"{name}: num_epochs must be a positive integer, got {num_epochs!r}.")
    if batch_size is None:
        raise ValueError(
            f"{name}: num_epochs={num_epochs} needs a batch_size (an epoch is ceil(n_m / "
            "batch_size) steps of a client of n_m rows); for full-batch steps give num_steps."
        )


def shuffled_rows(rng_key: jax.Array, mask: jax.Array) -> jax.Array:
    """The row indices with the real rows (``mask``) first, in a random order, then the padded ones.

    Row ``i``'s sort key is drawn from ``fold_in(rng_key, i)``, so the real rows' order does not
    depend on the padding: a client padded in a size bucket sweeps its rows as it would alone (or at
    its own site).

    **Example:** ``shuffled_rows(key, jnp.arange(5) < 3)`` is a permutation of 0, 1, 2 followed by
    3, 4.
    """
    rows = jnp.arange(mask.shape[0])
    noise = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(rng_key, i)))(rows)
    return jnp.argsort(jnp.where(mask, noise, 2.0))


def epoch_batch(
    is_row: tuple, client: Client, order: jax.Array, step: jax.Array, batch_size: int
) -> tuple[Client, jax.Array]:
    """Step ``step``'s batch of epochs over ``order`` (:func:`shuffled_rows`) and the factor that
    unbiases it.

    The batches sweep the shuffled real rows ``batch_size`` at a time, wrapping around at the end
    (so a row is used once per epoch, give or take the batch that straddles two epochs); a client
    smaller than a batch gives all its rows (the batch's other slots masked). The likelihood scale
    is ``n_m / min(B, n_m)``.

    **Example:** ``data, scale = epoch_batch(problem.is_row, client, order, i, 100)`` inside a scan
    over steps.
    """
    size = client.size
    slot = jnp.arange(batch_size)
    rows = order[(step * batch_size + slot) % jnp.maximum(size, 1)]
    arrays = [a[rows] if row else a for a, row in zip(client.arrays, is_row)]
    return Client(arrays, slot < size, size), size / jnp.maximum(jnp.minimum(size, batch_size), 1)


def freeze_after(count: jax.Array, step: jax.Array, new: Any, old: Any) -> Any:
    """``new`` at steps before ``count``, ``old`` (frozen) after: a client whose own steps are done.

    **Example:** ``svi_state = freeze_after(count, i, svi.update(svi_state, ...)[0], svi_state)``.
    """
    return jax.tree.map(lambda n, o: jnp.where(step < count, n, o), new, old)


def window_mean(losses: jax.Array, num_steps: Any, num_average: Any) -> jax.Array:
    """The mean of ``losses`` over the Polyak window: steps ``num_steps - num_average`` to
    ``num_steps - 1``.

    **Example:** ``window_mean(jnp.arange(10.0), 8, 4)`` is 5.5 (steps 4-7).
    """
    if isinstance(num_steps, int) and isinstance(num_average, int):
        return jnp.mean(losses[num_steps - num_average : num_steps])
    i = jnp.arange(losses.shape[0])
    inside = (i >= num_steps - num_average) & (i < num_steps)
    return jnp.sum(jnp.where(inside, losses, 0.0)) / jnp.maximum(num_average, 1)


def check_step_arguments(
    name: str, num_steps: int, num_particles: int, average_fraction: float
) -> None:
    """Name a bad ``num_steps``, ``num_particles`` or ``average_fraction`` of a gradient-based
    update.

    **Example:** ``check_step_arguments("GradientUpdate", 0, 1, 0.5)`` raises a ``ValueError``.
    """
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
        raise ValueError(f"{name}: num_steps must be a positive integer, got {num_steps!r}.")
    if not isinstance(num_particles, int) or isinstance(num_particles, bool) or num_particles < 1:
        raise ValueError(
            f"{name}: num_particles must be a positive integer, got {num_particles!r}."
        )
    if not 0.0 <= average_fraction < 1.0:
        raise ValueError(f"{name}: average_fraction must be in [0, 1), got {average_fraction!r}.")


def check_hyper_particles(name: str, num_hyper_particles: int, minimum: int) -> None:
    """Name a ``num_hyper_particles`` that is not an integer of at least ``minimum``.

    **Example:** ``check_hyper_particles("GradientUpdate", 0, 1)`` raises a ``ValueError``.
    """
    if (
        not isinstance(num_hyper_particles, int)
        or isinstance(num_hyper_particles, bool)
        or num_hyper_particles < minimum
    ):
        raise ValueError(
            f"{name}: num_hyper_particles must be an integer >= {minimum}, got "
            f"{num_hyper_particles!r}."
        )


def running_average(
    average: Any, params: Any, step: jax.Array, num_steps: int, num_average: int
) -> Any:
    """Polyak averaging: the running mean of ``params`` over the last ``num_average`` of
    ``num_steps`` steps.

    ``average`` is returned unchanged before the averaging window and after ``num_steps`` (step
    ``i`` counts from 0); ``num_steps`` and ``num_average`` may be traced (a client's own count of
    steps).

    **Example:** inside a ``lax.scan`` over steps, ``average = running_average(average, params, i,
    200, 100)``.
    """
    seen = step - (num_steps - num_average) + 1
    weight = jnp.where((seen >= 1) & (step < num_steps), 1.0 / jnp.maximum(seen, 1), 0.0)
    return jax.tree.map(lambda a, p: a + weight * (p - a), average, params)


def _tilted_model_and_guide(problem: ClientProblem) -> tuple[Callable, Callable]:
    """The tilted model (the cavity as the prior of ``zeta``, times the client's likelihood) and the
    guide on it."""
    family, sites, live = problem.family, problem.sites, problem.has_local

    def tilted_model(
        client: Client, scale: jax.Array, cavity: tuple, q: tuple, local: Any, hyper: Any
    ) -> None:
        zeta = numpyro.sample("_pvi_zeta", cavity_distribution(family, cavity))
        if live:  # the model itself: its local latents and observations are sites of this ELBO
            problem.local_model(zeta, client, hyper)
        else:
            numpyro.factor("_pvi_loglik", scale * problem.log_likelihood(zeta, client, hyper))

    def tilted_guide(
        client: Client, scale: jax.Array, cavity: tuple, q: tuple, local: Any, hyper: Any
    ) -> None:
        numpyro.sample("_pvi_zeta", client_guide(family, "_pvi_", cavity, q))
        if live:
            local_guide(sites, client.mask, local)

    return tilted_model, tilted_guide
