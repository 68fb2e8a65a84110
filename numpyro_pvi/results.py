"""What a run leaves: the posterior from a state and its problem, and :class:`PVIRunResult`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from numpyro_pvi.local_latents import local_distribution, own_rows, sample_local
from numpyro_pvi.problem import Problem
from numpyro_pvi.sites import ModelSites
from numpyro_pvi.state import PVIState, RoundInfo

if TYPE_CHECKING:
    from numpyro_pvi.pvi import PVI


def client_local(problem: Problem, state: PVIState, client: int) -> tuple[Any, int]:
    """Client ``client``'s local-update state and its number of real rows."""
    if not 0 <= client < problem.num_clients:
        raise ValueError(f"client must be in range(0, {problem.num_clients}), got {client!r}.")
    return jax.tree.map(lambda s: s[client], state.client_states), int(problem.sizes[client])


def sample_posterior(problem: Problem, family: Any, state: PVIState, rng_key: jax.Array, num_samples: int,
                     client: int | None = None) -> dict:
    """``num_samples`` draws of every global site from ``q`` (constrained, in model order), and client ``client``'s
    local sites."""
    zeta_key, local_key = jax.random.split(rng_key) if client is not None else (rng_key, None)
    zeta = family.to_dist(state.q).sample(zeta_key, (num_samples,))
    drawn = jax.vmap(problem.sites.unflatten)(zeta)  # vmap returns the dict with sorted keys: back to model order
    samples = {site.name: drawn[site.name] for site in problem.sites.globals}
    if client is not None:
        local, rows = client_local(problem, state, client)
        samples.update(sample_local(problem.sites, local_key, local, num_samples, rows))
    return samples


def make_guide(problem: Problem, family: Any, state: PVIState, client: int | None = None) -> Callable:
    """A NumPyro guide drawing the global sites from ``q`` (and client ``client``'s local sites)."""
    sites, q_dist = problem.sites, family.to_dist(state.q)
    local, rows = client_local(problem, state, client) if client is not None and sites.locals else (None, None)

    def guide(*args: Any, **kwargs: Any) -> None:
        zeta = numpyro.sample("_pvi_latent", q_dist, infer={"is_auxiliary": True})
        for name, value in sites.unflatten(zeta).items():
            numpyro.sample(name, dist.Delta(value, event_dim=jnp.ndim(value)))
        for site in sites.locals if local is not None else ():
            numpyro.sample(site.name, local_distribution(site, *own_rows(site, local, rows)))

    return guide


def hyperparameters(problem: Problem, state: PVIState) -> dict:
    """The learned hyperparameters (``numpyro.param`` sites), constrained: site -> value."""
    return dict(problem.sites.hyper_values(state.hyper)) if state.hyper else {}


class PVIRunResult(NamedTuple):
    """The result of :meth:`PVI.run`: final ``state``, per-round ``history`` (:class:`RoundInfo`), the
    ``inference`` (configuration) and the ``problem`` (data, sites, compiled steps) it ran on; all immutable.
    ``converged`` says whether the run reached ``run(..., tol=...)`` (``None`` if no ``tol`` was given).

    **Example:** ``result = inference.run(key, 20, X, y=y)``; then ``result.sample_posterior(key, 1000)``,
    ``Predictive(model, guide=result.guide(), num_samples=500)``, ``result.to_arviz()``,
    ``result.history.elbo``.
    """

    state: PVIState
    history: RoundInfo | None
    inference: PVI
    problem: Problem
    converged: bool | None = None

    @property
    def sites(self) -> ModelSites:
        """The model's sites as PVI read them (global sites in flat order, local sites, hyperparameters)."""
        return self.problem.sites

    @property
    def family(self) -> Any:
        """The factors' family."""
        return self.inference.family

    @property
    def num_clients(self) -> int:
        """The number of clients."""
        return self.problem.num_clients

    def sample_posterior(self, rng_key: jax.Array, num_samples: int, client: int | None = None) -> dict:
        """Constrained samples of every global site from ``q``: site -> ``(num_samples, *shape)``.

        With ``client``, also that client's local latent sites (its rows only).
        """
        return sample_posterior(self.problem, self.family, self.state, rng_key, num_samples, client)

    def guide(self, client: int | None = None) -> Callable:
        """A guide for ``numpyro.infer.Predictive(model, guide=result.guide(), num_samples=...)``.

        With ``client``, it also draws that client's local latents (call ``Predictive`` with its data).
        """
        return make_guide(self.problem, self.family, self.state, client)

    @property
    def hyperparameters(self) -> dict:
        """The learned hyperparameters (``numpyro.param`` sites), constrained: site -> value."""
        return hyperparameters(self.problem, self.state)

    def get_posterior(self) -> dist.Distribution:
        """``q`` over the flat unconstrained vector."""
        return self.family.to_dist(self.state.q)

    def privacy_spent(self, delta: float) -> Any:
        """``(M,)`` each client's ``epsilon`` at ``delta`` over every update it released (DP local updates only).

        See :func:`numpyro_pvi.privacy.privacy_spent` (RDP accountant of ``dp-accounting``, extra ``dp``).

        **Example:** ``result.privacy_spent(1e-5)`` is e.g. ``array([0.98, 0.98, ...])``.
        """
        from numpyro_pvi.privacy import privacy_spent

        return privacy_spent(self, delta)

    def to_arviz(self, num_samples: int = 1000, rng_key: jax.Array | None = None, **kwargs: Any) -> Any:
        """The run as an ``arviz.InferenceData``: draws from ``q`` and the per-round history.

        See :func:`~numpyro_pvi.diagnostics.to_arviz` (``kwargs``: ``num_chains``, ``coords``, ``dims``).

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
            >>> inference = pvi.PVI(model, pvi.MeanFieldGaussian(),
            ...                     partitions=pvi.split_iid(random.PRNGKey(1), 40, num_clients=4),
            ...                     local_update=pvi.GradientUpdate(optax.adam(0.05), num_steps=200),
            ...                     server=pvi.Sequential())
            >>> result = inference.run(random.PRNGKey(2), 2, y=y, progress_bar=False)
            >>> idata = result.to_arviz(num_samples=400)
            >>> idata.posterior["mu"].shape, idata.sample_stats["free_energy"].dims
            ((4, 100), ('round', 'client'))
        """
        from numpyro_pvi.diagnostics import to_arviz

        return to_arviz(self, num_samples, rng_key, **kwargs)
