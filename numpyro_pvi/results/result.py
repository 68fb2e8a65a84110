"""What a run leaves: the posterior from a state and its problem, and :class:`PVIRunResult`."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from numpyro import handlers

from numpyro_pvi.config import PVIConfig
from numpyro_pvi.model.local_latents import (
    local_distribution,
    own_rows,
    pooled_local,
    pooled_order,
    sample_local,
)
from numpyro_pvi.model.problem import Problem
from numpyro_pvi.model.sites import ModelSites
from numpyro_pvi.model.trace import read_shapes
from numpyro_pvi.privacy.accounting import privacy_spent
from numpyro_pvi.state import PVIState, RoundInfo


def client_local(problem: Problem, state: PVIState, client: int) -> tuple[Any, int]:
    """Client ``client``'s local-update state and its number of real rows."""
    if not 0 <= client < problem.num_clients:
        raise ValueError(f"client must be in range(0, {problem.num_clients}), got {client!r}.")
    return jax.tree.map(lambda s: s[client], state.client_states), int(problem.sizes[client])


def sample_posterior(
    problem: Problem,
    state: PVIState,
    rng_key: jax.Array,
    num_samples: int,
    client: int | None = None,
) -> dict:
    """``num_samples`` draws of every global site from ``q`` (constrained, in model order), and
    client ``client``'s local sites (``q`` of the problem's laid-out family, ``problem.family``)."""
    zeta_key, local_key = jax.random.split(rng_key) if client is not None else (rng_key, None)
    zeta = problem.family.to_dist(state.q).sample(zeta_key, (num_samples,))
    # vmap returns the dict with sorted keys: back to model order
    drawn = jax.vmap(problem.sites.unflatten)(zeta)
    samples = {site.name: drawn[site.name] for site in problem.sites.globals}
    if client is not None:
        local, rows = client_local(problem, state, client)
        samples.update(sample_local(problem.sites, local_key, local, num_samples, rows))
    return samples


def make_guide(
    problem: Problem,
    state: PVIState,
    client: int | None = None,
    model: Callable | None = None,
    partitions: Any = None,
) -> Callable:
    """A NumPyro guide drawing the global sites from ``q`` and every local site from its client's
    guide (``q`` of the problem's laid-out family, ``problem.family``).

    With ``client``, the local sites of that client's rows (call the guide with its data); without,
    of every client's rows in the pooled data's order (``partitions``: the index arrays of
    ``PVI(partitions=...)``; with ``ClientData``, client 0's rows then client 1's, ...). Given
    ``model``, a call whose partition plate does not have those rows raises ``ValueError``.

    **Example:** ``Predictive(model, guide=make_guide(problem, state, model=model),
    num_samples=100)`` (what ``result.guide()`` returns).
    """
    sites, q_dist = problem.sites, problem.family.to_dist(state.q)
    local, rows = {}, 0
    if sites.locals and client is not None:
        own, rows = client_local(problem, state, client)
        local = {site.name: own_rows(site, own, rows) for site in sites.locals}
    elif sites.locals:
        order = pooled_order(problem.sizes, partitions)
        local, rows = pooled_local(sites, state.client_states, problem.sizes, order), len(order)
    who = f"client {client}'s data" if client is not None else "the pooled data"

    def guide(*args: Any, **kwargs: Any) -> None:
        if local and model is not None:
            _check_rows(model, sites.plate, rows, who, args, kwargs)
        zeta = numpyro.sample("_pvi_latent", q_dist, infer={"is_auxiliary": True})
        for name, value in sites.unflatten(zeta).items():
            numpyro.sample(name, dist.Delta(value, event_dim=jnp.ndim(value)))
        for site in sites.locals if local else ():
            numpyro.sample(site.name, local_distribution(site, *local[site.name]))

    return guide


def _check_rows(
    model: Callable, plate: str, rows: int, who: str, args: tuple, kwargs: dict
) -> None:
    """Raise ``ValueError`` unless ``model(*args, **kwargs)``'s partition plate has the guide's
    ``rows`` rows."""
    # an abstract trace of the model, hidden from the handlers the guide runs under
    with handlers.block():
        size = int(read_shapes(model, args, kwargs, "The guide's data")[plate]["args"][0])
    if size != rows:
        raise ValueError(
            f"This guide draws the local latent sites of {who}: {rows} rows of partition plate "
            f"'{plate}', but it was called on data with {size} rows. Call Predictive with those "
            "data (result.guide(client=m) for client m's rows). New rows have no posterior "
            "guide: Predictive(model, posterior_samples=result.sample_posterior(key, n)) draws "
            "their local latents from the prior."
        )


def hyperparameters(problem: Problem, state: PVIState) -> dict:
    """The learned hyperparameters (``numpyro.param`` sites), constrained: site -> value."""
    return dict(problem.sites.hyper_values(state.hyper)) if state.hyper else {}


def average_states(family: Any, state: PVIState, last: Any) -> PVIState:
    """``state`` with ``q``, the factors and the prior factor averaged over ``last``: their natural
    parameters ``(q, factors, prior_factor)`` in the last rounds.

    A family's natural parameters form a convex set, and ``q = prior + t_0 + sum of the factors`` is
    linear in them: the average is a valid ``q`` made of the averaged factors (each cavity an
    average of valid ones).
    """
    q, factors, prior_factor = jax.tree.map(lambda *xs: sum(xs) / len(xs), *last)
    if not bool(family.is_valid(q)):
        raise RuntimeError(
            "The average of the last rounds' q is not a valid member of the family, which a "
            "convex set of natural parameters cannot give: please report this."
        )
    return state._replace(q=q, factors=factors, prior_factor=prior_factor)


class PVIRunResult(NamedTuple):
    """The result of :meth:`PVI.run`: final ``state``, per-round ``history`` (:class:`RoundInfo`),
    the ``config`` (:class:`~numpyro_pvi.config.PVIConfig`: the ``PVI``'s configuration as a value)
    and the ``problem`` (data, sites, compiled steps) it ran on; all immutable.

    ``converged`` says whether the run converged (``None`` if no ``tol`` was given): its last round
    moved ``q`` by at most ``tol``, every update of that round was merged and none clamped, every
    client was merged at least once, the ELBO was not falling and ``q`` was not drifting one way
    with more than ``tol`` still to go. ``stopped_because`` says why the run stopped:
    ``"converged"``, or (all rounds run) ``"num_rounds"`` (no ``tol``, nothing wrong),
    ``"not_merged"``, ``"clamped"``, ``"unmerged_clients"``, ``"elbo_falling"``, ``"still_moving"``
    (more rounds help), ``"noise_floor"`` (more particles or local steps help, not rounds),
    ``"swinging"``, ``"not_settled"``, or ``"factorised_correlation"`` (EP / SNEP with a factorised
    family over correlated clients: ``q`` settled, early, at a fixed point whose sds are neither the
    posterior's nor mean-field VI's) (:data:`numpyro_pvi.server.monitor.STOP_REASONS`); every reason
    but
    ``"converged"`` and ``"num_rounds"`` comes with a :class:`~numpyro_pvi.PVIWarning` that names
    it. ``average`` is the state averaged over the last rounds (``run(..., average_rounds=k)``), see
    :meth:`averaged`.

    **Example:** ``result = inference.run(key, 20, X, y=y, tol=0.05)``; ``result.converged``,
    ``result.stopped_because``; then ``result.sample_posterior(key, 1000)``,
    ``Predictive(model, guide=result.guide(), num_samples=500)``, ``result.to_arviz()``,
    ``result.history.elbo``.
    """

    state: PVIState
    history: RoundInfo | None
    config: PVIConfig
    problem: Problem
    converged: bool | None = None
    stopped_because: str | None = None
    average: PVIState | None = None

    def averaged(self) -> PVIRunResult:
        """This result with the posterior averaged over the last ``k`` rounds of ``run(...,
        average_rounds=k)``.

        The natural parameters of ``q`` (and of the factors) are averaged: at the Monte Carlo noise
        floor of stochastic local updates ``q`` jitters around its fixed point from round to round,
        and the average is closer to it (see ``docs/troubleshooting.md``). Use it for the posterior
        (``sample_posterior``, ``guide``, ``get_posterior``); continue a run from the result itself.

        **Example:** ``result = inference.run(key, 30, X, y=y, average_rounds=10)``;
        ``result.averaged().sample_posterior(key, 1000)``.
        """
        if self.average is None:
            raise ValueError(
                "This run kept no average: run(..., average_rounds=k) averages the last k rounds."
            )
        return self._replace(state=self.average, average=None)

    @property
    def sites(self) -> ModelSites:
        """The model's sites as PVI read them (global sites in flat order, local sites,
        hyperparameters)."""
        return self.problem.sites

    @property
    def family(self) -> Any:
        """The factors' family, laid out for the model's sites (``problem.family``;
        ``config.family`` is the family as configured)."""
        return self.problem.family

    @property
    def num_clients(self) -> int:
        """The number of clients."""
        return self.problem.num_clients

    def sample_posterior(
        self, rng_key: jax.Array, num_samples: int, client: int | None = None
    ) -> dict:
        """Constrained samples of every global site from ``q``: site -> ``(num_samples, *shape)``.

        With ``client``, also that client's local latent sites (its rows only).
        """
        return sample_posterior(self.problem, self.state, rng_key, num_samples, client)

    def guide(self, client: int | None = None) -> Callable:
        """A guide for ``numpyro.infer.Predictive(model, guide=result.guide(), num_samples=...)``.

        It draws the global sites from ``q`` and each row's local latent sites from the guide of the
        client that holds the row: call ``Predictive`` with the pooled data (rows in the pooled
        order; with ``ClientData``, client 0's rows then client 1's, ...). With ``client``, only
        that client's rows: call it with the client's data. Data with another number of rows raise
        ``ValueError``.
        """
        return make_guide(
            self.problem,
            self.state,
            client,
            self.config.model,
            self.config.partitions,
        )

    @property
    def hyperparameters(self) -> dict:
        """The learned hyperparameters (``numpyro.param`` sites), constrained: site -> value."""
        return hyperparameters(self.problem, self.state)

    def get_posterior(self) -> dist.Distribution:
        """``q`` over the flat unconstrained vector."""
        return self.family.to_dist(self.state.q)

    def privacy_spent(
        self, delta: float, client_sampling: str = "known", client_rates: Any = None
    ) -> Any:
        """``(M,)`` each client's ``epsilon`` at ``delta`` over every update it released (DP local
        updates only).

        See :func:`numpyro_pvi.privacy.accounting.privacy_spent` (RDP accountant of
        ``dp-accounting``, extra
        ``dp``); ``client_sampling="secret"`` credits a ``Synchronous`` server's random draw of
        clients.

        **Example:** ``result.privacy_spent(1e-5)`` is e.g. ``array([0.98, 0.98, ...])``.
        """
        return privacy_spent(
            self.config.local_update,
            self.config.server,
            self.state,
            self.history,
            self.problem.sizes,
            delta,
            client_sampling=client_sampling,
            client_rates=client_rates,
        )

    def to_arviz(
        self, num_samples: int = 1000, rng_key: jax.Array | None = None, **kwargs: Any
    ) -> Any:
        """The run as an ``arviz.InferenceData``: draws from ``q`` and the per-round history.

        See :func:`~numpyro_pvi.results.arviz.to_arviz` (``kwargs``: ``num_chains``, ``coords``,
        ``dims``).

        **Example:**

        .. doctest::

            >>> import optax, numpyro, numpyro.distributions as dist
            >>> from jax import random
            >>> import numpyro_pvi as pvi
            >>> def model(y=None):
            ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
            ...     with pvi.partition_plate("data", y.shape[0]):
            ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
            >>> y = 1.0 + random.normal(random.PRNGKey(0), (40,))
            >>> inference = pvi.PVI(
            ...     model,
            ...     pvi.MeanFieldGaussian(),
            ...     partitions=pvi.split_iid(random.PRNGKey(1), 40, num_clients=4),
            ...     local_update=pvi.GradientUpdate(optax.adam(0.05), num_steps=200),
            ...     server=pvi.Sequential(),
            ... )
            >>> result = inference.run(random.PRNGKey(2), 2, y=y, progress_bar=False)
            >>> idata = result.to_arviz(num_samples=400)
            >>> idata.posterior["mu"].shape, idata.sample_stats["free_energy"].dims
            ((4, 100), ('round', 'client'))
        """
        from numpyro_pvi.results.arviz import to_arviz

        return to_arviz(self, num_samples, rng_key, **kwargs)
