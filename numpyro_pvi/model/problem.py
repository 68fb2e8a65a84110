"""The problem: everything built from the data, once, in one immutable object.

:func:`build_problem` reads the model (one trace, on the pooled data or client 0's), splits and
stacks the clients' data, finds the exact Gaussian part of the prior, and compiles the round's steps
(:mod:`numpyro_pvi.server.steps`). A :class:`Problem` never changes: :meth:`PVI.add_client` makes a
new
one. Steps are compiled per data *structure*, so a problem built from new arrays of the same shapes
and dtypes reuses an earlier problem's steps without recompiling.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.backends.local import VmapBackend
from numpyro_pvi.config import PVIConfig
from numpyro_pvi.families import FactorFamily, Family, NatParams
from numpyro_pvi.local_updates.base import Client, ClientProblem, LocalUpdate
from numpyro_pvi.model.clients import (
    Bucket,
    ClientColumns,
    SlotIndex,
    append_client,
    buckets,
    check_row_shapes,
    slot_index,
    split_client_data,
    split_pooled,
    stack,
)
from numpyro_pvi.model.densities import local_model, log_likelihood, log_prior
from numpyro_pvi.model.partition import ClientData, pad_rows, take_clients
from numpyro_pvi.model.prior import exact_prior
from numpyro_pvi.model.sites import (
    ModelSites,
    check_observed,
    plate_and_locals,
    read_model,
    read_padded,
)
from numpyro_pvi.server.steps import Steps, compile_steps


@dataclass(frozen=True, eq=False)
class Problem:
    """A model and its data, read, split over clients, stacked and compiled (immutable).

    :ivar family: the configuration's family laid out for these sites (``config.family.lay_out``):
        the family every step, update and result of this problem uses; ``config.family`` itself is
        the user's, never laid out (e.g. an unlaid :class:`~numpyro_pvi.SiteFamilies`).
    :ivar sites: the model's sites (local sites with a padded client's shapes).
    :ivar buckets: the clients' data in :class:`~numpyro_pvi.model.clients.Bucket` s of similar
        sizes (each a stacked :class:`~numpyro_pvi.local_updates.Client`, rows padded with copies of
        a real row and masked): by size with the ``"vmap"`` backend and no local latent sites, so a
        round costs what the clients' rows cost; else one bucket of every client slot, padded to the
        largest client.
    :ivar split: the clients' unpadded data (:class:`~numpyro_pvi.model.clients.ClientColumns`).
    :ivar client_problem: what a local update needs
        (:class:`~numpyro_pvi.local_updates.ClientProblem`).
    :ivar prior: natural parameters of the exact Gaussian part of the prior.
    :ivar rest: the global sites whose prior is fitted by the prior factor ``t_0``.
    :ivar steps: the compiled steps (:class:`~numpyro_pvi.server.steps.Steps`).
    :ivar signature: the data's structure; problems with equal signatures share ``steps``.
    :ivar source: the argument leaves it was built from (held, so that their identity stays
        meaningful).
    :ivar config: the :class:`~numpyro_pvi.config.PVIConfig` it was built with; its steps hold
        its objects, so only a ``PVI`` with the same objects
        (:data:`~numpyro_pvi.config.COMPILED_FIELDS`) may use this problem.

    **Example:** ``problem = config.build(X, y=y)``; ``problem.num_clients``,
    ``problem.sites.dim``; ``config.init(key, problem)`` and ``config.update(state, problem)``
    take it in place of the data.
    """

    family: FactorFamily
    sites: ModelSites
    buckets: tuple
    split: ClientColumns
    client_problem: ClientProblem
    prior: NatParams
    rest: tuple
    steps: Steps
    signature: tuple
    slots: int
    source: tuple = ()
    config: PVIConfig | None = None

    @property
    def num_clients(self) -> int:
        """The number of clients."""
        return len(self.split.sizes)

    @property
    def capacity(self) -> int:
        """Client slots in the state (at least ``num_clients``)."""
        return self.slots

    @property
    def rows(self) -> int:
        """The padded rows of the largest bucket."""
        return max(int(b.clients.mask.shape[1]) for b in self.buckets)

    @cached_property
    def clients(self) -> Client:
        """Every client's data as one :class:`~numpyro_pvi.local_updates.Client` with a leading axis
        of ``capacity`` client slots, rows padded to the largest client (built on first use when the
        clients are bucketed by size)."""
        if len(self.buckets) == 1 and np.array_equal(self.buckets[0].ids, np.arange(self.capacity)):
            return self.buckets[0].clients
        return stack(self.split, self.rows, self.capacity)

    @cached_property
    def slot_index(self) -> SlotIndex:
        """Where each client slot's data are in :attr:`buckets`
        (:class:`~numpyro_pvi.model.clients.SlotIndex`), worked out once for every round."""
        return slot_index(self.buckets, self.capacity)

    def elbo_sample(self, num_clients: int | None) -> tuple[tuple, float]:
        """The clients' data a pooled ELBO pass runs over (one stacked
        :class:`~numpyro_pvi.local_updates.Client` per bucket) and the scale of their terms' sum:
        every client and 1 for ``None`` or ``num_clients >= M``; else a uniform sample of
        ``num_clients`` clients without replacement (seed 0: the same every round, and cached) and
        ``M / num_clients``, which makes the sum an unbiased estimate of all ``M`` clients'.

        **Example:** ``clients, scale = problem.elbo_sample(10_000)``.
        """
        if num_clients is None or num_clients >= self.num_clients:
            return tuple(bucket.clients for bucket in self.buckets), 1.0
        if self.sites.has_local:
            raise ValueError(
                f"num_elbo_clients={num_clients}: a model with local latent sites "
                f"({[s.name for s in self.sites.locals]}) passes over every client's guide; leave "
                "num_elbo_clients=None."
            )
        cache = self.__dict__.setdefault("_elbo_samples", {})
        if num_clients not in cache:
            chosen = np.sort(
                np.random.default_rng(0).choice(self.num_clients, num_clients, replace=False)
            )
            part = ClientColumns(
                [take_clients(column, chosen) for column in self.split.columns],
                self.split.is_row,
                tuple(int(self.split.sizes[m]) for m in chosen),
                self.split.layout,
            )
            cache[num_clients] = tuple(b.clients for b in buckets(part, by_size=True))
        return cache[num_clients], self.num_clients / num_clients

    @property
    def sizes(self) -> np.ndarray:
        """Each client's number of rows."""
        return np.asarray(self.split.sizes)


def build_problem(
    config: PVIConfig, args: tuple, kwargs: dict, reuse: Problem | None = None
) -> Problem:
    """Read ``config.model`` on the data ``(args, kwargs)`` and build the :class:`Problem`.

    :param reuse: an earlier problem whose compiled steps are reused if the data have the same
        structure.

    **Example:** ``problem = pvi.model.problem.build_problem(inference.config, (X,), {"y": y})``
    (what ``inference.build(X, y=y)`` does).
    """
    family, sites, split = _read(config, args, kwargs)
    config.server.check_clients(len(split.sizes))
    return _assemble(
        config, family, sites, split, max(split.sizes), len(split.sizes), (args, kwargs), reuse
    )


def add_client(config: PVIConfig, problem: Problem, args: tuple, kwargs: dict) -> Problem:
    """``problem`` with one more client holding ``model(*args, **kwargs)``'s data.

    Capacity (client slots and padded rows) grows geometrically, so adding clients one by one
    recompiles only when it grows.
    """
    split = append_client(problem.split, args, kwargs, problem.sites.plate)
    # the others: when they joined
    check_clients(config.model, problem.sites, split, [len(split.sizes) - 1])
    rows, capacity = problem.rows, problem.capacity
    if split.sizes[-1] > rows:
        rows = max(split.sizes[-1], 2 * rows)
    if len(split.sizes) > capacity:
        capacity = 2 * capacity
    return _assemble(
        config,
        problem.family,
        problem.sites,
        split,
        rows,
        capacity,
        problem.source + ((args, kwargs),),
        problem,
        grow=True,
    )


def _read(
    config: PVIConfig, args: tuple, kwargs: dict
) -> tuple[FactorFamily, ModelSites, ClientColumns]:
    """The family laid out for the model's sites, the sites (one trace) and the clients' split
    data."""
    model, partitions = config.model, config.partitions
    if isinstance(partitions, ClientData):
        if args or kwargs:
            raise TypeError(
                "partitions=ClientData: each client holds its own data, so pass no data arguments "
                "to init/update/run."
            )
        first_args, first_kwargs = partitions[0]
        family, sites = config.family.lay_out(
            read_model(model, first_args, first_kwargs, who="Client 0's data")
        )
        split = split_client_data(partitions, sites.plate_size, sites.plate)
        # client 0's: checked by read_model
        check_clients(model, sites, split, range(1, len(split.sizes)))
        return family, sites, split
    if not args and not kwargs:
        raise TypeError(
            "Pass the pooled data to init/update/run (or give partitions=pvi.ClientData(...))."
        )
    family, sites = config.family.lay_out(read_model(model, args, kwargs, who="The pooled data"))
    parts = [np.arange(sites.plate_size)] if partitions is None else list(partitions)
    return family, sites, split_pooled(args, kwargs, parts, sites.plate_size, sites.plate)


def check_clients(
    model: Any, sites: ModelSites, split: ClientColumns, clients: Sequence[int]
) -> None:
    """The checks of every path that takes a client's data without reading the model on it
    (``ClientData``'s clients past the first, :meth:`PVI.add_client`): its row arguments have client
    0's shape past the rows (:func:`~numpyro_pvi.model.clients.check_row_shapes`), its partition
    plate has
    as many rows as its row arguments, and its observations are finite and in their likelihood's
    support. The data the model is read on (the pooled data, client 0's, a Flower site's own) get
    the same checks from
    :func:`~numpyro_pvi.model.sites.read_model`, so every client's data passes one set of checks.

    **Example:** ``check_clients(model, problem.sites, split, [3])`` before client 3 joins.
    """
    clients = list(clients)
    check_row_shapes(split, clients, sites.plate)
    _check_unsure(model, sites, split, clients)
    _check_observations(sites, split, clients)


def _check_observations(sites: ModelSites, split: ClientColumns, clients: Sequence[int]) -> None:
    """The observations of ``clients`` are finite and in their likelihood's support (observations
    the model computes from its arguments are checked only where the model was read: the pooled data
    or client 0's)."""
    clients = list(clients)
    for observed in sites.observed:
        if not clients or observed.source is None or not split.is_row[observed.source]:
            continue
        column = [np.asarray(split.columns[observed.source][m]) for m in clients]
        inside = np.asarray(observed.support(jnp.asarray(np.concatenate(column))))
        starts = np.cumsum([0] + [len(x) for x in column])
        for i, (m, values) in enumerate(zip(clients, column)):
            check_observed(
                observed.name,
                {"fn": observed},
                bool(np.all(np.isfinite(values))),
                bool(np.all(inside[starts[i] : starts[i + 1]])),
                f"Client {m}'s data",
            )


def _check_unsure(
    model: Any, sites: ModelSites, split: ClientColumns, clients: Sequence[int]
) -> None:
    """Trace (abstractly) those of ``clients`` whose rows their arguments' shapes do not settle."""
    for m in set(split.unsure) & set(clients):
        size, _ = plate_and_locals(
            model,
            sites,
            *split.layout.build([col[m] for col in split.columns]),
            who=f"Client {m}'s data",
        )
        if size != split.sizes[m]:
            raise ValueError(
                f"Client {m}'s data does not fit the model: partition_plate '{sites.plate}' has "
                f"size {size} in its model call, but its row arguments have {split.sizes[m]} rows."
            )


# a round's compiled step holds the old state and the new one at least (no buffer donation)
STATE_COPIES = 2


def factor_bytes(family: Any, dim: int) -> int:
    """Bytes of one factor (one set of natural parameters) of ``family`` over ``dim`` coordinates,
    read from the shapes of ``family.zeros(dim)`` without allocating it: ``4 D (D + 1)`` for a
    full-rank Gaussian in float32, ``8 D`` for a mean-field one.

    **Example:** ``factor_bytes(pvi.FullRankGaussian(), 20_000)`` is 1,600,080,000 (1.6 GB).
    """
    shapes = jax.eval_shape(lambda: family.zeros(dim))
    return sum(
        int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(shapes)
    )


def state_bytes(family: Any, dim: int, num_clients: int) -> int:
    """A lower bound on the memory a run needs: ``q``, the prior factor and ``num_clients`` client
    factors (:func:`factor_bytes` each), held ``STATE_COPIES`` times while a round's step runs.

    **Example:** ``state_bytes(pvi.FullRankGaussian(), 20_000, 4)`` is about 19 GB.
    """
    return STATE_COPIES * (num_clients + 2) * factor_bytes(family, dim)


def available_memory() -> int:
    """Bytes the run can still allocate: the default JAX device's free memory where it reports one
    (GPU), else the host's ``MemAvailable`` (``/proc/meminfo``), else its free pages
    (``os.sysconf``)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(family: Any, dim: int, num_clients: int) -> None:
    """Refuse, before anything compiles, a run whose state cannot fit (:func:`state_bytes` against
    :func:`available_memory`), with a ``MemoryError`` that gives both figures; a full-rank family at
    ``D = 20,000`` otherwise died in XLA with a raw out-of-memory error.

    **Example:** ``check_memory(pvi.FullRankGaussian(), problem.sites.dim, problem.capacity)``.
    """
    needed, available = state_bytes(family, dim, num_clients), available_memory()
    if needed > available:
        raise MemoryError(
            f"{family!r} over D = {dim} coordinates with {num_clients} client factors needs at "
            f"least {needed / 1e9:.2f} GB ({num_clients + 2} factors of "
            f"{factor_bytes(family, dim) / 1e9:.3g} GB, q and the prior's included, times "
            f"{STATE_COPIES} copies while a round runs), but only {available / 1e9:.2f} GB are "
            "available. Use pvi.MeanFieldGaussian(), or pvi.SiteFamilies with a FullRankGaussian "
            "block only on the sites that need correlations, or fewer clients."
        )


# the first client of a stack, in one compiled call (eager indexing compiles two programs a leaf)
def _first_client(split: ClientColumns, bucket: Bucket) -> list:
    """The array leaves of the bucket's first slot (a real client, padded to the bucket's rows as
    :func:`~numpyro_pvi.model.clients.stack` pads it), in NumPy: slicing the stacked arrays would
    compile in a fresh process."""
    client, rows = int(bucket.ids[0]), int(bucket.clients.mask.shape[1])
    return [
        pad_rows(column[client], rows) if row else np.asarray(column[client])
        for column, row in zip(split.columns, split.is_row)
    ]


def _assemble(
    config: PVIConfig,
    family: FactorFamily,
    sites: ModelSites,
    split: ClientColumns,
    rows: int,
    capacity: int,
    source: tuple,
    reuse: Problem | None,
    grow: bool = False,
) -> Problem:
    check_memory(family, sites.dim, capacity)
    by_size = isinstance(config.backend, VmapBackend) and not sites.has_local
    bucketed = buckets(split, by_size, rows, capacity, grow)
    first_client = bucketed[0].clients
    first = split.layout.build(_first_client(split, bucketed[0]))
    sites = read_padded(config.model, sites, *first, int(first_client.mask.shape[1]))
    prior, rest = exact_prior(
        family,
        sites,
        lambda zeta, names: log_prior(config.model, sites, zeta, *first, names=names),
    )
    signature = _signature(sites, split, bucketed, rest)
    if reuse is not None and _same(reuse.signature, signature):
        # the same sites, so the same layout: the steps were compiled with the reused family
        family, client_problem, steps = reuse.family, reuse.client_problem, reuse.steps
    else:
        client_problem = _client_problem(config, family, sites, split)
        steps = compile_steps(config, client_problem, split.layout, rest)
    return Problem(
        family,
        sites,
        bucketed,
        split,
        client_problem,
        prior,
        rest,
        steps,
        signature,
        capacity,
        source,
        config,
    )


def _client_problem(
    config: PVIConfig, family: FactorFamily, sites: ModelSites, split: ClientColumns
) -> ClientProblem:
    """The client problem (``family``: the laid-out one); its functions hold the model and the
    argument layout only, never data."""
    model, layout = config.model, split.layout

    def client_loglik(zeta: jax.Array, client: Client, hyper: Any = ()) -> jax.Array:
        c_args, c_kwargs = layout.build(client.arrays)
        return log_likelihood(model, sites, zeta, c_args, c_kwargs, client.mask, hyper)

    def client_local_model(zeta: jax.Array, client: Client, hyper: Any = ()) -> None:
        c_args, c_kwargs = layout.build(client.arrays)
        local_model(model, sites, zeta, c_args, c_kwargs, client.mask, hyper)

    _check_support(config.local_update, sites, family)
    return ClientProblem(
        family,
        sites.dim,
        client_loglik,
        split.is_row,
        sites,
        client_local_model if sites.has_local else None,
    )


def _check_support(local_update: LocalUpdate, sites: ModelSites, family: Any) -> None:
    """Refuse a model whose local latents, hyperparameters or family the local update cannot
    handle (what it declares in :class:`~numpyro_pvi.local_updates.LocalUpdate`'s class
    attributes)."""
    name = type(local_update).__name__
    # the family contract the update declares it needs
    contract = FactorFamily if local_update.supports_factor_families else Family
    if not isinstance(family, contract):
        raise NotImplementedError(
            f"{name} needs a Gaussian family (MeanFieldGaussian or FullRankGaussian), not "
            f"{family!r}: it does not set supports_factor_families = True. Every local update of "
            "the library supports every family (docs/families.md)."
        )
    if sites.has_local and not local_update.supports_local_latents:
        names = [s.name for s in sites.locals] + list(sites.enumerated)
        raise NotImplementedError(
            f"{name} does not support local latent variables (sites {names} inside partition "
            f"plate '{sites.plate}'); use pvi.GradientUpdate."
        )
    if sites.hyper and not local_update.supports_hyperparameters:
        raise NotImplementedError(
            f"{name} does not support hyperparameters (numpyro.param sites "
            f"{[h.name for h in sites.hyper]}); use pvi.GradientUpdate."
        )


def _signature(sites: ModelSites, split: ClientColumns, bucketed: tuple, rest: tuple) -> tuple:
    """What the compiled steps depend on: the sites' structure, the layout, the stacked shapes and
    dtypes."""
    site_structure = (
        sites.plate,
        sites.plate_size,
        tuple((s.name, s.shape, s.flat_shape, s.transform) for s in sites.globals),
        sites.likelihoods,
        tuple((s.name, s.flat_shape, s.row_axis) for s in sites.locals),
        sites.enumerated,
        tuple(h.name for h in sites.hyper),
    )
    shapes = tuple((a.shape, a.dtype) for b in bucketed for a in b.clients.arrays)
    return site_structure, split.layout.treedef, split.layout.static, split.is_row, shapes, rest


def _same(a: tuple, b: tuple) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - static leaves without a boolean equality: not the same
        return False
