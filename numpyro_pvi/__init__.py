"""numpyro_pvi: Partitioned Variational Inference (PVI) as a NumPyro inference method.

A model marks its data plate with :func:`partition_plate`; :class:`PVI` fits an approximation ``q``
of its global latent sites from one factor per client. What a :class:`PVI` is made of (each
documented in ``docs/``):

* families of ``q``: :class:`MeanFieldGaussian`, :class:`FullRankGaussian`, :class:`Gamma`,
  :class:`Beta`,
  :class:`Dirichlet`, and :class:`SiteFamilies` (a family per site);
* local updates: :class:`GradientUpdate`, :class:`NaturalGradientUpdate` (CVI),
  :class:`MomentMatchingUpdate` (EP), :class:`SNEPUpdate`, and the differentially private
  :class:`DPGradientUpdate` and
  :class:`DPLocalAveraging` (accounting: :mod:`numpyro_pvi.privacy`);
* servers: :class:`Synchronous` (the default, with :class:`HeavyBall` or :class:`AdaptiveDamping`
  damping),
  :class:`Sequential`, :class:`Asynchronous`, :class:`Continual`;
* backends: :class:`VmapBackend` (the default), :class:`LoopBackend`, :class:`RayBackend`; Flower
  sites in
  :mod:`numpyro_pvi.flower`;
* data: pooled arrays split by :func:`split_iid` / :func:`split_by_label`, or :class:`ClientData`.

**Example:** ``pvi.PVI(model, pvi.MeanFieldGaussian(), pvi.split_iid(key, n, 4),
pvi.GradientUpdate(optax.adam(0.05), 100), pvi.Sequential()).run(key, 10, X, y=y)``.
"""

from numpyro_pvi._version import __version__ as __version__
from numpyro_pvi.backends import Backend, ConcurrentRunner, LoopBackend, VmapBackend
from numpyro_pvi.checkpoint import load, save
from numpyro_pvi.damping import AdaptiveDamping, Fixed
from numpyro_pvi.families import (
    Beta,
    Dirichlet,
    Family,
    FullRankGaussian,
    Gamma,
    MeanFieldGaussian,
    NatParams,
    SiteFamilies,
)
from numpyro_pvi.heavy_ball import HeavyBall
from numpyro_pvi.hyper_optim import rprop
from numpyro_pvi.local_updates import (
    Client,
    ClientProblem,
    ClientResult,
    CountsRejectedUpdates,
    DPGradientUpdate,
    DPLocalAveraging,
    GradientUpdate,
    Importance,
    LocalUpdate,
    MomentMatchingUpdate,
    NaturalGradientUpdate,
    NUTSMoments,
    SNEPUpdate,
)
from numpyro_pvi.monitor import PVIWarning
from numpyro_pvi.partition import ClientData, partition_plate, split_by_label, split_iid
from numpyro_pvi.privacy import calibrate_noise_multiplier
from numpyro_pvi.problem import Problem, build_problem
from numpyro_pvi.pvi import PVI
from numpyro_pvi.ray_backend import RayBackend
from numpyro_pvi.results import PVIRunResult
from numpyro_pvi.servers import Asynchronous, Continual, Sequential, Server, Synchronous
from numpyro_pvi.state import PVIState, Rejection, RoundInfo

__all__ = [
    "PVI",
    "AdaptiveDamping",
    "HeavyBall",
    "Fixed",
    "Asynchronous",
    "Backend",
    "ConcurrentRunner",
    "Problem",
    "build_problem",
    "calibrate_noise_multiplier",
    "Continual",
    "Client",
    "ClientData",
    "ClientProblem",
    "ClientResult",
    "DPGradientUpdate",
    "DPLocalAveraging",
    "Family",
    "FullRankGaussian",
    "Gamma",
    "Beta",
    "Dirichlet",
    "SiteFamilies",
    "GradientUpdate",
    "CountsRejectedUpdates",
    "LocalUpdate",
    "LoopBackend",
    "MeanFieldGaussian",
    "MomentMatchingUpdate",
    "Importance",
    "NUTSMoments",
    "NaturalGradientUpdate",
    "NatParams",
    "PVIRunResult",
    "PVIWarning",
    "Rejection",
    "PVIState",
    "RayBackend",
    "RoundInfo",
    "SNEPUpdate",
    "Sequential",
    "Server",
    "Synchronous",
    "VmapBackend",
    "load",
    "save",
    "partition_plate",
    "rprop",
    "split_by_label",
    "split_iid",
]
