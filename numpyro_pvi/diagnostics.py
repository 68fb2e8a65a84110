"""ArviZ conversion: a fitted PVI run as an ``arviz.InferenceData``.

:func:`to_arviz` draws independent samples of every global site from ``q`` into the ``posterior``
group (with every client's local latent sites, if the model has any) and stores the run's per-round
history (:class:`~numpyro_pvi.RoundInfo`) in ``sample_stats``, so ``arviz.summary``,
``arviz.plot_posterior`` and ``arviz.plot_forest`` work as for NumPyro's MCMC.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from numpyro_pvi.partition import ClientData

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


def to_arviz(result: Any, num_samples: int = 1000, rng_key: jax.Array | None = None, *, num_chains: int = 4,
             coords: dict | None = None, dims: dict | None = None) -> Any:
    """Convert a :class:`~numpyro_pvi.PVIRunResult` to an ``arviz.InferenceData``.

    * ``posterior``: ``num_samples`` independent draws from ``q`` of every global site (constrained
      values), with dimensions ``(chain, draw, <site>_dim_0, ...)`` named after the site's shape as
      ArviZ names them (override with ``dims`` / ``coords``).
    * ``sample_stats``: the run's history over a ``round`` dimension (``1 ... R``): ``elbo`` and
      ``time`` per round, and ``free_energy``, ``attempts``, ``accepted``, ``damping``, ``clamped``
      per ``(round, client)``. Omitted when the run has no history (zero rounds).

    Draws from ``q`` are independent, so splitting them into ``num_chains`` chains is exact: ``r_hat``
    is 1 and ``ess`` about ``num_samples`` up to Monte Carlo noise. ArviZ's diagnostics need at
    least 2 chains (with ``num_chains=1``, ``arviz.summary`` logs a shape warning and reports
    ``r_hat`` as NaN), hence the default of 4.

    * Local latent sites (inside the partition plate) are drawn from each client's private guide and
      gathered over clients along a dimension named after the partition plate, in the pooled data's
      row order (with ``ClientData``: client 0's rows, then client 1's, ...); ``constant_data``
      then holds ``client``, the client that holds each row.

    :param result: the :class:`~numpyro_pvi.PVIRunResult` of :meth:`PVI.run <numpyro_pvi.PVI.run>`.
    :param int num_samples: total number of draws from ``q``, split evenly over the chains.
    :param rng_key: random key of the draws (default ``jax.random.PRNGKey(0)``).
    :param int num_chains: number of chains the draws are split into (must divide ``num_samples``).
    :param dict coords: extra coordinates, as in ``arviz.from_numpyro`` (e.g. ``{"feature": names}``).
    :param dict dims: site name -> names of its dimensions (without ``chain`` and ``draw``).
    :return: an ``arviz.InferenceData`` with ``posterior`` and (if the run had rounds) ``sample_stats``.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp, optax, numpyro, numpyro.distributions as dist
        >>> import arviz as az
        >>> from jax import random
        >>> import numpyro_pvi as pvi
        >>> from numpyro_pvi.diagnostics import to_arviz
        >>> def model(x, y=None):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        ...     with pvi.partition_plate("data", x.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0).to_event(1), obs=y)
        >>> y = 1.0 + random.normal(random.PRNGKey(0), (40, 2))
        >>> inference = pvi.PVI(model, pvi.MeanFieldGaussian(),
        ...                     partitions=pvi.split_iid(random.PRNGKey(1), 40, num_clients=4),
        ...                     local_update=pvi.GradientUpdate(optax.adam(0.05), num_steps=200),
        ...                     server=pvi.Sequential())
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
    return az.InferenceData(**_inference_groups(result, int(num_samples), int(num_chains), rng_key, coords, dims))


def _check_arguments(result: Any, num_samples: int, num_chains: int) -> None:
    """Raise unless ``num_chains`` is positive, ``num_samples`` a multiple of it and ``result`` a run result."""
    if not isinstance(num_chains, (int, np.integer)) or num_chains < 1:
        raise ValueError(f"to_arviz: num_chains must be a positive integer, got {num_chains!r}.")
    if not isinstance(num_samples, (int, np.integer)) or num_samples < num_chains or num_samples % num_chains:
        raise ValueError(f"to_arviz: num_samples={num_samples!r} must be a positive multiple of "
                         f"num_chains={num_chains}.")
    for field in ("state", "history", "inference"):
        if not hasattr(result, field):
            raise TypeError(f"to_arviz expects the PVIRunResult of PVI.run, got {type(result).__name__}.")


def _inference_groups(result: Any, num_samples: int, num_chains: int, rng_key: jax.Array | None,
                      coords: dict | None, dims: dict | None) -> dict:
    """The groups of the ``InferenceData``, all with the run's attributes: see :func:`to_arviz`."""
    attrs = {"inference_library": "numpyro_pvi", "inference_library_version": _version(),
             "family": type(result.family).__name__, "server": repr(result.inference.server),
             "num_clients": int(result.num_clients)}
    groups = _posterior_groups(result, num_samples, num_chains, rng_key, coords, dims, attrs)
    if result.history is not None:
        groups["sample_stats"] = _history_dataset(result.history, attrs)
    return groups


def _posterior_groups(result: Any, num_samples: int, num_chains: int, rng_key: jax.Array | None,
                      coords: dict | None, dims: dict | None, attrs: dict) -> dict:
    """The ``posterior`` group (global and local draws) and, with local sites, ``constant_data``."""
    import arviz as az
    import xarray as xr

    rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    # in model order (a pytree operation such as jax.device_get would sort the dict's keys)
    samples = {name: np.asarray(value) for name, value in result.sample_posterior(rng_key, num_samples).items()}
    local, local_dims, client_of_row, row_index = _local_draws(result, jax.random.fold_in(rng_key, 1), num_samples)
    samples.update(local)
    dims = {**local_dims, **(dims or {})}
    if local:
        coords = {result.sites.plate: row_index, **(coords or {})}
    draws = num_samples // num_chains
    posterior = {name: np.asarray(value).reshape((num_chains, draws) + np.shape(value)[1:])
                 for name, value in samples.items()}
    groups = {"posterior": az.dict_to_dataset(posterior, library=None, coords=coords, dims=dims, attrs=attrs)}
    if local:
        plate = result.sites.plate
        groups["constant_data"] = xr.Dataset({"client": ((plate,), client_of_row)}, coords={plate: row_index},
                                             attrs=attrs)
    return groups


def _local_draws(result: Any, rng_key: jax.Array, num_samples: int) -> tuple[dict, dict, np.ndarray, np.ndarray]:
    """Every client's local latent draws in pooled row order: ``(samples, dims, client_of_row, row_index)``."""
    sites = result.sites
    if not sites.locals:
        return {}, {}, np.zeros(0, int), np.zeros(0, int)
    inference = result.inference
    num_clients = int(result.num_clients)
    per_client = [jax.device_get(result.sample_posterior(jax.random.fold_in(rng_key, m), num_samples, client=m))
                  for m in range(num_clients)]
    client_of_row = np.concatenate([np.full(np.shape(per_client[m][sites.locals[0].name])[
        sites.locals[0].row_axis], m) for m in range(num_clients)])
    partitions = inference.partitions
    index = np.arange(len(client_of_row))  # each gathered row's index in the pooled data
    if partitions is not None and not isinstance(partitions, ClientData):
        index = np.concatenate([np.asarray(p) for p in partitions])
    rows = np.argsort(index, kind="stable")
    samples, dims = {}, {}
    for site in sites.locals:
        gathered = np.concatenate([np.asarray(c[site.name]) for c in per_client], axis=site.row_axis)
        samples[site.name] = np.take(gathered, rows, axis=site.row_axis)
        ndim = len(site.shape)
        dims[site.name] = [sites.plate if k - ndim == site.row_axis else f"{site.name}_dim_{k}" for k in range(ndim)]
    return samples, dims, client_of_row[rows], index[rows]


def _history_dataset(history: Any, attrs: dict) -> Any:
    """The ``sample_stats`` group: the fields of :data:`HISTORY_DIMS` over ``round`` (``1 ... R``) and ``client``."""
    import xarray as xr

    num_rounds = int(np.shape(history.elbo)[0])
    num_clients = int(np.shape(history.free_energy)[1])
    data_vars = {name: (field_dims, np.asarray(getattr(history, name))) for name, field_dims in HISTORY_DIMS.items()}
    history_coords = {"round": np.arange(1, num_rounds + 1), "client": np.arange(num_clients)}
    return xr.Dataset(data_vars, coords=history_coords, attrs={**attrs, "num_rounds": num_rounds})


def _version() -> str:
    try:
        from numpyro_pvi import __version__
    except ImportError:  # pragma: no cover - only while the package is half-imported
        return "unknown"
    return __version__
