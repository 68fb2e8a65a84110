"""What SNEP's loop reads of :class:`~numpyro_pvi.SNEPUpdate`: a value (internal)."""

from __future__ import annotations

from typing import NamedTuple

import jax


class SNEPSettings(NamedTuple):
    """The options of one :class:`~numpyro_pvi.SNEPUpdate`, checked by it.

    **Example:** ``pvi.SNEPUpdate(num_steps=20).settings.first_averaged`` is 10.
    """

    step_size: float
    num_steps: int
    refresh_every: int
    alpha: float
    num_chains: int
    first_averaged: int
    control_variates: bool
    site_variance: tuple | None
    step_decay: float | None
    max_tree_depth: int
    num_newton: int

    def step_size_at(self, t: jax.Array) -> jax.Array | float:
        """``eps_t`` of the client's inner step ``t``: ``step_size``, or its Robbins-Monro decay
        with ``step_decay``."""
        t = t.astype(jax.numpy.result_type(float))
        if self.step_decay is None:
            return self.step_size
        return self.step_size / (1.0 + t / self.step_decay) ** 0.6
