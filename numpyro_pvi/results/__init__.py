"""What a run leaves: :class:`PVIRunResult`, checkpoints (``save``/``load``); ArviZ
(:mod:`numpyro_pvi.results.arviz`) and plots (:mod:`numpyro_pvi.results.plot`) are imported on
use."""

from numpyro_pvi.results.checkpoint import load, register_state_type, save
from numpyro_pvi.results.result import PVIRunResult

__all__ = ["PVIRunResult", "save", "load", "register_state_type"]
