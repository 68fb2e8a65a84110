"""ArviZ conversion: a fitted PVI run as an ``arviz.InferenceData``.

:func:`to_arviz` draws independent samples of every global site from ``q`` into the ``posterior``
group (with every client's local latent sites, if the model has any) and stores the run's per-round
history (:class:`~numpyro_pvi.RoundInfo`) in ``sample_stats``, so ``arviz.summary``,
``arviz.plot_posterior`` and ``arviz.plot_forest`` work as for NumPyro's MCMC.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from numpyro_pvi._version import __version__
from numpyro_pvi.model.local_latents import pooled_order


@runtime_checkable
class RunResult(Protocol):
    """What :func:`to_arviz` reads of a :class:`~numpyro_pvi.PVIRunResult` (which this module does
    not import: the result imports it)."""

    state: Any
    history: Any
    config: Any
    problem: Any


#: ``RoundInfo`` fields stored in ``sample_stats``, with their per-round dimensions.
HISTORY_DIMS = {
    "elbo": ("round",),
    "free_energy": ("round", "client"),
    "attempts": ("round", "client"),
    "accepted": ("round", "client"),
    "damping": ("round", "client"),
    "clamped": ("round", "client"),
    "time": ("round",),
    "rejection": ("round", "client"),
    "moved": ("round", "client"),
    "change": ("round",),
}


def to_arviz(
    result: Any,
    num_samples: int = 1000,
    rng_key: jax.Array | None = None,
    *,
    num_chains: int = 4,
    coords: dict | None = None,
    dims: dict | None = None,
) -> Any:
    """Convert a :class:`~numpyro_pvi.PVIRunResult` to an ``arviz.InferenceData``.

    * ``posterior``: ``num_samples`` independent draws from ``q`` of every global site (constrained
      values), with dimensions ``(chain, draw, <site>_dim_0, ...)`` named after the site's shape as
      ArviZ names them (override with ``dims`` / ``coords``).
    * ``sample_stats``: the run's history over a ``round`` dimension (``1 ... R``): ``elbo`` and
      ``time`` per round, and ``free_energy``, ``attempts``, ``accepted``, ``damping``, ``clamped``
      per ``(round, client)``. Omitted when the run has no history (zero rounds).

    Draws from ``q`` are independent, so splitting them into ``num_chains`` chains is exact:
    ``r_hat`` is 1 and ``ess`` about ``num_samples`` up to Monte Carlo noise. ArviZ's diagnostics
    need at least 2 chains (with ``num_chains=1``, ``arviz.summary`` logs a shape warning and
    reports ``r_hat`` as NaN), hence the default of 4.

    * Local latent sites (inside the partition plate) are drawn from each client's private guide and
      gathered over clients along a dimension named after the partition plate, in the pooled data's
      row order (with ``ClientData``: client 0's rows, then client 1's, ...); ``constant_data``
      then holds ``client``, the client that holds each row.

    :param result: the :class:`~numpyro_pvi.PVIRunResult` of :meth:`PVI.run <numpyro_pvi.PVI.run>`.
    :param int num_samples: total number of draws from ``q``, split evenly over the chains.
    :param rng_key: random key of the draws (default ``jax.random.PRNGKey(0)``).
    :param int num_chains: number of chains the draws are split into (must divide ``num_samples``).
    :param dict coords: extra coordinates, as in ``arviz.from_numpyro`` (e.g. ``{"feature":
        names}``).
    :param dict dims: site name -> names of its dimensions (without ``chain`` and ``draw``).
    :return: an ``arviz.InferenceData`` with ``posterior`` and (if the run had rounds)
        ``sample_stats``.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp, optax, numpyro, numpyro.distributions as dist
        >>> import arviz as az
        >>> from jax import random
        >>> import numpyro_pvi as pvi
        >>> from numpyro_pvi.results.arviz import to_arviz
        >>> def model(x, y=None):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        ...     with pvi.partition_plate("data", x.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0).to_event(1), obs=y)
        >>> y = 1.0 + random.normal(random.PRNGKey(0), (40, 2))
        >>> inference = pvi.PVI(
        ...     model,
        ...     pvi.MeanFieldGaussian(),
        ...     partitions=pvi.split_iid(random.PRNGKey(1), 40, num_clients=4),
        ...     local_update=pvi.GradientUpdate(optax.adam(0.05), num_steps=200),
        ...     server=pvi.Sequential(),
        ... )
        >>> result = inference.run(random.PRNGKey(2), 3, y, y=y, progress_bar=False)
        >>> idata = to_arviz(result, num_samples=400)
        >>> idata.posterior["mu"].dims
        ('chain', 'draw', 'mu_dim_0')
        >>> idata.sample_stats["free_energy"].dims
        ('round', 'client')
        >>> list(az.summary(idata, kind="stats").index)
        ['mu[0]', 'mu[1]']
    """
    import arviz as az  # imported here: arviz is slow to import and prints a FutureWarning

    _check_arguments(result, num_samples, num_chains)
    return az.InferenceData(
        **_inference_groups(result, int(num_samples), int(num_chains), rng_key, coords, dims)
    )


def _check_arguments(result: Any, num_samples: int, num_chains: int) -> None:
    """Raise unless ``num_chains`` is positive, ``num_samples`` a multiple of it and ``result`` a
    run result."""
    if not isinstance(num_chains, (int, np.integer)) or num_chains < 1:
        raise ValueError(f"to_arviz: num_chains must be a positive integer, got {num_chains!r}.")
    if (
        not isinstance(num_samples, (int, np.integer))
        or num_samples < num_chains
        or num_samples % num_chains
    ):
        raise ValueError(
            f"to_arviz: num_samples={num_samples!r} must be a positive multiple of "
            f"num_chains={num_chains}."
        )
    if not isinstance(result, RunResult):
        raise TypeError(
            f"to_arviz expects the PVIRunResult of PVI.run, got {type(result).__name__}."
        )


def _inference_groups(
    result: Any,
    num_samples: int,
    num_chains: int,
    rng_key: jax.Array | None,
    coords: dict | None,
    dims: dict | None,
) -> dict:
    """The groups of the ``InferenceData``, all with the run's attributes: see :func:`to_arviz`."""
    attrs = {
        "inference_library": "numpyro_pvi",
        "inference_library_version": __version__,
        "family": type(result.family).__name__,
        "server": repr(result.config.server),
        "num_clients": int(result.num_clients),
    }
    groups = _posterior_groups(result, num_samples, num_chains, rng_key, coords, dims, attrs)
    if result.history is not None:
        # a sampled run's (rounds, K) records over every client
        history = result.history.dense(int(result.num_clients))
        groups["sample_stats"] = _history_dataset(history, attrs)
    return groups


def _posterior_groups(
    result: Any,
    num_samples: int,
    num_chains: int,
    rng_key: jax.Array | None,
    coords: dict | None,
    dims: dict | None,
    attrs: dict,
) -> dict:
    """The ``posterior`` group (global, local and deterministic draws) and, with per-row sites,
    ``constant_data``."""
    import arviz as az
    import xarray as xr

    rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    # in model order (a pytree operation such as jax.device_get would sort the dict's keys)
    samples = {
        name: np.asarray(value)
        for name, value in result.sample_posterior(rng_key, num_samples).items()
    }
    per_client = _client_draws(result, jax.random.fold_in(rng_key, 1), num_samples)
    order = pooled_order(result.problem.sizes, result.config.partitions)
    rows = np.argsort(order, kind="stable")
    row_axes = {site.name: site.row_axis for site in result.sites.locals}
    deterministic, det_axes = _deterministic_draws(
        result, samples, per_client, jax.random.fold_in(rng_key, 2)
    )
    row_axes.update(det_axes)
    per_row = {}
    for name, axis in row_axes.items():
        clients = deterministic[name] if name in det_axes else [c[name] for c in per_client]
        per_row[name] = np.take(
            np.concatenate([np.asarray(c) for c in clients], axis=axis), rows, axis=axis
        )
    samples.update({name: value for name, value in deterministic.items() if name not in row_axes})
    samples.update(per_row)
    plate = result.sites.plate
    dims = {
        **{
            name: [
                plate if k - np.ndim(per_row[name]) == axis else f"{name}_dim_{k - 1}"
                for k in range(1, np.ndim(per_row[name]))
            ]
            for name, axis in row_axes.items()
        },
        **(dims or {}),
    }
    if per_row:
        coords = {plate: order[rows], **(coords or {})}
    draws = num_samples // num_chains
    posterior = {
        name: np.asarray(value).reshape((num_chains, draws) + np.shape(value)[1:])
        for name, value in samples.items()
    }
    groups = {
        "posterior": az.dict_to_dataset(
            posterior, library=None, coords=coords, dims=dims, attrs=attrs
        )
    }
    if per_row:
        client_of_row = np.repeat(np.arange(result.num_clients), result.problem.sizes)[rows]
        groups["constant_data"] = xr.Dataset(
            {"client": ((plate,), client_of_row)}, coords={plate: order[rows]}, attrs=attrs
        )
    return groups


def _client_draws(result: Any, rng_key: jax.Array, num_samples: int) -> list:
    """Every client's draws of its local latent sites (its own rows), or ``[]`` without local
    sites."""
    if not result.sites.locals:
        return []
    return [
        jax.device_get(
            result.sample_posterior(jax.random.fold_in(rng_key, m), num_samples, client=m)
        )
        for m in range(int(result.num_clients))
    ]


def _deterministic_draws(
    result: Any, samples: dict, per_client: list, rng_key: jax.Array
) -> tuple[dict, dict]:
    """The ``numpyro.deterministic`` sites computed from the posterior group's draws.

    Each client's model call, with the global draws and its own local draws substituted, gives every
    site: global ones from client 0's call, per-row ones (in the partition plate) from every
    client's.

    :return: ``(site -> draws, or a list of each client's draws for a per-row site; site -> row
        axis)``.
    """
    from numpyro import handlers
    from numpyro.infer import Predictive

    problem, model = result.problem, result.config.model
    client_args = [
        problem.split.layout.build([column[m] for column in problem.split.columns])
        for m in range(int(result.num_clients))
    ]
    params = result.hyperparameters
    trace = handlers.trace(handlers.seed(handlers.substitute(model, params), 0)).get_trace(
        *client_args[0][0], **client_args[0][1]
    )
    sites = {name: site for name, site in trace.items() if site["type"] == "deterministic"}
    if not sites:
        return {}, {}
    row_axes = {}
    for name, site in sites.items():
        frames = [f for f in site["cond_indep_stack"] if f.name == problem.sites.plate]
        if frames:
            # of the value; the draws' leading axis does not count from the right
            row_axes[name] = frames[0].dim
    out: dict = {name: [] for name in row_axes}
    for m, (args, kwargs) in enumerate(client_args if row_axes else client_args[:1]):
        own = (
            {site.name: per_client[m][site.name] for site in problem.sites.locals}
            if per_client
            else {}
        )
        # the posterior group's global draws, the client's own local draws
        drawn = {**samples, **own}
        predictive = Predictive(
            model, posterior_samples=drawn, params=params, return_sites=list(sites)
        )
        values = predictive(jax.random.fold_in(rng_key, m), *args, **kwargs)
        for name in sites:
            if name in row_axes:
                out[name].append(np.asarray(values[name]))
            elif m == 0:
                out[name] = np.asarray(values[name])
    return out, row_axes


def _history_dataset(history: Any, attrs: dict) -> Any:
    """The ``sample_stats`` group: the fields of :data:`HISTORY_DIMS` over ``round`` (``1 ... R``)
    and ``client``."""
    import xarray as xr

    num_rounds = int(np.shape(history.elbo)[0])
    num_clients = int(np.shape(history.free_energy)[1])
    data_vars = {
        name: (field_dims, np.asarray(getattr(history, name)))
        for name, field_dims in HISTORY_DIMS.items()
    }
    history_coords = {"round": np.arange(1, num_rounds + 1), "client": np.arange(num_clients)}
    return xr.Dataset(data_vars, coords=history_coords, attrs={**attrs, "num_rounds": num_rounds})
