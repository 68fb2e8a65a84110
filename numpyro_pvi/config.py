"""The configuration of a :class:`~numpyro_pvi.PVI`, as a value.

:class:`PVIConfig` holds what ``PVI(...)`` was given, checked and with its defaults filled in. The
problem built from the data (:class:`~numpyro_pvi.model.problem.Problem`) and the result of a run
(:class:`~numpyro_pvi.PVIRunResult`) hold this value, never the ``PVI`` object (as numpyro's
``SVIRunResult`` holds no ``SVI``), and every function that needs the configuration takes it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

# what a problem's compiled steps take from the configuration: a problem is used only with a
# configuration that holds these very objects
COMPILED_FIELDS = (
    "model",
    "family",
    "partitions",
    "local_update",
    "server",
    "backend",
    "hyper_optimizer",
)


class PVIConfig(NamedTuple):
    """What :class:`~numpyro_pvi.PVI` was built with (checked, defaults filled in): immutable.

    :ivar model: the NumPyro model.
    :ivar family: the family of ``q`` and of the factors.
    :ivar partitions: index arrays, :class:`~numpyro_pvi.ClientData` or ``None``.
    :ivar local_update: the clients' :class:`~numpyro_pvi.local_updates.base.LocalUpdate`.
    :ivar server: the :class:`~numpyro_pvi.server.servers.Server` (its damping resolved).
    :ivar backend: the :class:`~numpyro_pvi.backends.Backend` (a name resolved to the object).
    :ivar num_elbo_particles: draws of the ELBO estimate recorded every round.
    :ivar hyper_optimizer: the optax optimiser of the hyperparameters.
    :ivar init_loc_fn: the NumPyro init strategy of a chosen start, or ``None``.
    :ivar init_scale: the spread of a chosen start, or ``None``.
    :ivar num_elbo_clients: the clients of the ELBO pass of rounds whose clients do not all report
        their terms (a fixed uniform sample, its sum scaled to all clients), or ``None``: all.

    **Example:** ``inference.config.server``; ``result.config.family``.
    """

    model: Callable
    family: Any
    partitions: Any
    local_update: Any
    server: Any
    backend: Any
    num_elbo_particles: int
    hyper_optimizer: Any
    init_loc_fn: Callable | None
    init_scale: float | None
    num_elbo_clients: int | None = None

    def mismatch(self, other: PVIConfig) -> list[str]:
        """The names of the compiled fields (:data:`COMPILED_FIELDS`) whose objects differ."""
        return [name for name in COMPILED_FIELDS if getattr(self, name) is not getattr(other, name)]
