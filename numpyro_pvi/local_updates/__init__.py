"""How a client improves its factor ``t_m`` against its cavity: one local update per module."""

from numpyro_pvi.local_updates.base import (
    Client,
    ClientProblem,
    ClientResult,
    CountsRejectedUpdates,
    LocalUpdate,
)
from numpyro_pvi.local_updates.gradient import GradientUpdate
from numpyro_pvi.local_updates.moment_matching import (
    Importance,
    MomentMatchingUpdate,
    NUTSMoments,
)
from numpyro_pvi.local_updates.natural_gradient import NaturalGradientUpdate
from numpyro_pvi.local_updates.snep import SNEPState, SNEPUpdate

__all__ = [
    "Client",
    "ClientProblem",
    "ClientResult",
    "GradientUpdate",
    "Importance",
    "CountsRejectedUpdates",
    "LocalUpdate",
    "MomentMatchingUpdate",
    "NUTSMoments",
    "NaturalGradientUpdate",
    "SNEPState",
    "SNEPUpdate",
]
