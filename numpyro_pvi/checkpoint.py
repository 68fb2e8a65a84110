"""Saving and loading a ``PVIState`` so that a long federated run can stop and resume exactly.

The state's arrays go into one ``.npz`` file next to the pickled tree structure of the state, so any
local update's per-client state round-trips. Load only files you trust (the structure is a pickle).
"""

from __future__ import annotations

import io
import os
import pickle

import jax
import numpy as np

FORMAT = "numpyro_pvi.PVIState/2"  # 2: PVIState.hyper_grads


def save(state: object, path: str | os.PathLike) -> None:
    """Write ``state`` (a :class:`~numpyro_pvi.PVIState`) to ``path`` (a ``.npz`` file).

    **Example:** ``pvi.save(result.state, "run.npz"); state = pvi.load("run.npz")``
    """
    leaves, treedef = jax.tree_util.tree_flatten(state)
    arrays = {f"leaf_{i}": np.asarray(jax.device_get(leaf)) for i, leaf in enumerate(leaves)}
    structure = np.frombuffer(pickle.dumps(treedef), dtype=np.uint8)
    with open(path, "wb") as f:  # an open file keeps numpy from appending ".npz" to the name
        np.savez(f, _format=np.array(FORMAT), _structure=structure, **arrays)


def load(path: str | os.PathLike) -> object:
    """Read a state written by :func:`save`; resuming from it continues exactly as the saved run would.

    **Example:** ``result = inference.run(key, 10, X, y=y, init_state=pvi.load("run.npz"))``
    """
    with open(path, "rb") as f:
        data = np.load(io.BytesIO(f.read()), allow_pickle=False)
    if "_format" not in data or str(data["_format"]) != FORMAT:
        raise ValueError(f"{os.fspath(path)!r} is not a numpyro_pvi checkpoint (expected format {FORMAT}).")
    treedef = pickle.loads(data["_structure"].tobytes())
    leaves = [jax.numpy.asarray(data[f"leaf_{i}"]) for i in range(treedef.num_leaves)]
    return jax.tree_util.tree_unflatten(treedef, leaves)
