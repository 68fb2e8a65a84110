"""PVI on Flower (``pip install "numpyro-pvi[flower]"``): the server as a Flower ``Strategy``, each
site a Flower ``ClientApp`` that holds its own data.

* :class:`PVIStrategy` / :func:`server_app`: the PVI server (``q``, the factors, the damped merge).
* :class:`Site` / :func:`client_app`: a site's local update against the cavity it receives.
* :func:`run_simulation`: Flower's simulation engine, Ray started without the alarms its start
  raises beside JAX.
* :mod:`numpyro_pvi.flower.wire`: natural parameters as Flower ``ArrayRecord``\\ s.

Only natural parameters travel: the cavity, ``q`` and a random key down to a site, its delta and
free energy up. See ``docs/federated.md``.

**Example:** ``from numpyro_pvi.flower import PVIStrategy, client_app, run_simulation, server_app``
"""

try:
    import flwr  # noqa: F401
except ImportError as e:  # pragma: no cover - the optional extra is missing
    raise ImportError(
        'numpyro_pvi.flower needs Flower: pip install "numpyro-pvi[flower]" (flwr[simulation]).'
    ) from e

from numpyro_pvi.flower.client import Site, client_app, partition_id
from numpyro_pvi.flower.simulation import run_simulation
from numpyro_pvi.flower.strategy import PVIStrategy, server_app
from numpyro_pvi.flower.wire import tree_from_record, tree_to_record

__all__ = [
    "PVIStrategy",
    "Site",
    "client_app",
    "partition_id",
    "run_simulation",
    "server_app",
    "tree_from_record",
    "tree_to_record",
]
