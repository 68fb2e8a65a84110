"""Marking and splitting the data plate that PVI partitions across clients.

A model marks the plate that holds its data with :func:`partition_plate`. Outside PVI it is exactly
a
:class:`numpyro.plate`; under PVI each client sees only its own rows of that plate.

Data reaches the clients in one of two ways:

* **pooled data + index partitions** (simulation): ``partitions=[idx_1, ..., idx_M]`` from
  :func:`split_iid` / :func:`split_by_label`. Every array argument whose leading axis has the
  partition plate's size is sliced by each client's indices; every other argument is shared.
* **federated data**: ``partitions=ClientData([(args_1, kwargs_1), ...])``. Client ``m`` calls the
  model with its own arguments only; nothing is pooled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import numpyro

PARTITION_TAG = "_pvi_partition"
# (outer, inner): a partition plate inside another of another name
NESTED_TAG = "_pvi_nested_partition"


class partition_plate(numpyro.plate):
    """A :class:`numpyro.plate` that marks the plate PVI splits across clients.

    Use it exactly like ``numpyro.plate``; size it from the data (``X.shape[0]``) so that each
    client's model call sees its own number of rows.

    :param str name: name of the plate.
    :param int size: size of the plate (the number of data rows).
    :param int subsample_size: as in ``numpyro.plate`` (not supported under PVI, which batches
        with ``GradientUpdate(batch_size=...)`` instead).
    :param int dim: as in ``numpyro.plate``.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> import numpyro_pvi as pvi
        >>> def model(x, y=None):
        ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pvi.partition_plate("data", x.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # numpyro.contrib.funsor.plate_to_enum_plate (used by TraceEnum_ELBO) swaps
        # numpyro.plate.__new__ for funsor's enumeration plate, and on exit leaves a __new__ that
        # builds a plain numpyro.plate whatever the subclass: inside, be funsor's plate (needed for
        # enumeration); outside, be a partition_plate.
        new = numpyro.plate.__dict__.get("__new__")
        if new is not None:
            plate = new(numpyro.plate, *args, **kwargs)
            if not isinstance(plate, numpyro.plate):
                return plate
        return object.__new__(cls)

    def process_message(self, msg: dict) -> None:
        super().process_message(msg)
        if msg["type"] == "sample":
            # Tag (on a copy: the user's `infer` dict is never mutated) every sample site inside; a
            # site already tagged by an inner partition plate of another name records both (refused
            # when the model is read).
            infer = {**(msg.get("infer") or {}), PARTITION_TAG: self.name}
            inner = (msg.get("infer") or {}).get(PARTITION_TAG)
            if inner is not None and inner != self.name:
                infer[NESTED_TAG] = (self.name, inner)
            msg["infer"] = infer


# ----------------------------------------------------------------------------- splitting helpers


def split_iid(rng_key: jax.Array, num_data: int, num_clients: int) -> list[np.ndarray]:
    """Split ``range(num_data)`` uniformly at random into ``num_clients`` near-equal parts.

    :return: a list of ``num_clients`` sorted integer index arrays that cover every row once.

    **Example:** ``parts = pvi.split_iid(random.PRNGKey(0), num_data=100, num_clients=4)``
    """
    num_data, num_clients = (
        _positive_int(num_data, "num_data"),
        _positive_int(num_clients, "num_clients"),
    )
    if num_clients > num_data:
        raise ValueError(f"num_clients={num_clients} is larger than num_data={num_data}.")
    perm = np.asarray(jax.random.permutation(rng_key, num_data))
    return [np.sort(p) for p in np.array_split(perm, num_clients)]


def split_by_label(
    rng_key: jax.Array, labels: Any, num_clients: int, alpha: float = 0.5
) -> list[np.ndarray]:
    """Non-iid split with Dirichlet label skew (Hsu et al. 2019; used by Ashman et al. 2022).

    For every class, its rows are shared among clients in proportions drawn from
    ``Dirichlet(alpha * ones(num_clients))``: small ``alpha`` gives each client few labels, large
    ``alpha`` approaches an iid split. Every client receives at least one row.

    :param labels: integer class labels, shape ``(num_data,)``.
    :return: a list of ``num_clients`` sorted index arrays that cover every row once.

    **Example:** ``parts = pvi.split_by_label(random.PRNGKey(0), y, num_clients=10, alpha=0.5)``
    """
    labels = np.asarray(labels)
    num_clients = _positive_int(num_clients, "num_clients")
    if labels.ndim != 1:
        raise ValueError(f"labels must be one-dimensional, got shape {labels.shape}.")
    if num_clients > labels.shape[0]:
        raise ValueError(
            f"num_clients={num_clients} is larger than the number of labels {labels.shape[0]}."
        )
    if not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha}.")
    rng = np.random.default_rng(np.asarray(jax.random.key_data(rng_key)).ravel())
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        shares = rng.dirichlet(alpha * np.ones(num_clients))
        cuts = (np.cumsum(shares)[:-1] * len(rows)).astype(int)
        for m, chunk in enumerate(np.split(rows, cuts)):
            parts[m].extend(chunk.tolist())
    # Give an empty client one row from the largest client, so that every client has data.
    for m in range(num_clients):
        if not parts[m]:
            donor = max(range(num_clients), key=lambda k: len(parts[k]))
            parts[m].append(parts[donor].pop())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


class ClientData(Sequence):
    """Per-client model arguments for federated PVI: client ``m`` calls ``model(*args_m,
    **kwargs_m)``.

    Every client must pass arguments of the same structure; array arguments whose leading axis is
    the client's partition-plate size are its rows, other arguments must have equal shapes.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro_pvi as pvi
        >>> data = pvi.ClientData(
        ...     [
        ...         ((jnp.ones((5, 2)),), {"y": jnp.ones(5)}),
        ...         ((jnp.ones((3, 2)),), {"y": jnp.zeros(3)}),
        ...     ]
        ... )
        >>> len(data)
        2
    """

    def __init__(self, clients: Sequence[tuple[tuple, dict]]) -> None:
        clients = list(clients)
        if not clients:
            raise ValueError("ClientData needs at least one client.")
        for m, entry in enumerate(clients):
            if not (
                isinstance(entry, tuple)
                and len(entry) == 2
                and isinstance(entry[0], tuple)
                and isinstance(entry[1], dict)
            ):
                raise TypeError(
                    f"ClientData entry {m} must be a pair (args: tuple, kwargs: dict), got "
                    f"{type(entry)}."
                )
        self._clients = clients

    def __getitem__(self, m: int) -> tuple[tuple, dict]:
        return self._clients[m]

    def __len__(self) -> int:
        return len(self._clients)

    def __repr__(self) -> str:
        return f"ClientData(num_clients={len(self)})"


# ----------------------------------------------------------------------------- padded client data


class ArgsLayout(NamedTuple):
    """How a client's array leaves become ``(args, kwargs)``: the tree structure and the static
    leaves.

    It holds no data, so it can be shipped to a remote client without anyone else's rows.
    """

    treedef: Any
    static: tuple  # (position, value) of each non-array leaf

    def build(self, arrays: Sequence) -> tuple[tuple, dict]:
        """Rebuild ``(args, kwargs)`` of one client from its array leaves."""
        leaves: list = list(arrays)
        for pos, value in self.static:
            leaves.insert(pos, value)
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def array_names(self) -> list[str]:
        """How the user wrote each array leaf, for messages: ``"y"``, ``"argument 0"``,
        ``"batch['x']"``.

        **Example:** for ``model(X, y=y)``, ``layout.array_names()`` is ``["argument 0", "y"]``.
        """
        fixed = {pos for pos, _ in self.static}
        positions = [i for i in range(self.treedef.num_leaves) if i not in fixed]
        paths, _ = jax.tree_util.tree_flatten_with_path(
            jax.tree_util.tree_unflatten(self.treedef, list(range(self.treedef.num_leaves)))
        )
        return [_argument_name(paths[i][0]) for i in positions]


def _argument_name(path: tuple) -> str:
    """``(args, kwargs)``'s key path -> ``"argument 0"``, ``"y"``, ``"batch['x']"``."""
    if len(path) < 2:
        return jax.tree_util.keystr(path)
    head, rest = path[1], jax.tree_util.keystr(path[2:])
    name = f"argument {head.idx}" if isinstance(head, jax.tree_util.SequenceKey) else str(head.key)
    return name + rest


def check_partitions(partitions: Sequence, num_data: int, plate_name: str) -> np.ndarray:
    """Raise ``ValueError`` unless ``partitions`` are integer arrays covering ``range(num_data)``
    once; return their concatenation (the rows in client order).

    Vectorised over the clients (one pass of NumPy over the concatenated indices), so a million
    small clients are checked in about a second.
    """
    if len(partitions) == 0:
        raise ValueError("partitions is empty: give at least one client.")
    index = [np.asarray(idx) for idx in partitions]
    for m, idx in enumerate(index):
        if idx.ndim != 1 or idx.size == 0 or idx.dtype.kind not in "iu":
            raise ValueError(
                f"partition {m} must be a non-empty 1-d integer index array, got shape "
                f"{idx.shape} and dtype {idx.dtype}."
            )
    flat = np.concatenate(index)
    outside = (flat < 0) | (flat >= num_data)
    if outside.any():
        ends = np.cumsum([idx.size for idx in index])
        m = int(np.searchsorted(ends, np.flatnonzero(outside)[0], side="right"))
        raise ValueError(
            f"partition {m} has indices outside range(0, {num_data}) of plate '{plate_name}'."
        )
    seen = np.bincount(flat, minlength=num_data)
    if (seen > 1).any():
        rows = np.flatnonzero(seen > 1)
        raise ValueError(
            f"partitions overlap: {len(rows)} rows of plate '{plate_name}' belong to more than "
            f"one client (first: {rows[:5].tolist()})."
        )
    if (seen == 0).any():
        rows = np.flatnonzero(seen == 0)
        raise ValueError(
            f"partitions miss {len(rows)} rows of plate '{plate_name}' (first: "
            f"{rows[:5].tolist()}); every row must belong to one client."
        )
    return flat


def pad_rows(x: Any, rows: int) -> np.ndarray:
    """A client's row array padded to ``rows`` rows with copies of its last real row.

    Padded rows are masked out of every density, but the model still evaluates them: copies of a
    real row keep them finite whatever the model does with them (a zero used as a scale would not).
    """
    x = np.asarray(x)
    if x.shape[0] == 0:
        raise ValueError("A client holds no rows.")
    return (
        np.concatenate([x, np.repeat(x[-1:], rows - x.shape[0], axis=0)])
        if rows > x.shape[0]
        else x
    )


def stack_clients(
    columns: Sequence[Sequence],
    is_row: Sequence[bool],
    sizes: Sequence[int],
    rows: int,
    capacity: int,
) -> list:
    """Stack each array leaf over clients (``(capacity, ...)``), padding row leaves to ``rows``
    rows.

    :param columns: for each array leaf, its value in every client.
    :param capacity: client slots; the slots past ``len(sizes)`` repeat client 0 (they hold no real
        row).

    A row leaf is padded as :func:`pad_rows` pads it, in one gather over its concatenated rows
    (no Python step per client: a million clients stack in seconds).
    """
    out = []
    for column, row in zip(columns, is_row):
        values = _padded_rows(column, rows) if row else np.stack([np.asarray(x) for x in column])
        if capacity > len(values):
            values = np.concatenate([values, np.repeat(values[:1], capacity - len(values), 0)])
        # device_put, not jnp.asarray: the latter compiles a copy in a fresh process
        out.append(jax.device_put(values))
    return out


class PooledRows(Sequence):
    """One row leaf of every client, read from the pooled array: client ``m``'s rows are
    ``rows[order[starts[m]:][:lengths[m]]]`` (``order``: the partitions concatenated). Pooled data
    split by partitions hold no array per client and no copy of the data, so a million clients
    split, bucket and stack in vectorised NumPy (one gather per bucket).

    **Example:** ``PooledRows(X, [len(p) for p in parts], order=np.concatenate(parts))[1]`` is
    ``X[parts[1]]``.
    """

    def __init__(
        self,
        rows: np.ndarray,
        lengths: Sequence[int],
        starts: np.ndarray | None = None,
        order: np.ndarray | None = None,
    ):
        self.rows, self.lengths = rows, np.asarray(lengths, np.int64)
        self.starts = np.cumsum(self.lengths) - self.lengths if starts is None else starts
        self.order = np.arange(len(rows)) if order is None else order

    def __getitem__(self, m: int) -> np.ndarray:
        start = int(self.starts[m])
        return self.rows[self.order[start : start + int(self.lengths[m])]]

    def __len__(self) -> int:
        return len(self.lengths)

    def take(self, ids: np.ndarray) -> PooledRows:
        """The clients ``ids``' rows (the same pooled array)."""
        return PooledRows(self.rows, self.lengths[ids], self.starts[ids], self.order)


def take_clients(column: Sequence, ids: Sequence[int]) -> Sequence:
    """The values of the clients ``ids`` in one leaf's ``column``."""
    if isinstance(column, PooledRows):
        return column.take(np.asarray(ids, np.int64))
    return [column[m] for m in ids]


def _padded_rows(column: Sequence, rows: int) -> np.ndarray:
    """``np.stack([pad_rows(x, rows) for x in column])``, as one gather."""
    if isinstance(column, PooledRows):
        source, order, lengths, starts = column.rows, column.order, column.lengths, column.starts
    else:
        lengths = np.fromiter((np.shape(x)[0] for x in column), np.int64, len(column))
        source, order, starts = None, None, np.cumsum(lengths) - lengths
    if lengths.min() == 0:
        raise ValueError("A client holds no rows.")
    if lengths.max() > rows:
        raise ValueError(f"A client holds {lengths.max()} rows, more than the {rows} padded rows.")
    take = starts[:, None] + np.minimum(np.arange(rows)[None, :], lengths[:, None] - 1)
    if source is None:
        return np.take(np.concatenate([np.asarray(x) for x in column]), take, axis=0)
    return np.take(source, np.take(order, take), axis=0)


def is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def same_static(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a boolean equality are compared by identity
        return a is b


def _positive_int(value: Any, name: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)
