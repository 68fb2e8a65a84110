"""Saving and loading a ``PVIState`` so that a long federated run can stop and resume exactly,
without pickle.

**Format** ``numpyro_pvi.PVIState/4``: one ``.npz`` file, read with ``np.load(allow_pickle=False)``,
holding the state's arrays (``leaf_0``, ``leaf_1``, ...) and ``_structure``, a JSON description of
the state's tree: ``null`` (None), ``{"tuple": [...]}``, ``{"list": [...]}``, ``{"dict": [[key,
node], ...]}`` (string or integer keys), ``{"namedtuple": "module:qualname", "fields": [...],
"children": [...]}``, ``{"made_for": {...}}`` (the state's :class:`~numpyro_pvi.state.MadeFor`
record) and ``{"leaf": i, "shape": [...], "dtype": "float32"}`` (with ``"key": impl`` for a typed
JAX key). Loading builds only tuples, lists, dicts, None, arrays and named tuples of an allow-list:
the types of ``numpyro_pvi``, ``optax``, ``numpyro`` and ``jax`` (looked up among the modules
already imported, by their own namespace: nothing a file names is ever imported) and the types given
to :func:`register_state_type`; the type must be a ``NamedTuple`` with the fields saved. Anything
else is a ``ValueError``, so a crafted file cannot run code. Every array is checked against the
shape and dtype its description records.

Why a description, and not a template state (``inference.init``) to pour the arrays into: a
checkpoint must load without its :class:`~numpyro_pvi.PVI` (e.g. the Flower server's final ``q``),
and ``init`` can compile steps. The set-up is checked instead through the record each state carries
(:class:`~numpyro_pvi.state.MadeFor`: the global sites and their shapes, the family, the server, the
client slots): :func:`load` compares what it is given (family and server from ``config``, a
:class:`~numpyro_pvi.config.PVIConfig`; all of it with ``problem``) and ``PVI.update``/``run``
compare the rest when the state is resumed. A difference is a ``ValueError`` naming it.
:func:`save` refuses a state holding a node it could not load back (``TypeError``, nothing
written).

Files of the earlier formats (``numpyro_pvi.PVIState/1`` to ``/3``) stored the tree structure as a
pickle, which can run any code when read: they are refused by name, never unpickled.

A save never destroys the previous checkpoint: the file is written next to it under a temporary name
``.pvi-checkpoint-<host>-<pid>-<random>.npz`` and renamed over it only once complete (``os.replace``
is atomic). A save killed midway (``kill -9``) leaves its temporary behind; the next save into that
folder removes the temporaries of this host whose writer's process no longer exists (a concurrent
saver's stays), and those of the earlier formats' naming (no pid) untouched for an hour.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import sys
import tempfile
import time
import types
from dataclasses import replace
from typing import Any

import jax
import numpy as np

from numpyro_pvi.config import PVIConfig
from numpyro_pvi.model.problem import Problem
from numpyro_pvi.results.result import PVIRunResult
from numpyro_pvi.state import MadeFor, PVIState, family_name

# 4: the structure as JSON (1-3: a pickled tree structure, refused)
FORMAT = "numpyro_pvi.PVIState/4"
PICKLED_FORMATS = ("numpyro_pvi.PVIState/1", "numpyro_pvi.PVIState/2", "numpyro_pvi.PVIState/3")
# whose NamedTuple types a checkpoint may hold
ALLOWED_PACKAGES = ("numpyro_pvi", "optax", "numpyro", "jax")
TEMPORARY_PREFIX = ".pvi-checkpoint-"
# a temporary without a pid (the earlier naming) untouched this long is debris
OLD_TEMPORARY_AGE_S = 3600.0
_REGISTERED: dict[str, type] = {}


def register_state_type(cls: type) -> type:
    """Allow checkpoints to hold the ``NamedTuple`` type ``cls`` (e.g. your own local update's
    state).

    The types of ``numpyro_pvi``, ``optax``, ``numpyro`` and ``jax`` are allowed already. Usable as
    a class decorator.

    **Example:**

    .. doctest::

        >>> from typing import NamedTuple
        >>> import numpyro_pvi as pvi
        >>> @pvi.results.checkpoint.register_state_type
        ... class MyState(NamedTuple):
        ...     momentum: float
    """
    if not (isinstance(cls, type) and _is_named_tuple(cls)):
        raise TypeError(f"register_state_type takes a NamedTuple class, got {cls!r}.")
    _REGISTERED[_type_name(cls)] = cls
    return cls


def save(
    obj: PVIState | PVIRunResult,
    path: str | os.PathLike,
    config: PVIConfig | None = None,
    problem: Problem | None = None,
) -> None:
    """Write a state (or a run's result, its state) to ``path`` (a ``.npz`` file), atomically.

    The state records what it was made for (``PVIState.made_for``, stamped by ``PVI.init``), and so
    does the file.

    :param obj: a :class:`~numpyro_pvi.PVIState`, or a :class:`~numpyro_pvi.PVIRunResult`.
    :param config, problem: optionally, the configuration (``inference.config``) and the
        :class:`~numpyro_pvi.model.problem.Problem` the state belongs to: checked against its record
            (a
        ``ValueError`` naming the difference, nothing written), or recorded if the state has none (a
        state built by hand).

    **Example:** ``pvi.save(result, "run.npz"); state = pvi.load("run.npz", inference.config,
    result.problem)``
    """
    if isinstance(obj, PVIRunResult):
        state, config, problem = obj.state, obj.config, obj.problem
    elif isinstance(obj, PVIState):
        state = obj
    else:
        raise TypeError(
            f"save expects a PVIState or a PVIRunResult, got {type(obj).__name__}; nothing was "
            "written."
        )
    if config is not None and problem is not None:
        current = MadeFor.of(config, problem)
        if not state.made_for.known:
            state = state._replace(made_for=current)
        elif differences := state.made_for.differences(current):
            raise ValueError(
                "save: the state was made for another set-up than the configuration and problem "
                "given: " + "; ".join(differences) + "; nothing was written."
            )
    leaves: list = []
    structure = _describe(state, leaves)
    rebuilt = _build(json.loads(json.dumps(structure)), leaves, lambda leaf, _: leaf)
    if jax.tree_util.tree_structure(rebuilt) != jax.tree_util.tree_structure(state):
        raise TypeError(
            "save: the state's tree holds a node that loading would not rebuild as it is (a "
            "custom pytree node?); nothing was written."
        )
    arrays = {f"leaf_{i}": leaf for i, leaf in enumerate(leaves)}
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    _remove_stale_temporaries(folder)
    handle, temporary = tempfile.mkstemp(
        dir=folder, prefix=f"{TEMPORARY_PREFIX}{_host()}-{os.getpid()}-", suffix=".npz"
    )
    try:
        # an open file keeps numpy from appending ".npz" to the name
        with os.fdopen(handle, "wb") as f:
            np.savez(
                f, _format=np.array(FORMAT), _structure=np.array(json.dumps(structure)), **arrays
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def load(
    path: str | os.PathLike, config: PVIConfig | None = None, problem: Problem | None = None
) -> PVIState:
    """Read a state written by :func:`save`; resuming from it continues exactly as the saved run
    would.

    Nothing in the file is unpickled or imported (see the module's docstring); a file of the
    earlier, pickled formats is refused with a ``ValueError`` saying so.

    :param config: if given (``inference.config``), the checkpoint must have been made for its
        family and server.
    :param problem: with ``config``, also for its global sites (names and shapes) and client
        slots. Without it, those are checked when the state is resumed (``PVI.update``/``run``). A
        difference is a ``ValueError`` naming it.

    **Example:** ``state = pvi.load("run.npz", inference.config, inference.build(X, y=y))``, then
    ``inference.run(key, 10, X, y=y, init_state=state)``.
    """
    name = repr(os.fspath(path))
    with open(path, "rb") as f:
        try:
            data = np.load(io.BytesIO(f.read()), allow_pickle=False)
        # e.g. a pickle, which allow_pickle=False refuses
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(
                f"{name} is not a numpyro_pvi checkpoint (an .npz file): {e}"
            ) from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(
            f"{name} is not a numpyro_pvi checkpoint (it holds one array, not an .npz archive)."
        )
    found = _text(data, "_format")
    if found in PICKLED_FORMATS:
        raise ValueError(
            f"{name} is a checkpoint of the earlier format {found}, which stores the state's tree "
            "structure as a pickle: unpickling can run any code the file holds, so it is "
            "refused. Load it with the numpyro_pvi version that wrote it, in a trusted "
            "environment, and save it again with this one."
        )
    if found != FORMAT or "_structure" not in data:
        raise ValueError(
            f"{name} is not a numpyro_pvi checkpoint (expected format {FORMAT}, found {found})."
        )
    try:
        structure = json.loads(_text(data, "_structure"))
        count = _count_leaves(structure)
        stored = [f"leaf_{i}" for i in range(count)]
        if sorted(stored) != sorted(k for k in data.files if k.startswith("leaf_")):
            raise ValueError(
                f"its structure names {count} arrays, the file holds "
                f"{sum(k.startswith('leaf_') for k in data.files)}"
            )
        state = _build(structure, [data[k] for k in stored], _restored)
    except (ValueError, TypeError, KeyError, IndexError, RecursionError) as e:
        raise ValueError(f"{name} is not a loadable numpyro_pvi checkpoint: {e}.") from None
    if not isinstance(state, PVIState):
        raise ValueError(f"{name} does not hold a PVIState (its root is {type(state).__name__}).")
    if config is not None:
        _check_made_for(state.made_for, config, problem, name)
    return state


def _check_made_for(
    made_for: MadeFor, config: PVIConfig, problem: Problem | None, name: str
) -> None:
    if not made_for.known:
        raise ValueError(
            f"{name} does not record what it was made for (a state built by hand): load it "
            "without config and problem to skip the check."
        )
    if problem is not None:
        current = MadeFor.of(config, problem)
    # the sites and client slots need the problem: PVI.update/run check them when the state is
    # resumed
    else:
        current = replace(made_for, family=family_name(config.family), server=repr(config.server))
    differences = made_for.differences(current)
    if differences:
        raise ValueError(f"{name} was made for a different set-up: " + "; ".join(differences) + ".")


# ---------------------------------------------------------------------- the structure, as JSON


def _type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _is_named_tuple(cls: type) -> bool:
    return issubclass(cls, tuple) and any("_fields" in vars(base) for base in cls.__mro__)


def _text(data: Any, key: str) -> str | None:
    """The string stored under ``key`` in an .npz archive, None if there is none."""
    if key not in data.files:
        return None
    array = data[key]  # an object array (a pickle) is a ValueError under allow_pickle=False
    return str(array) if array.dtype.kind == "U" and array.ndim == 0 else None


def _describe(tree: Any, leaves: list) -> Any:
    """The JSON description of ``tree``; its leaves, as NumPy arrays, are appended to ``leaves`` (in
    order)."""
    if tree is None:
        return None
    if isinstance(tree, MadeFor):
        return {
            "made_for": {
                "sites": [[n, list(s)] for n, s in tree.sites],
                "family": tree.family,
                "server": tree.server,
                "capacity": tree.capacity,
            }
        }
    if _is_named_tuple(type(tree)):
        name = _type_name(type(tree))
        if name not in _REGISTERED and type(tree).__module__.split(".")[0] not in ALLOWED_PACKAGES:
            raise TypeError(
                f"save: the state holds a {name}, which a checkpoint does not load (only the "
                f"NamedTuple types of {', '.join(ALLOWED_PACKAGES)}): allow it with "
                "pvi.results.checkpoint.register_state_type; nothing was written."
            )
        return {
            "namedtuple": name,
            "fields": list(tree._fields),
            "children": [_describe(c, leaves) for c in tree],
        }
    if type(tree) in (tuple, list):
        return {type(tree).__name__: [_describe(c, leaves) for c in tree]}
    if type(tree) is dict:
        if not all(
            isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool)) for k in tree
        ):
            raise TypeError(
                f"save: a dict of the state has keys {list(tree)}; a checkpoint holds string or "
                "integer keys only; nothing was written."
            )
        return {"dict": [[k, _describe(v, leaves)] for k, v in tree.items()]}
    if not jax.tree_util.all_leaves([tree]):
        raise TypeError(
            f"save: the state holds a {type(tree).__name__} node, which a checkpoint does not "
            "hold (tuples, lists, dicts, None, NamedTuples and arrays); nothing was written."
        )
    array = _stored(tree)  # one transfer from the device
    leaves.append(array)
    node = {"leaf": len(leaves) - 1, "shape": list(np.shape(tree)), "dtype": str(array.dtype)}
    return {**node, "key": str(jax.random.key_impl(tree))} if _is_key(tree) else node


def _build(node: Any, leaves: list, restore: Any) -> Any:
    """The tree ``node`` describes, its leaves ``restore(leaves[i], node)``; a ValueError if it is
    malformed."""
    if node is None:
        return None
    if not isinstance(node, dict) or len(node) == 0:
        raise ValueError(f"malformed structure node {_short(node)}")
    kind = next(iter(node))
    if kind == "leaf":
        return restore(leaves[_int(node["leaf"])], node)
    if len(node) != {"namedtuple": 3}.get(kind, 1):
        raise ValueError(f"malformed structure node {_short(node)}")
    if kind in ("tuple", "list"):
        children = [_build(c, leaves, restore) for c in _list(node[kind])]
        return tuple(children) if kind == "tuple" else children
    if kind == "dict":
        items = [_list(item) for item in _list(node["dict"])]
        if any(len(item) != 2 or type(item[0]) not in (str, int) for item in items):
            raise ValueError(f"malformed dict node {_short(node)}")
        return {k: _build(v, leaves, restore) for k, v in items}
    if kind == "namedtuple":
        cls = _named_tuple_type(node["namedtuple"], _list(node["fields"]))
        return cls._make(_build(c, leaves, restore) for c in _list(node["children"]))
    if kind == "made_for":
        return _made_for(node["made_for"])
    raise ValueError(f"unknown structure node {_short(node)}")


#: 0.1's modules that 0.2 moved (CHANGELOG.md): a 0.1 checkpoint names its state types by their
#: old module, read here as the new one (a name, never an import)
MOVED_MODULES = {
    "numpyro_pvi.damping": "numpyro_pvi.server.damping",
    "numpyro_pvi.heavy_ball": "numpyro_pvi.server.heavy_ball",
    "numpyro_pvi.servers": "numpyro_pvi.server.servers",
    "numpyro_pvi.rounds": "numpyro_pvi.server.round",
    "numpyro_pvi.sampling": "numpyro_pvi.server.sampling",
    "numpyro_pvi.monitor": "numpyro_pvi.server.monitor",
    "numpyro_pvi.merge": "numpyro_pvi.server.merge",
    "numpyro_pvi.steps": "numpyro_pvi.server.steps",
    "numpyro_pvi.prior": "numpyro_pvi.model.prior",
    "numpyro_pvi.local_latents": "numpyro_pvi.model.local_latents",
    "numpyro_pvi.local_updates.dp_gradient": "numpyro_pvi.privacy.dp_sgd",
    "numpyro_pvi.local_updates.dp_averaging": "numpyro_pvi.privacy.local_averaging",
}


def _named_tuple_type(name: Any, fields: list) -> type:
    """The allowed NamedTuple type ``module:qualname``: registered, or of an allowed package's
    imported module."""
    if not isinstance(name, str):
        raise ValueError(f"malformed type name {_short(name)}")
    cls = _REGISTERED.get(name)
    if cls is None:
        module_name, _, qualname = name.partition(":")
        module_name = MOVED_MODULES.get(module_name, module_name)
        if module_name.split(".")[0] not in ALLOWED_PACKAGES:
            raise ValueError(
                f"it names the type {name!r}, which is not a state type a checkpoint may hold "
                f"(the NamedTuples of {', '.join(ALLOWED_PACKAGES)}, or "
                "pvi.results.checkpoint.register_state_type's)"
            )
        # never imported here: only what the running program has imported
        cls = sys.modules.get(module_name)
        for part in qualname.split("."):  # by the namespaces' own dicts: no module __getattr__ runs
            cls = vars(cls).get(part) if isinstance(cls, (type, types.ModuleType)) else None
        if not (isinstance(cls, type) and _is_named_tuple(cls)):
            raise ValueError(
                f"it names the type {name!r}, which is not a NamedTuple of a module imported now "
                "(import the module that defines it before loading)"
            )
    if list(cls._fields) != fields:
        raise ValueError(
            f"it saved {name} with the fields {fields}, which now has {list(cls._fields)}"
        )
    return cls


def _made_for(record: Any) -> MadeFor:
    try:
        sites = tuple(
            (n, tuple(_int(d) for d in _list(s)))
            for n, s in (_list(x) for x in _list(record["sites"]))
        )
        made_for = MadeFor(sites, record["family"], record["server"], _int(record["capacity"]))
    except (TypeError, KeyError, ValueError):
        raise ValueError(f"malformed made_for record {_short(record)}") from None
    if len(record) != 4 or not all(
        isinstance(s, str) for s in (made_for.family, made_for.server, *dict(sites))
    ):
        raise ValueError(f"malformed made_for record {_short(record)}")
    return made_for


def _count_leaves(node: Any) -> int:
    """How many leaves ``node`` describes, each index 0..n-1 once (a ValueError otherwise)."""
    indices: list = []
    _build(node, _Indices(indices), lambda i, _: i)
    if sorted(indices) != list(range(len(indices))):
        raise ValueError("its structure's array indices are not 0..n-1, each once")
    return len(indices)


class _Indices:
    """A stand-in for the leaves while counting them: item ``i`` is ``i``, recorded."""

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def __getitem__(self, i: int) -> int:
        self.seen.append(i)
        return i


def _restored(array: np.ndarray, node: dict) -> Any:
    """The leaf ``array`` as a JAX array, checked against its description's shape and dtype."""
    if set(node) - {"leaf", "shape", "dtype", "key"}:
        raise ValueError(f"malformed leaf node {_short(node)}")
    shape, dtype = [_int(n) for n in _list(node["shape"])], np.dtype(jax.numpy.dtype(node["dtype"]))
    if array.dtype != dtype and array.dtype.kind == "V" and array.dtype.itemsize == dtype.itemsize:
        array = array.view(dtype)  # e.g. bfloat16, which .npy stores as raw bytes
    key = node.get("key")
    if array.dtype != dtype or list(array.shape) != (
        shape + list(array.shape[len(shape) :]) if key else shape
    ):
        raise ValueError(
            f"array {node['leaf']} is {array.dtype}{list(array.shape)}, its description says "
            f"{dtype}{shape}"
        )
    if key is not None:
        return jax.random.wrap_key_data(jax.numpy.asarray(array), impl=str(key))
    return jax.numpy.asarray(array)


def _stored(leaf: Any) -> np.ndarray:
    array = np.asarray(jax.device_get(jax.random.key_data(leaf) if _is_key(leaf) else leaf))
    if array.dtype.hasobject:
        raise TypeError(
            f"save: the state holds an array of Python objects ({array.dtype}); nothing was "
            "written."
        )
    return array


def _is_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _list(x: Any) -> list:
    if not isinstance(x, list):
        raise ValueError(f"expected a list, found {_short(x)}")
    return x


def _int(x: Any) -> int:
    if type(x) is not int:
        raise ValueError(f"expected an integer, found {_short(x)}")
    return x


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------- temporaries of killed saves


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


TEMPORARY = re.compile(
    re.escape(TEMPORARY_PREFIX) + r"(?:(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-)?[a-z0-9_]+\.npz"
)


def _remove_stale_temporaries(folder: str) -> None:
    """Remove the temporaries in ``folder`` of saves that died (their process is gone) before
    renaming them."""
    if os.name != "posix":  # os.kill(pid, 0) probes a process only there
        return
    host = _host()
    for entry in os.scandir(folder):
        match = TEMPORARY.fullmatch(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        # the earlier naming: no pid to ask, but a live writer keeps touching its file
        if match["pid"] is None:
            stale = time.time() - entry.stat(follow_symlinks=False).st_mtime > OLD_TEMPORARY_AGE_S
        else:
            stale = match["host"] == host and not _alive(int(match["pid"]))
        if stale:
            try:
                os.remove(entry.path)
            except FileNotFoundError:  # another save removed it first
                pass


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    except OverflowError:
        return False
    return True
