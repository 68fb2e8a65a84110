"""Backends: where the clients of a group run.

* ``"vmap"`` (default): a group's clients run in one ``jax.vmap`` under one ``jax.jit`` together
  with the gather of their (padded, masked) data and the server's merge: one compiled call per
  round.
* ``"loop"``: a Python loop over clients, each a call of one jitted ``client_update``; a client that
  raises is reported as a failed (rejected) update.
* :class:`~numpyro_pvi.backends.ray.RayBackend` (``"ray"``, :mod:`numpyro_pvi.backends.ray`): each
  client is a Ray actor that holds only its own data, and clients run truly concurrently.

The contracts are written as protocols: a :class:`Backend` ``prepare``\\ s a :data:`ClientRunner`
for a local update and a client problem (no data: the clients' data are an argument of every call);
a runner that can also run single clients in the background is a :class:`ConcurrentRunner`, which
asynchronous servers use to merge each update as it arrives. Every backend hands a client the same
random key, so all give the same result for the same seed.
"""

from __future__ import annotations

from numpyro_pvi.backends.base import (
    Backend,
    ClientRunner,
    ConcurrentRunner,
    failed_result,
    stack,
    take,
)
from numpyro_pvi.backends.local import LoopBackend, VmapBackend
from numpyro_pvi.backends.ray import RayBackend

BACKENDS = {"vmap": VmapBackend, "loop": LoopBackend}


def get_backend(backend: str | Backend) -> Backend:
    """A backend instance from its name (``"vmap"``, ``"loop"``, ``"ray"``) or an instance."""
    if isinstance(backend, str):
        if backend == "ray":
            return RayBackend()
        if backend not in BACKENDS:
            raise ValueError(
                f"Unknown backend {backend!r}; choose one of {sorted(BACKENDS) + ['ray']} or pass "
                "an instance."
            )
        return BACKENDS[backend]()
    if not isinstance(backend, Backend):
        raise TypeError(
            f"backend must be a name {sorted(BACKENDS) + ['ray']} or a pvi.backends.Backend (an "
            f"object with `jit_group` and `prepare(local_update, problem)`), got {backend!r}."
        )
    return backend


__all__ = [
    "Backend",
    "ClientRunner",
    "ConcurrentRunner",
    "LoopBackend",
    "RayBackend",
    "VmapBackend",
    "failed_result",
    "get_backend",
    "stack",
    "take",
]
