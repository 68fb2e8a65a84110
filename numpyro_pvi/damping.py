"""How much of the clients' deltas a server merges: a fixed damping, one that adapts to the ELBO, or heavy ball.

A synchronous round adds every client's delta computed against the same ``q``. On a correlated posterior
with mean-field factors the deltas overlap, and the undamped sum overshoots (a Jacobi iteration); a
small fixed damping cures that but slows every round. :class:`AdaptiveDamping` grows the damping while
the global ELBO improves and halves it when the ELBO falls or the merge had to backtrack to stay valid.
The ELBO of :class:`~numpyro_pvi.RoundInfo` is estimated with the same draws every round (common random
numbers), so rounds compare without sampling noise. :class:`~numpyro_pvi.HeavyBall` (``Synchronous()``'s
default, :mod:`numpyro_pvi.heavy_ball`) sets the damping and a momentum from the round's estimated spectrum.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.heavy_ball import HeavyBall


class DampingState(NamedTuple):
    """An adaptive damping's state (in ``PVIState.damping``): the damping ``rho`` and the last round's ELBO."""

    rho: jax.Array
    elbo: jax.Array


class AdaptiveDamping:
    """Damping that grows by ``grow`` after a round that improved the ELBO, and shrinks by ``shrink`` after one
    that lowered it or whose merge backtracked, within ``[minimum, maximum]``.

    **Example:** ``pvi.Synchronous()`` (the default) or ``pvi.Synchronous(pvi.AdaptiveDamping(initial=0.2))``;
    ``pvi.Synchronous(0.5)`` keeps a fixed damping.
    """

    def __init__(self, initial: float = 0.5, grow: float = 1.25, shrink: float = 0.5, minimum: float = 1 / 64,
                 maximum: float = 1.0) -> None:
        if not 0.0 < minimum <= initial <= maximum <= 1.0:
            raise ValueError(f"AdaptiveDamping: need 0 < minimum <= initial <= maximum <= 1, got minimum={minimum}, "
                             f"initial={initial}, maximum={maximum}.")
        if not (grow >= 1.0 and 0.0 < shrink < 1.0):
            raise ValueError(f"AdaptiveDamping: need grow >= 1 and 0 < shrink < 1, got grow={grow}, shrink={shrink}.")
        self.initial, self.grow, self.shrink, self.minimum, self.maximum = initial, grow, shrink, minimum, maximum

    def init(self) -> DampingState:
        return DampingState(jnp.asarray(self.initial, jnp.result_type(float)), jnp.asarray(-jnp.inf))

    def adapt(self, damping: DampingState, elbo: float, backtracked: bool) -> DampingState:
        """The damping for the next round, after a round that reached ``elbo``."""
        better = elbo >= float(damping.elbo) and not backtracked
        rho = float(damping.rho) * (self.grow if better else self.shrink)
        rho = float(np.clip(rho, self.minimum, self.maximum))
        return DampingState(jnp.asarray(rho, damping.rho.dtype), jnp.asarray(elbo, damping.elbo.dtype))

    def __repr__(self) -> str:
        return f"AdaptiveDamping(initial={self.initial})"


Damping = float | AdaptiveDamping | HeavyBall


def checked_damping(damping: Any, owner: str, default: type = AdaptiveDamping,
                    heavy_ball: bool = False) -> Damping:
    """A server's ``damping`` argument: a float in ``(0, 1]``, an :class:`AdaptiveDamping`, a
    :class:`~numpyro_pvi.HeavyBall` if the server allows it (``heavy_ball``), or ``None`` for ``default()``."""
    if damping is None:
        return default()
    if isinstance(damping, AdaptiveDamping) or (heavy_ball and isinstance(damping, HeavyBall)):
        return damping
    if isinstance(damping, HeavyBall):
        raise ValueError(f"{owner}: pvi.HeavyBall needs synchronous rounds (every client against the same q); use "
                         "a float or a pvi.AdaptiveDamping.")
    if not (isinstance(damping, (int, float)) and not isinstance(damping, bool) and 0.0 < damping <= 1.0):
        raise ValueError(f"{owner}: damping must be in (0, 1], None (the default), a pvi.AdaptiveDamping"
                         f"{' or a pvi.HeavyBall' if heavy_ball else ''}, got {damping!r}.")
    return float(damping)


def initial_state(damping: Damping, q: Any, factors: Any) -> Any:
    """What ``PVIState.damping`` starts as: an adaptive damping's state, ``()`` for a fixed one."""
    if isinstance(damping, HeavyBall):
        return damping.init(q, factors)
    return damping.init() if isinstance(damping, AdaptiveDamping) else ()


def current(damping: Damping, state: Any) -> Any:
    """The damping a merge starts from: the fixed value, or the adaptive state's (traced under ``jit``)."""
    return damping if isinstance(damping, float) else state.rho


def accelerate(damping: Damping, family: Any, before: Any, after: Any, clean: bool, rho_used: float) -> Any:
    """The ``PVIState`` after a round's merge: :class:`~numpyro_pvi.HeavyBall`'s rescaling and momentum (see
    :meth:`HeavyBall.accelerate <numpyro_pvi.HeavyBall.accelerate>`), ``after`` unchanged otherwise."""
    return damping.accelerate(family, before, after, clean, rho_used) if isinstance(damping, HeavyBall) else after


def after_round(damping: Damping, state: Any, elbo: float, backtracked: bool) -> Any:
    """``PVIState.damping`` after a round (unchanged for a fixed damping or heavy ball)."""
    return damping.adapt(state, elbo, backtracked) if isinstance(damping, AdaptiveDamping) else state


def after_new_client(damping: Damping, state: Any, q: Any, factors: Any) -> Any:
    """``PVIState.damping`` after :meth:`PVI.add_client`: heavy ball restarts (the round is another operator)."""
    return damping.init(q, factors) if isinstance(damping, HeavyBall) else state
