"""Plots of a PVI run (matplotlib): its history, its marginals against other methods, its clients.

Every function returns a ``matplotlib.figure.Figure`` made with ``pyplot`` (it shows in a notebook
and with ``plt.show()``; save it with ``fig.savefig``); none calls ``plt.show``.

* :func:`plot_history`: the global ELBO, the change of ``q`` and every client's local free energy
  per round.
* :func:`plot_compare`: marginal densities of chosen sites under PVI, SVI, NUTS, ...
* :func:`plot_clients`: how each client's factor moves ``q`` (``q`` against each client's cavity).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from numpyro.distributions.transforms import IdentityTransform, IndependentTransform

__all__ = ["plot_clients", "plot_compare", "plot_history"]


def plot_history(
    result: Any,
    *,
    clients: Sequence[int] | None = None,
    tol: float | None = None,
    figsize: tuple | None = None,
) -> Any:
    """Plot a run's history: the global ELBO, how far each round moved ``q`` and each client's local
    free energy.

    The middle panel is ``RoundInfo.change`` (the largest change of a marginal mean in posterior
    sds, or of a marginal log sd) on a log scale, with ``tol`` as a dashed line: it shows a run
    still moving while its ELBO looks flat, and a run jittering at the Monte Carlo noise floor above
    ``tol`` (rounds where nothing was merged move ``q`` by 0 and leave a gap). Rounds where a
    client's update was rejected (``accepted < attempts``) are marked with a red ``x`` on that
    client's curve; rounds where a client was not visited (e.g. under
    :class:`~numpyro_pvi.Continual`) leave a gap.

    :param result: a :class:`~numpyro_pvi.PVIRunResult` (or its ``history``, a stacked
        :class:`~numpyro_pvi.RoundInfo`).
    :param clients: the clients whose free energy is drawn (default: all).
    :param float tol: the run's ``tol``, drawn on the change panel (default ``None``: no line).
    :param tuple figsize: the figure size in inches (default ``(14, 3.6)``, ``(10, 3.6)`` without a
        change).
    :return: the ``matplotlib.figure.Figure``.

    **Example:**

    .. doctest::

        >>> import numpy as np
        >>> import numpyro_pvi as pvi
        >>> from numpyro_pvi.results.plot import plot_history
        >>> history = pvi.RoundInfo(
        ...     elbo=np.array([-120.0, -80.0, -75.0]),
        ...     free_energy=-np.ones((3, 4)),
        ...     attempts=np.ones((3, 4)),
        ...     accepted=np.ones((3, 4)),
        ...     damping=np.ones((3, 4)),
        ...     clamped=np.zeros((3, 4)),
        ...     time=np.ones(3),
        ...     change=np.array([3.0, 0.2, 0.01]),
        ... )
        >>> fig = plot_history(history, tol=0.05)
        >>> [ax.get_title() for ax in fig.axes]
        ['Global ELBO', 'Change of q per round', 'Local free energy per client']
    """
    import matplotlib.pyplot as plt

    history = getattr(result, "history", result)
    if history is None or not hasattr(history, "elbo"):
        raise ValueError(
            "plot_history needs a PVIRunResult with a history (run at least one round)."
        )
    history = history.dense()  # a sampled run's (rounds, K) records over its clients' ids
    elbo = np.asarray(history.elbo, dtype=float)
    free_energy = np.atleast_2d(np.asarray(history.free_energy, dtype=float))
    rejected = np.asarray(history.attempts) > np.asarray(history.accepted)
    rounds = np.arange(1, elbo.shape[0] + 1)
    num_clients = free_energy.shape[1]
    clients = list(range(num_clients)) if clients is None else [int(m) for m in clients]
    panels = 2 if history.change is None else 3
    fig, axes = plt.subplots(
        1, panels, figsize=figsize or (4.7 * panels, 3.6), constrained_layout=True
    )
    ax_elbo, ax_local = axes[0], axes[-1]
    ax_elbo.plot(rounds, elbo, "o-", color="k", ms=3)
    ax_elbo.set(title="Global ELBO", xlabel="round", ylabel="ELBO")
    if history.change is not None:
        _plot_change(axes[1], rounds, np.asarray(history.change, dtype=float), tol)
    colors = _client_colors(num_clients)
    labelled = len(clients) <= 10
    for m in clients:
        ax_local.plot(
            rounds,
            free_energy[:, m],
            "o-",
            ms=2.5,
            lw=1,
            color=colors[m],
            label=f"client {m}" if labelled else None,
        )
        bad = rejected[:, m]
        if bad.any():
            floor = np.nanmin(free_energy) if np.isfinite(free_energy).any() else 0.0
            ax_local.plot(
                rounds[bad],
                np.nan_to_num(free_energy[bad, m], nan=floor),
                "x",
                color="red",
                ms=7,
                mew=2,
            )
    ax_local.set(title="Local free energy per client", xlabel="round", ylabel=r"$F_m$")
    if rejected[:, clients].any():
        ax_local.plot([], [], "x", color="red", mew=2, label="rejected update")
    if labelled or rejected[:, clients].any():
        ax_local.legend(fontsize="small", ncols=2 if len(clients) > 5 else 1)
    for ax in axes:
        ax.xaxis.get_major_locator().set_params(integer=True)
    return fig


def _plot_change(ax: Any, rounds: np.ndarray, change: np.ndarray, tol: float | None) -> None:
    """``RoundInfo.change`` per round on a log scale (a round that moved nothing leaves a gap),
    ``tol`` dashed."""
    ax.plot(rounds, np.where(change > 0, change, np.nan), "o-", color="C0", ms=3, label="change")
    if tol is not None:
        ax.axhline(tol, color="C3", ls="--", lw=1, label=f"tol = {tol:g}")
        ax.legend(fontsize="small")
    ax.set_yscale("log")
    ax.set(title="Change of q per round", xlabel="round", ylabel="posterior sds")


def plot_compare(
    posteriors: Mapping[str, Any],
    sites: Sequence[str] | Mapping[str, Sequence[int]] | None = None,
    *,
    max_panels: int = 12,
    ncols: int = 4,
    num_samples: int = 2000,
    figsize: tuple | None = None,
) -> Any:
    """Plot the marginal densities of chosen sites under several inference methods, e.g. PVI vs SVI
    vs NUTS.

    One panel per scalar coordinate (``w[0]``, ``w[1]``, ...); each method is a kernel density
    estimate of its samples, with its mean as a tick on the axis.

    :param posteriors: method label -> its posterior: a dict site -> samples ``(num_draws, *shape)``
        (e.g. ``mcmc.get_samples()`` or ``Predictive(guide, params=..., num_samples=...)(key)``), a
        :class:`~numpyro_pvi.PVIRunResult` (``num_samples`` draws from ``q`` are taken), a NumPyro
        ``MCMC`` object or an ``arviz.InferenceData``.
    :param sites: site names (every coordinate of each), or a dict site -> flat indices of the
        coordinates to show; default: the sites common to all methods.
    :param int max_panels: at most this many panels (the first coordinates in order).
    :param int ncols: panels per row.
    :param int num_samples: draws taken from a ``PVIRunResult``.
    :param tuple figsize: the figure size (default: 2.6 x 2.2 inches per panel).
    :return: the ``matplotlib.figure.Figure``.

    **Example:**

    .. doctest::

        >>> import numpy as np
        >>> from numpyro_pvi.results.plot import plot_compare
        >>> rng = np.random.default_rng(0)
        >>> fig = plot_compare(
        ...     {
        ...         "PVI": {"w": rng.normal(0.0, 1.0, (500, 3))},
        ...         "NUTS": {"w": rng.normal(0.1, 1.2, (500, 3))},
        ...     },
        ...     sites=["w"],
        ... )
        >>> [ax.get_title() for ax in fig.axes]
        ['w[0]', 'w[1]', 'w[2]']
    """
    if not posteriors:
        raise ValueError(
            "plot_compare needs at least one posterior, e.g. {'PVI': result, 'NUTS': mcmc}."
        )
    draws = {label: _as_samples(post, num_samples) for label, post in posteriors.items()}
    panels = _compare_panels(draws, sites)[:max_panels]
    return _draw_compare(panels, list(draws), ncols, figsize)


def plot_clients(
    result: Any,
    sites: Sequence[str] | Mapping[str, Sequence[int]] | None = None,
    *,
    max_coords: int = 4,
    figsize: tuple | None = None,
) -> Any:
    """Show how each client's factor moves ``q``: ``q`` against every client's cavity ``q / t_m``.

    For each chosen coordinate of the flat unconstrained vector ``zeta`` (one column), the top panel
    draws ``q``'s marginal (black) and each client's cavity (``q`` without that client's factor,
    coloured): the further a cavity lies from ``q``, the more that client's data move the posterior.
    The bottom panel splits ``q``'s precision into the prior's share (with ``t_0``) and each
    client's share ``prec(t_m) / prec(q)``; the shares sum to 1, and a negative share is an improper
    factor that widens ``q``.

    :param result: a :class:`~numpyro_pvi.PVIRunResult`.
    :param sites: site names, or a dict site -> flat indices into the site's unconstrained value;
        default: all global sites.
    :param int max_coords: at most this many coordinates (columns).
    :param tuple figsize: the figure size (default: 3 x 5 inches per column).
    :return: the ``matplotlib.figure.Figure``.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp, optax, numpyro, numpyro.distributions as dist
        >>> from jax import random
        >>> import numpyro_pvi as pvi
        >>> from numpyro_pvi.results.plot import plot_clients
        >>> def model(x, y=None):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pvi.partition_plate("data", x.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
        >>> x, y = jnp.zeros(30), 1.0 + random.normal(random.PRNGKey(0), (30,))
        >>> inference = pvi.PVI(
        ...     model,
        ...     pvi.MeanFieldGaussian(),
        ...     partitions=[jnp.arange(0, 10), jnp.arange(10, 30)],
        ...     local_update=pvi.GradientUpdate(optax.adam(0.05), num_steps=200),
        ...     server=pvi.Sequential(),
        ... )
        >>> result = inference.run(random.PRNGKey(1), 2, x, y=y, progress_bar=False)
        >>> fig = plot_clients(result)
        >>> fig.axes[0].get_title()
        'mu'
    """
    import matplotlib.pyplot as plt

    if getattr(result, "state", None) is None or getattr(result, "config", None) is None:
        raise TypeError(
            f"plot_clients expects the PVIRunResult of PVI.run, got {type(result).__name__}."
        )
    coords = _flat_coordinates(result.sites, sites)[:max_coords]
    q, cavities, factor_prec = _client_marginals(result)
    colors = _client_colors(len(cavities))
    ncols = len(coords)
    fig, axes = plt.subplots(
        2,
        ncols,
        figsize=figsize or (3.0 * ncols, 5.0),
        squeeze=False,
        constrained_layout=True,
        gridspec_kw={"height_ratios": [3, 2]},
    )
    for col, (title, i) in enumerate(coords):
        _draw_cavities(
            axes[0, col], title, q, [(loc[i], var[i]) for loc, var, _ in cavities], i, colors
        )
        _draw_precision_shares(axes[1, col], factor_prec[:, i] / q[2][i], colors)
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside right upper", fontsize="small")
    axes[1, 0].set_ylabel("share of q's precision")
    return fig


# ----------------------------------------------------------------------------- helpers


def _selection(
    sites: Sequence[str] | Mapping[str, Sequence[int]] | None, default: Sequence[str]
) -> dict:
    """The chosen sites as a dict site -> flat indices (``None``: all of them); ``default`` when
    ``sites`` is None."""
    if sites is None:
        return {name: None for name in default}
    if isinstance(sites, Mapping):
        return {name: list(idx) for name, idx in sites.items()}
    return {name: None for name in sites}


def _coordinate_title(name: str, shape: tuple, i: int) -> str:
    """``name`` for a scalar site, else ``name[i, j, ...]`` for its flat index ``i``."""
    return name if shape == () else f"{name}[{','.join(map(str, np.unravel_index(i, shape)))}]"


def _compare_panels(draws: dict, sites: Sequence[str] | Mapping[str, Sequence[int]] | None) -> list:
    """``(title, {label: 1-d samples})`` of every chosen coordinate, checking each site is in every
    method."""
    common = [name for name in next(iter(draws.values())) if all(name in d for d in draws.values())]
    selection = _selection(sites, common)
    for name in selection:
        missing = [label for label, d in draws.items() if name not in d]
        if missing:
            raise ValueError(
                f"plot_compare: site '{name}' is missing from {missing}; common sites: {common}."
            )
    panels = []
    for name, indices in selection.items():
        shape = np.asarray(next(iter(draws.values()))[name]).shape[1:]
        for i in range(int(np.prod(shape, dtype=int))) if indices is None else indices:
            panels.append(
                (
                    _coordinate_title(name, shape, i),
                    {
                        label: np.asarray(d[name]).reshape(np.shape(d[name])[0], -1)[:, i]
                        for label, d in draws.items()
                    },
                )
            )
    if not panels:
        raise ValueError("plot_compare: no coordinate to plot.")
    return panels


def _draw_compare(panels: list, labels: list, ncols: int, figsize: tuple | None) -> Any:
    """The figure of :func:`plot_compare`: one density panel per ``(title, values)``, unused axes
    hidden."""
    import matplotlib.pyplot as plt

    ncols = max(1, min(ncols, len(panels)))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=figsize or (2.6 * ncols, 2.2 * nrows),
        squeeze=False,
        constrained_layout=True,
    )
    colors = dict(zip(labels, _method_colors(len(labels))))
    for ax, (title, values) in zip(axes.flat, panels):
        _draw_densities(ax, title, values, colors)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    fig.legend(
        *axes.flat[0].get_legend_handles_labels(), loc="outside right upper", fontsize="small"
    )
    return fig


def _draw_densities(ax: Any, title: str, values: dict, colors: dict) -> None:
    """One :func:`plot_compare` panel: each method's density estimate, with its mean as a tick on
    the axis."""
    for label, x in values.items():
        grid, density = _kde(np.asarray(x, dtype=float))
        ax.plot(grid, density, color=colors[label], lw=1.5, label=label)
        ax.plot([np.mean(x)], [0.0], "|", color=colors[label], ms=10, mew=2, clip_on=False)
    ax.set_title(title)
    ax.set_yticks([])
    ax.set_ylim(bottom=0.0)


def _client_marginals(result: Any) -> tuple[Any, list, np.ndarray]:
    """``q``'s marginals, each client's cavity marginals and each client's factor precision ``(M,
    D)``."""
    family, state, num_clients = result.family, result.state, int(result.num_clients)
    factors = [_index(state.factors, m) for m in range(num_clients)]
    factor_prec = np.stack([family.marginals(t).precision for t in factors])
    cavities = [family.marginals(_sub(state.q, t)) for t in factors]
    return family.marginals(state.q), cavities, factor_prec


def _draw_cavities(ax: Any, title: str, q: Any, cavities: list, i: int, colors: list) -> None:
    """Top :func:`plot_clients` panel: ``q``'s marginal of coordinate ``i`` and each proper cavity's
    ``(loc, var)``."""
    q_loc, q_var = q[0][i], q[1][i]
    sd = np.sqrt(q_var)
    proper = [
        (m, loc, var) for m, (loc, var) in enumerate(cavities) if np.isfinite(var) and var > 0
    ]
    spread = [q_loc - 4 * sd, q_loc + 4 * sd]
    for _, loc, var in proper:
        spread += [loc - 3 * np.sqrt(var), loc + 3 * np.sqrt(var)]
    grid = np.linspace(min(spread), max(spread), 400)
    for m, loc, var in proper:
        ax.plot(
            grid,
            _normal_pdf(grid, loc, var),
            color=colors[m],
            lw=1,
            alpha=0.85,
            label=f"without client {m}" if len(cavities) <= 10 else None,
        )
    ax.plot(grid, _normal_pdf(grid, q_loc, q_var), color="k", lw=2.2, label="q")
    ax.set_title(title)
    ax.set_yticks([])
    ax.set_ylim(bottom=0.0)


def _draw_precision_shares(bars: Any, share: np.ndarray, colors: list) -> None:
    """Bottom :func:`plot_clients` panel: the prior's and each client's share of ``q``'s
    precision."""
    num_clients = len(share)
    bars.bar(
        np.arange(-1, num_clients),
        np.concatenate([[1.0 - np.sum(share)], share]),
        color=["0.6"] + [colors[m] for m in range(num_clients)],
    )
    bars.axhline(0.0, color="k", lw=0.8)
    bars.set_xticks(
        np.arange(-1, num_clients),
        ["prior"] + [str(m) if num_clients <= 12 or m % 5 == 0 else "" for m in range(num_clients)],
        fontsize="small",
    )
    bars.set_xlabel("client")


def _as_samples(posterior: Any, num_samples: int) -> dict:
    """Any supported posterior -> dict site -> numpy samples ``(num_draws, *shape)``."""
    import jax

    if hasattr(posterior, "sample_posterior") and hasattr(posterior, "state"):  # PVIRunResult
        samples = posterior.sample_posterior(jax.random.PRNGKey(0), num_samples)  # in model order
        return {k: np.asarray(v) for k, v in samples.items()}
    if hasattr(posterior, "get_samples"):  # numpyro MCMC
        return {k: np.asarray(v) for k, v in posterior.get_samples().items()}
    if hasattr(posterior, "posterior"):  # arviz InferenceData
        post = posterior.posterior
        return {k: post[k].values.reshape((-1,) + post[k].values.shape[2:]) for k in post.data_vars}
    if isinstance(posterior, Mapping):
        return {k: np.asarray(v) for k, v in posterior.items()}
    raise TypeError(
        f"plot_compare: cannot read samples from {type(posterior).__name__}; give a dict site -> "
        "samples, a PVIRunResult, an MCMC object or an arviz.InferenceData."
    )


def _kde(x: np.ndarray, num_points: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian kernel density estimate with Silverman's bandwidth on a grid around ``x``."""
    x = x[np.isfinite(x)]
    sd = np.std(x)
    iqr = np.subtract(*np.percentile(x, [75, 25])) / 1.349
    spread = min(sd, iqr) if iqr > 0 else sd
    bandwidth = 0.9 * max(spread, 1e-12) * len(x) ** -0.2
    grid = np.linspace(x.min() - 3 * bandwidth, x.max() + 3 * bandwidth, num_points)
    density = np.zeros_like(grid)
    for chunk in np.array_split(x, max(1, len(x) // 2000)):
        density += np.exp(-0.5 * ((grid[:, None] - chunk[None, :]) / bandwidth) ** 2).sum(axis=1)
    return grid, density / (len(x) * bandwidth * np.sqrt(2 * np.pi))


def _normal_pdf(x: np.ndarray, loc: float, var: float) -> np.ndarray:
    return np.exp(-0.5 * (x - loc) ** 2 / var) / np.sqrt(2 * np.pi * var)


def _index(nat: Any, m: int) -> Any:
    return jax.tree.map(lambda leaf: np.asarray(leaf, dtype=np.float64)[m], nat)


def _sub(a: Any, b: Any) -> Any:
    return jax.tree.map(
        lambda x, y: np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64), a, b
    )


def _flat_coordinates(
    model_sites: Any, sites: Sequence[str] | Mapping[str, Sequence[int]] | None
) -> list:
    """``(title, flat index)`` of the chosen coordinates of ``zeta``."""
    by_name = {s.name: s for s in model_sites.globals}
    slices = model_sites.slices()
    out = []
    for name, indices in _selection(sites, list(by_name)).items():
        if name not in by_name:
            raise ValueError(
                f"plot_clients: '{name}' is not a global site; the global sites are "
                f"{list(by_name)}."
            )
        site = by_name[name]
        transform = site.transform
        while isinstance(transform, IndependentTransform):
            transform = transform.base_transform
        suffix = "" if isinstance(transform, IdentityTransform) else " (unconstrained)"
        for i in range(site.size) if indices is None else indices:
            out.append(
                (_coordinate_title(name, site.flat_shape, i) + suffix, slices[name].start + int(i))
            )
    if not out:
        raise ValueError("plot_clients: no coordinate to plot.")
    return out


def _client_colors(num_clients: int) -> list:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if num_clients <= 10 else "viridis"]
    return [
        cmap(m if num_clients <= 10 else m / max(num_clients - 1, 1)) for m in range(num_clients)
    ]


def _method_colors(num_methods: int) -> list:
    import matplotlib

    return [matplotlib.colormaps["tab10"](i % 10) for i in range(num_methods)]
