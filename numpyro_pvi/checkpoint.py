"""Saving and loading a ``PVIState`` so that a long federated run can stop and resume exactly.

The state's arrays go into one ``.npz`` file next to the pickled tree structure of the state, so any
local update's per-client state round-trips. Load only files you trust (the structure is a pickle).

A save never destroys the previous checkpoint: the file is written next to it under a temporary name
and renamed over it only once complete (``os.replace`` is atomic). A checkpoint records what it was made
for (the global sites and their shapes, the family, the server, the number of clients), and loading it
for a different set-up is a ``ValueError`` naming the difference.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import tempfile
from typing import Any

import jax
import numpy as np

from numpyro_pvi.families import SiteFamilies
from numpyro_pvi.problem import Problem
from numpyro_pvi.results import PVIRunResult
from numpyro_pvi.state import PVIState

FORMAT = "numpyro_pvi.PVIState/3"  # 3: what the checkpoint was made for


def made_for(inference: Any, problem: Problem) -> dict:
    """What a state belongs to: the global sites (name, shape), the family, the server, the clients."""
    return {"sites": [[s.name, list(s.shape)] for s in problem.sites.globals],
            "family": repr(inference.family) if isinstance(inference.family, SiteFamilies)
            else type(inference.family).__name__, "server": repr(inference.server),
            "num_clients": problem.num_clients, "capacity": problem.capacity}


def save(obj: PVIState | PVIRunResult, path: str | os.PathLike, inference: Any = None,
         problem: Problem | None = None) -> None:
    """Write a state (or a run's result, its state) to ``path`` (a ``.npz`` file), atomically.

    :param obj: a :class:`~numpyro_pvi.PVIState`, or a :class:`~numpyro_pvi.PVIRunResult` (which also
        records what it was made for).
    :param inference, problem: the :class:`~numpyro_pvi.PVI` and :class:`~numpyro_pvi.Problem` the state
        belongs to, recorded so that :func:`load` can check them (taken from a result).

    **Example:** ``pvi.save(result, "run.npz"); state = pvi.load("run.npz", inference, result.problem)``
    """
    if isinstance(obj, PVIRunResult):
        state, inference, problem = obj.state, obj.inference, obj.problem
    elif isinstance(obj, PVIState):
        state = obj
    else:
        raise TypeError(f"save expects a PVIState or a PVIRunResult, got {type(obj).__name__}; nothing was written.")
    info = made_for(inference, problem) if inference is not None and problem is not None else {}
    leaves, treedef = jax.tree_util.tree_flatten(state)
    arrays = {f"leaf_{i}": np.asarray(jax.device_get(leaf)) for i, leaf in enumerate(leaves)}
    structure = np.frombuffer(pickle.dumps(treedef), dtype=np.uint8)
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".pvi-checkpoint-", suffix=".npz")
    try:
        with os.fdopen(handle, "wb") as f:  # an open file keeps numpy from appending ".npz" to the name
            np.savez(f, _format=np.array(FORMAT), _structure=structure, _made_for=np.array(json.dumps(info)),
                     **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def load(path: str | os.PathLike, inference: Any = None, problem: Problem | None = None) -> PVIState:
    """Read a state written by :func:`save`; resuming from it continues exactly as the saved run would.

    :param inference, problem: if given, the checkpoint must have been made for this set-up (the same
        global sites and shapes, family, server and clients); a difference is a ``ValueError`` naming it.

    **Example:** ``state = pvi.load("run.npz", inference, inference.build(X, y=y))``, then
    ``inference.run(key, 10, X, y=y, init_state=state)``.
    """
    with open(path, "rb") as f:
        data = np.load(io.BytesIO(f.read()), allow_pickle=False)
    if "_format" not in data or str(data["_format"]) != FORMAT:
        raise ValueError(f"{os.fspath(path)!r} is not a numpyro_pvi checkpoint (expected format {FORMAT}).")
    if inference is not None and problem is not None:
        _check_made_for(json.loads(str(data["_made_for"])), made_for(inference, problem), path)
    treedef = pickle.loads(data["_structure"].tobytes())
    leaves = [jax.numpy.asarray(data[f"leaf_{i}"]) for i in range(treedef.num_leaves)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _check_made_for(saved: dict, current: dict, path: str | os.PathLike) -> None:
    if not saved:
        raise ValueError(f"{os.fspath(path)!r} does not record what it was made for (saved from a bare state): load "
                         "it without inference and problem to skip the check.")
    differences = [f"{key}: saved {saved.get(key)!r}, now {value!r}" for key, value in current.items()
                   if saved.get(key) != value]
    if differences:
        raise ValueError(f"{os.fspath(path)!r} was made for a different set-up: " + "; ".join(differences) + ".")
