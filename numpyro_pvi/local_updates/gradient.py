"""``GradientUpdate``: the client fits its local free energy with NumPyro's ``SVI`` and an optax optimiser."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpyro
from numpyro.infer import SVI, TraceMeanField_ELBO
from numpyro.infer.elbo import ELBO

from numpyro_pvi.families import NatParams
from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult


class GradientUpdate:
    """Optimise the local free energy with a NumPyro ELBO and an optax optimiser (Bui et al. 2018, Alg. 1).

    The client fits ``q_new`` on the *tilted model*: the cavity ``q / t_m`` as the prior over the flat
    unconstrained vector, times its own likelihood ``p(y_m | theta)``, i.e. it maximises
    ``F_m(q) = E_q[log p(y_m | theta)] - KL(q || cavity)``. The guide (``Normal(loc, scale)`` or
    ``MultivariateNormal(loc, scale_tril)``, parameterised like NumPyro's autoguides) starts at the
    current ``q``; ``num_steps`` of ``SVI.update`` run in one ``lax.scan``.

    :param optimizer: an ``optax.GradientTransformation`` (or a ``numpyro.optim`` optimiser).
    :param int num_steps: optimisation steps per client visit.
    :param int num_particles: ELBO particles (ignored if ``elbo`` is given).
    :param int batch_size: if set, each step uses ``batch_size`` random rows of the client, scaled up
        to the client's size; otherwise every step uses all of them.
    :param elbo: a NumPyro ELBO; default ``TraceMeanField_ELBO(num_particles)`` whose KL to the cavity
        is analytic.
    :param float average_fraction: average the guide's (unconstrained) parameters over this last
        fraction of the steps (Polyak averaging) to tame Monte Carlo noise, which the factor
        ``q_new / cavity`` amplifies about ``M``-fold. ``0`` keeps the last iterate.

    **Example:**

    .. doctest::

        >>> import optax, numpyro_pvi as pvi
        >>> update = pvi.GradientUpdate(optax.adam(1e-2), num_steps=200, num_particles=4)
    """

    def __init__(self, optimizer: Any, num_steps: int, num_particles: int = 1, batch_size: int | None = None,
                 elbo: ELBO | None = None, average_fraction: float = 0.5) -> None:
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"GradientUpdate: num_steps must be a positive integer, got {num_steps!r}.")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"GradientUpdate: batch_size must be a positive integer or None, got {batch_size!r}.")
        if not 0.0 <= average_fraction < 1.0:
            raise ValueError(f"GradientUpdate: average_fraction must be in [0, 1), got {average_fraction!r}.")
        self.optimizer = optimizer
        self.num_steps = num_steps
        self.batch_size = batch_size
        self.elbo = elbo if elbo is not None else TraceMeanField_ELBO(num_particles=num_particles)
        self.num_average = max(1, int(round(average_fraction * num_steps)))

    def init_state(self, problem: ClientProblem) -> Any:
        """The client's persistent state (none for this update)."""
        return ()

    def bind(self, problem: ClientProblem) -> Callable:
        """Return the pure ``client_update(rng_key, client, cavity, q, state) -> ClientResult``."""
        family = problem.family

        def tilted_model(client: Client, scale: jax.Array, cavity: tuple, q: tuple) -> None:
            zeta = numpyro.sample("_pvi_zeta", family.distribution(*cavity))
            numpyro.factor("_pvi_loglik", scale * problem.log_likelihood(zeta, client))

        def tilted_guide(client: Client, scale: jax.Array, cavity: tuple, q: tuple) -> None:
            loc = numpyro.param("_pvi_loc", q[0])
            spread = numpyro.param("_pvi_" + family.scale_name, q[1], constraint=family.scale_constraint)
            numpyro.sample("_pvi_zeta", family.distribution(loc, spread))

        svi = SVI(tilted_model, tilted_guide, self.optimizer, self.elbo)
        num_steps, num_average = self.num_steps, self.num_average

        def client_update(rng_key: jax.Array, client: Client, cavity: NatParams, q: NatParams,
                          state: Any) -> ClientResult:
            cavity_params, q_params = family.loc_scale(cavity), family.loc_scale(q)
            init_key, batch_key = jax.random.split(rng_key)
            # a batch as large as the (padded) client is the whole client: no sampling needed
            batch_size = None if self.batch_size is not None and self.batch_size >= client.mask.shape[0] \
                else self.batch_size
            svi_state = svi.init(init_key, client, 1.0, cavity_params, q_params)
            get = svi.optim.get_params

            def step(carry: tuple, xs: tuple) -> tuple:
                svi_state, average = carry
                i, key = xs
                data, scale = (client, 1.0) if batch_size is None else problem.minibatch(key, client, batch_size)
                svi_state, loss = svi.update(svi_state, data, scale, cavity_params, q_params)
                # running mean of the unconstrained parameters over the last `num_average` steps
                seen = i - (num_steps - num_average) + 1
                weight = jnp.where(seen >= 1, 1.0 / jnp.maximum(seen, 1), 0.0)
                params = get(svi_state.optim_state)
                average = jax.tree.map(lambda a, p: a + weight * (p - a), average, params)
                return (svi_state, average), loss

            xs = (jnp.arange(num_steps), jax.random.split(batch_key, num_steps))
            (svi_state, average), losses = jax.lax.scan(step, (svi_state, get(svi_state.optim_state)), xs)
            params = svi.constrain_fn(average)
            q_new = family.from_loc_scale(params["_pvi_loc"], params["_pvi_" + family.scale_name])
            return ClientResult(q_new - q, -jnp.mean(losses[num_steps - num_average:]), state)

        return client_update

