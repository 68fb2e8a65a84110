"""From the user's data to the clients' stacked arrays: which leaves are rows, each client's size.

Every client's model arguments are flattened to leaves. *Row leaves* carry the partition plate's
rows on their leading axis; the others (*shared leaves*) are the same shape in every client;
non-array leaves are static (:class:`~numpyro_pvi.model.partition.ArgsLayout`). The model is traced
once,
on the pooled data or on client 0's, and every other client is checked against that structure by its
arguments' shapes alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from numpyro_pvi.local_updates.base import Client
from numpyro_pvi.model.partition import (
    ArgsLayout,
    PooledRows,
    check_partitions,
    is_array,
    same_static,
    stack_clients,
    take_clients,
)


class ClientColumns(NamedTuple):
    """The clients' data before stacking: for each array leaf, its value in every client.

    :ivar columns: ``columns[i][m]`` is array leaf ``i`` of client ``m``.
    :ivar is_row: whether array leaf ``i`` is a row leaf.
    :ivar sizes: each client's number of rows.
    :ivar layout: rebuilds one client's ``(args, kwargs)`` from its array leaves.
    :ivar unsure: clients whose shapes alone do not settle which leaves are rows (a leaf with client
        0's number of rows and the same shape in every client, while their sizes differ): their
        model call must be traced (abstractly) to be checked.
    """

    columns: list
    is_row: tuple
    sizes: tuple
    layout: ArgsLayout
    unsure: tuple = ()


def split_pooled(
    args: tuple, kwargs: dict, partitions: Sequence, num_data: int, plate: str
) -> ClientColumns:
    """Pooled arguments split by index ``partitions``: leaves with ``num_data`` leading rows are
    sliced."""
    flat = check_partitions(partitions, num_data, plate)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    static = tuple((i, x) for i, x in enumerate(leaves) if not is_array(x))
    arrays = [x for x in leaves if is_array(x)]
    is_row = tuple(np.ndim(x) >= 1 and np.shape(x)[0] == num_data for x in arrays)
    if not any(is_row):
        raise ValueError(
            f"No model argument has a leading axis of size {num_data} (the size of partition "
            f"plate '{plate}'), so there are no rows to split across clients."
        )
    sizes = [len(p) for p in partitions]
    # one gather of the rows in client order, sliced per client (no array per client)
    columns = [
        PooledRows(np.asarray(x), sizes, order=flat) if row else [x] * len(sizes)
        for x, row in zip(arrays, is_row)
    ]
    return ClientColumns(columns, is_row, tuple(sizes), ArgsLayout(treedef, static))


def split_client_data(
    clients: Sequence[tuple[tuple, dict]], first_size: int, plate: str
) -> ClientColumns:
    """Per-client arguments checked against client 0's, whose model call has ``first_size`` rows.

    A leaf is a row leaf if its leading axis is each client's size; a client's size is the leading
    axis of the first leaf that has ``first_size`` rows in client 0 and another shape in some
    client.
    """
    flat = [jax.tree_util.tree_flatten(c) for c in clients]
    treedef = flat[0][1]
    for m, (_, other) in enumerate(flat):
        if other != treedef:
            raise ValueError(
                f"ClientData: client {m}'s arguments have structure {other}, but client 0's have "
                f"{treedef}; every client must pass the same arguments (a missing observation, "
                "e.g. y=None, or an extra argument makes a different model call)."
            )
    leaves = [f[0] for f in flat]
    static = []
    for i, value in enumerate(leaves[0]):
        if not is_array(value):
            if any(not same_static(c[i], value) for c in leaves[1:]):
                raise ValueError(
                    f"ClientData: non-array argument leaf {i} differs between clients ({value!r} "
                    "vs ...); give per-client values as arrays."
                )
            static.append((i, value))
    positions = [i for i, v in enumerate(leaves[0]) if is_array(v)]
    columns = [[c[i] for c in leaves] for i in positions]
    sizes = _client_sizes(columns, first_size, plate)
    is_row = tuple(
        all(np.ndim(x) >= 1 and np.shape(x)[0] == n for x, n in zip(col, sizes)) for col in columns
    )
    for i, (col, row) in enumerate(zip(columns, is_row)):
        if not row and len({np.shape(x) for x in col}) > 1:
            m = next(m for m, x in enumerate(col) if np.shape(x) != np.shape(col[0]))
            raise ValueError(
                f"ClientData: client {m}'s array argument {i} has shape {np.shape(col[m])}, but "
                f"it is neither a row array of plate '{plate}' ({sizes[m]} rows in that client) "
                f"nor of client 0's shape {np.shape(col[0])}."
            )
    return ClientColumns(
        columns, is_row, sizes, ArgsLayout(treedef, tuple(static)), _unsure(columns, sizes)
    )


def check_row_shapes(split: ClientColumns, clients: Sequence[int], plate: str) -> None:
    """Each of ``clients``' row arguments has client 0's shape past its rows axis, so that its rows
    are data of the kind the model was read on (client 0's call, or the pooled data's); a
    ``ValueError`` names the client and the argument otherwise (e.g. ``y`` of shape ``(n, 1)`` where
    client 0's is ``(n,)``: under a plate of ``n`` it would broadcast to ``n * n`` likelihood
    terms).

    **Example:** ``check_row_shapes(split, range(1, len(split.sizes)), "data")``.
    """
    names = split.layout.array_names()
    for column, row, name in zip(split.columns, split.is_row, names):
        want = np.shape(column[0])[1:]
        for m in clients if row else ():
            if np.shape(column[m])[1:] != want:
                raise ValueError(
                    f"Client {m}'s data does not fit the model: its row argument '{name}' has "
                    f"shape {np.shape(column[m])}, rows of shape {np.shape(column[m])[1:]}, but "
                    f"client 0's rows are of shape {want} ({np.shape(column[0])} in all). Every "
                    f"client's row arguments of plate '{plate}' must have the same shape past the "
                    "rows axis (e.g. y of shape (n,) in every client, not (n, 1))."
                )


def _unsure(columns: list, sizes: tuple) -> tuple:
    """The clients whose size differs from client 0's while some leaf keeps client 0's row count and
    shape."""
    same = [
        col
        for col in columns
        if np.ndim(col[0]) >= 1
        and np.shape(col[0])[0] == sizes[0]
        and len({np.shape(x) for x in col}) == 1
    ]
    return tuple(m for m, n in enumerate(sizes) if n != sizes[0]) if same else ()


def _client_sizes(columns: list, first_size: int, plate: str) -> tuple:
    candidates = [
        col for col in columns if np.ndim(col[0]) >= 1 and np.shape(col[0])[0] == first_size
    ]
    if not candidates:
        raise ValueError(
            f"No model argument of client 0 has a leading axis of size {first_size} (the size of "
            f"partition plate '{plate}'): size the plate from the data (e.g. X.shape[0])."
        )
    anchor = next((col for col in candidates if len({np.shape(x) for x in col}) > 1), candidates[0])
    sizes = tuple(int(np.shape(x)[0]) if np.ndim(x) >= 1 else -1 for x in anchor)
    for col in candidates:
        for m, (x, n) in enumerate(zip(col, sizes)):
            if np.shape(x) != np.shape(col[0]) and (np.ndim(x) < 1 or np.shape(x)[0] != n):
                raise ValueError(
                    f"ClientData: client {m}'s row arguments disagree on its number of rows "
                    f"({np.shape(x)[0] if np.ndim(x) else 'a scalar'} vs {n}): every row argument "
                    f"of plate '{plate}' must have one row per datum."
                )
    if min(sizes) < 1:
        m = int(np.argmin(sizes))
        raise ValueError(f"ClientData: client {m} holds no rows of plate '{plate}'.")
    return sizes


def stack(split: ClientColumns, rows: int | None = None, capacity: int | None = None) -> Client:
    """The clients as one :class:`Client` with a leading client axis of ``capacity`` slots.

    Row leaves are padded to ``rows`` (default: the largest client) with copies of a real row and
    masked.
    """
    rows = max(split.sizes) if rows is None else rows
    capacity = len(split.sizes) if capacity is None else capacity
    arrays = stack_clients(split.columns, split.is_row, split.sizes, rows, capacity)
    sizes = np.zeros(capacity, np.int32)
    sizes[: len(split.sizes)] = split.sizes
    # the mask built in NumPy and sent as it is: an eager JAX operation (jnp.asarray too) compiles
    # in a fresh process
    mask, sizes = jax.device_put((np.arange(rows)[None, :] < sizes[:, None], sizes))
    return Client(arrays, mask, sizes)


class Bucket(NamedTuple):
    """Clients of similar size stacked together: their data padded to the bucket's largest client.

    :ivar clients: the bucket's clients as one :class:`Client` (a leading axis of ``len(ids)``
        clients).
    :ivar ids: ``(n,)`` the bucket's clients' ids (their slots in the state); ``-1`` for a
        placeholder (a masked copy of a client that holds no rows, kept so that shapes grow
        geometrically).
    """

    clients: Client
    ids: np.ndarray


class SlotIndex(NamedTuple):
    """Where each client slot's data are in the buckets, worked out once per problem (not once per
    round: a round's work must not grow with the number of clients).

    :ivar bucket_of: ``(capacity,)`` the bucket of each client slot.
    :ivar row_of: ``(capacity,)`` its row in that bucket.
    :ivar padding_order: per bucket, its rows in the order a sampled group is padded with them:
        its real clients first, then its placeholders.

    **Example:** ``slot_index(problem.buckets, problem.capacity).bucket_of[m]``.
    """

    bucket_of: np.ndarray
    row_of: np.ndarray
    padding_order: tuple


def slot_index(buckets: Sequence[Bucket], capacity: int) -> SlotIndex:
    """The :class:`SlotIndex` of ``buckets`` over ``capacity`` client slots."""
    bucket_of, row_of = np.zeros(capacity, int), np.zeros(capacity, int)
    for b, bucket in enumerate(buckets):
        real = np.flatnonzero(bucket.ids >= 0)
        bucket_of[bucket.ids[real]], row_of[bucket.ids[real]] = b, real
    order = tuple(np.argsort(bucket.ids < 0, kind="stable") for bucket in buckets)
    return SlotIndex(bucket_of, row_of, order)


# a bucket (a compiled shape, a vmapped call) must save this share of all rows of padding: as many
# padded rows as the split holds, since each bucket compiles its own client update (seconds, the
# start-up of a run) while a round's padding costs a step a few microseconds a row; a Dirichlet(0.3)
# split of 1,000 clients (benchmarks/startup.py) then has 2 buckets (25,135 padded rows) instead of
# 5 (13,936 rows) at 0.1, and starts within 1.5x of an even split instead of 2.5x
BUCKET_OVERHEAD = 1.0
# ... and at least this many rows: a bucket compiles its own client update (seconds to minutes,
# once), while a padded row costs microseconds a round; on a few hundred rows one bucket always wins
# (the sweep's skewed splits)
MIN_BUCKET_SAVING = 1024


def buckets(
    split: ClientColumns,
    by_size: bool,
    rows: int | None = None,
    capacity: int | None = None,
    grow: bool = False,
) -> tuple:
    """The clients in :class:`Bucket` s, so that a round's work follows the rows each client holds.

    With ``by_size``, clients of ``n`` rows start in the bucket of the power of two ``>= n`` and
    neighbouring buckets are merged while a separate bucket saves less than ``BUCKET_OVERHEAD`` of
    all rows of padding, or less than ``MIN_BUCKET_SAVING`` rows (the fewest compiled shapes for the
    padded rows, :func:`bucket_ranges`: each bucket compiles its own client update, which a few
    hundred padded rows never pay back); each bucket is padded to its largest client. One client of
    9,901 rows and 99 of one row make two buckets, 9,901 rows and 99 rows, instead of 100 clients of
    9,901 rows. Otherwise one bucket holds every client slot (``capacity``), padded to ``rows``
    (default: the largest client), as :func:`stack` does. With ``grow`` (clients joining one by
    one), a bucket's rows and clients are padded to powers of two, so that its shapes, and the
    compiled steps, change only when it doubles.
    """
    if not by_size:
        capacity = len(split.sizes) if capacity is None else capacity
        return (Bucket(stack(split, rows, capacity), np.arange(capacity)),)
    sizes = np.asarray(split.sizes)
    # the power of two >= n: 2 ** bit_length(n - 1), which frexp's exponent is (exact below 2**53)
    bound = np.left_shift(1, np.frexp(sizes - 1)[1].astype(np.int64))
    units = np.unique(bound)
    counts, largest = (
        [int(np.sum(bound == b)) for b in units],
        [int(sizes[bound == b].max()) for b in units],
    )
    out = []
    for lo, hi in bucket_ranges(
        counts, largest, max(BUCKET_OVERHEAD * sizes.sum(), MIN_BUCKET_SAVING)
    ):
        ids = np.flatnonzero((bound >= units[lo]) & (bound <= units[hi - 1]))
        part = ClientColumns(
            [take_clients(col, ids) for col in split.columns],
            split.is_row,
            tuple(int(n) for n in sizes[ids]),
            split.layout,
        )
        slots = 1 << (len(ids) - 1).bit_length() if grow else len(ids)
        # placeholders: size 0, no row
        out.append(
            Bucket(
                stack(part, int(units[hi - 1]) if grow else None, slots),
                np.concatenate([ids, -np.ones(slots - len(ids), int)]),
            )
        )
    return tuple(out)


def bucket_ranges(counts: list, largest: list, overhead: float) -> list:
    """Ranges ``[lo, hi)`` of the size units (ascending; ``counts[i]`` clients, the largest of
    ``largest[i]`` rows) that minimise the padded rows plus ``overhead`` per bucket (dynamic
    programming over the units).

    **Example:** ``bucket_ranges([99, 1], [1, 9901], 1000.0)`` is ``[(0, 1), (1, 2)]``.
    """
    best, cut = [0.0] + [np.inf] * len(counts), [0] * (len(counts) + 1)
    for hi in range(1, len(counts) + 1):
        for lo in range(hi):
            cost = best[lo] + sum(counts[lo:hi]) * largest[hi - 1] + overhead
            if cost < best[hi]:
                best[hi], cut[hi] = cost, lo
    ranges, hi = [], len(counts)
    while hi > 0:
        ranges.append((cut[hi], hi))
        hi = cut[hi]
    return ranges[::-1]


def append_client(split: ClientColumns, args: tuple, kwargs: dict, plate: str) -> ClientColumns:
    """``split`` with one more client holding ``model(*args, **kwargs)``'s data, checked like the
    others."""
    clients = [
        split.layout.build([col[m] for col in split.columns]) for m in range(len(split.sizes))
    ]
    return split_client_data([*clients, (args, kwargs)], split.sizes[0], plate)
