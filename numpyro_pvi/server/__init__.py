"""One round on the server: the schedule (servers), the compiled steps, the merge and the
damping."""

from numpyro_pvi.server.damping import AdaptiveDamping, Damping, Fixed
from numpyro_pvi.server.heavy_ball import HeavyBall
from numpyro_pvi.server.monitor import PVIWarning
from numpyro_pvi.server.sampling import ClientSampling
from numpyro_pvi.server.servers import Asynchronous, Continual, Sequential, Server, Synchronous

__all__ = [
    "Server",
    "Sequential",
    "Synchronous",
    "Asynchronous",
    "Continual",
    "Damping",
    "Fixed",
    "AdaptiveDamping",
    "HeavyBall",
    "ClientSampling",
    "PVIWarning",
]
