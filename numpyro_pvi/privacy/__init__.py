"""Differentially private PVI (opt in): DP-SGD and local averaging updates, and the accounting of a
run's privacy."""

from numpyro_pvi.privacy._release import DPState
from numpyro_pvi.privacy.accounting import (
    PrivateUpdate,
    calibrate_noise_multiplier,
    privacy_spent,
    releases,
)
from numpyro_pvi.privacy.dp_sgd import DPGradientUpdate
from numpyro_pvi.privacy.local_averaging import DPLocalAveraging

__all__ = [
    "PrivateUpdate",
    "calibrate_noise_multiplier",
    "privacy_spent",
    "releases",
    "DPGradientUpdate",
    "DPState",
    "DPLocalAveraging",
]
