"""numpyro_pvi: Partitioned Variational Inference (PVI) as a NumPyro inference method.

A model marks its data plate with :func:`partition_plate`; :class:`PVI` fits an approximation ``q``
of its global latent sites from one factor per client. What a :class:`PVI` is made of (each
documented in ``docs/``):

* families of ``q``: :class:`MeanFieldGaussian`, :class:`FullRankGaussian`, :class:`Gamma`,
  :class:`Beta`, :class:`Dirichlet`, and :class:`SiteFamilies` (a family per site);
* local updates: :class:`GradientUpdate`, :class:`NaturalGradientUpdate` (CVI),
  :class:`MomentMatchingUpdate` (EP), :class:`SNEPUpdate`, and the differentially private
  :class:`DPGradientUpdate` and :class:`DPLocalAveraging` (accounting: :func:`privacy_spent`,
  :func:`calibrate_noise_multiplier`);
* servers: :class:`Synchronous` (the default, with :class:`HeavyBall` or :class:`AdaptiveDamping`
  damping), :class:`Sequential`, :class:`Asynchronous`, :class:`Continual`;
* backends: ``backend="vmap"`` (the default), ``"loop"`` or ``"ray"``; Flower sites in
  :mod:`numpyro_pvi.flower`;
* data: pooled arrays split by :func:`split_iid` / :func:`split_by_label`, or :class:`ClientData`.

The contracts for extending PVI (a family, a local update, a server, a backend) are imported from
their subpackages: ``numpyro_pvi.families``, ``numpyro_pvi.local_updates``, and so on (see
``docs/extending.md``).

**Example:** ``pvi.PVI(model, pvi.MeanFieldGaussian(), pvi.split_iid(key, n, 4),
pvi.GradientUpdate(optax.adam(0.05), 100), pvi.Sequential()).run(key, 10, X, y=y)``.
"""

from numpyro_pvi._version import __version__ as __version__
from numpyro_pvi.compilation import enable_compilation_cache
from numpyro_pvi.families import (
    Beta,
    Dirichlet,
    FullRankGaussian,
    Gamma,
    MeanFieldGaussian,
    SiteFamilies,
)
from numpyro_pvi.hyper_optim import rprop
from numpyro_pvi.local_updates import (
    GradientUpdate,
    Importance,
    MomentMatchingUpdate,
    NaturalGradientUpdate,
    NUTSMoments,
    SNEPUpdate,
)
from numpyro_pvi.model.partition import ClientData, partition_plate, split_by_label, split_iid
from numpyro_pvi.privacy import DPGradientUpdate, DPLocalAveraging
from numpyro_pvi.privacy.accounting import calibrate_noise_multiplier
from numpyro_pvi.pvi import PVI
from numpyro_pvi.results.checkpoint import load, save
from numpyro_pvi.results.result import PVIRunResult
from numpyro_pvi.server.damping import AdaptiveDamping, Fixed
from numpyro_pvi.server.heavy_ball import HeavyBall
from numpyro_pvi.server.monitor import PVIWarning
from numpyro_pvi.server.servers import Asynchronous, Continual, Sequential, Synchronous
from numpyro_pvi.state import PVIState, RoundInfo

__all__ = [
    # inference
    "PVI",
    "PVIState",
    "RoundInfo",
    "PVIRunResult",
    "PVIWarning",
    # data
    "partition_plate",
    "split_iid",
    "split_by_label",
    "ClientData",
    # families
    "MeanFieldGaussian",
    "FullRankGaussian",
    "Gamma",
    "Beta",
    "Dirichlet",
    "SiteFamilies",
    # local updates
    "GradientUpdate",
    "NaturalGradientUpdate",
    "MomentMatchingUpdate",
    "SNEPUpdate",
    "Importance",
    "NUTSMoments",
    "DPGradientUpdate",
    "DPLocalAveraging",
    # servers and their damping
    "Sequential",
    "Synchronous",
    "Asynchronous",
    "Continual",
    "Fixed",
    "AdaptiveDamping",
    "HeavyBall",
    # hyperparameters, checkpoints, privacy
    "rprop",
    "save",
    "load",
    "calibrate_noise_multiplier",
    # start-up
    "enable_compilation_cache",
]
