"""How much of the clients' deltas a server merges: a fixed damping, one that adapts to the ELBO, or
heavy ball.

A synchronous round adds every client's delta computed against the same ``q``. On a correlated
posterior with mean-field factors the deltas overlap, and the undamped sum overshoots (a Jacobi
iteration); a small fixed damping cures that but slows every round. :class:`AdaptiveDamping` grows
the damping while the global ELBO improves and halves it when the ELBO falls or the merge had to
backtrack to stay valid. The ELBO of :class:`~numpyro_pvi.RoundInfo` is estimated with the same
draws every round (common random numbers), so rounds compare without sampling noise.
:class:`~numpyro_pvi.HeavyBall` (``Synchronous()``'s default, :mod:`numpyro_pvi.heavy_ball`) sets
the damping and a momentum from the round's estimated spectrum.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.heavy_ball import HeavyBall, HeavyBallState
from numpyro_pvi.monitor import largest, q_move

# a round that moved q back against the last one: the cosine of their steps below this ...
SWING_COSINE = -0.5
SWING_CHANGE = 0.25  # ... and both moved q by more than this many posterior sds
SWING_ROUNDS = 4  # rounds in a row that swung back before a fixed damping is called oscillating
DROP_ROUNDS = 3  # rounds in a row whose ELBO fell before heavy ball says so


class DampingState(NamedTuple):
    """An adaptive damping's state (in ``PVIState.damping``): the damping ``rho`` and the last
    round's ELBO."""

    rho: jax.Array
    elbo: jax.Array


class AdaptiveDamping:
    """Damping that grows by ``grow`` after a round that improved the ELBO, and shrinks by
    ``shrink`` after one that lowered it or whose merge backtracked, within ``[minimum, maximum]``.

    **Example:** ``pvi.Synchronous()`` (the default) or
    ``pvi.Synchronous(pvi.AdaptiveDamping(initial=0.2))``; ``pvi.Synchronous(0.5)`` keeps a fixed
    damping.
    """

    def __init__(
        self,
        initial: float = 0.5,
        grow: float = 1.25,
        shrink: float = 0.5,
        minimum: float = 1 / 64,
        maximum: float = 1.0,
    ) -> None:
        if not 0.0 < minimum <= initial <= maximum <= 1.0:
            raise ValueError(
                "AdaptiveDamping: need 0 < minimum <= initial <= maximum <= 1, got "
                f"minimum={minimum}, initial={initial}, maximum={maximum}."
            )
        if not (grow >= 1.0 and 0.0 < shrink < 1.0):
            raise ValueError(
                f"AdaptiveDamping: need grow >= 1 and 0 < shrink < 1, got grow={grow}, "
                f"shrink={shrink}."
            )
        self.initial, self.grow, self.shrink, self.minimum, self.maximum = (
            initial,
            grow,
            shrink,
            minimum,
            maximum,
        )

    def init(self) -> DampingState:
        # not weak-typed: the state after a round has these types (no recompilation)
        dtype = jnp.result_type(float)
        return DampingState(jnp.asarray(self.initial, dtype), jnp.asarray(-jnp.inf, dtype))

    def adapt(self, damping: DampingState, elbo: float, backtracked: bool) -> DampingState:
        """The damping for the next round, after a round that reached ``elbo``."""
        better = elbo >= float(damping.elbo) and not backtracked
        rho = float(damping.rho) * (self.grow if better else self.shrink)
        rho = float(np.clip(rho, self.minimum, self.maximum))
        return DampingState(
            jnp.asarray(rho, damping.rho.dtype), jnp.asarray(elbo, damping.elbo.dtype)
        )

    def __repr__(self) -> str:
        return f"AdaptiveDamping(initial={self.initial})"


Damping = float | AdaptiveDamping | HeavyBall


class FixedDampingState(NamedTuple):
    """A fixed damping's state (in ``PVIState.damping``): what tells an oscillation from progress.

    :ivar step: the last round's move of ``q``, each marginal mean's change in posterior sds then
        each log sd's change (NaN before the first round).
    :ivar change: how far that round moved ``q`` (``RoundInfo.change``).
    :ivar swings: rounds in a row that moved ``q`` back against the round before by more than
        :data:`SWING_CHANGE` sds (the cosine of their steps below :data:`SWING_COSINE`).
    """

    step: jax.Array
    change: jax.Array
    swings: jax.Array


def checked_damping(
    damping: Any, owner: str, default: type = AdaptiveDamping, heavy_ball: bool = False
) -> Damping:
    """A server's ``damping`` argument: a float in ``(0, 1]``, an :class:`AdaptiveDamping`, a
    :class:`~numpyro_pvi.HeavyBall` if the server allows it (``heavy_ball``), or ``None`` for
        ``default()``."""
    if damping is None:
        return default()
    if isinstance(damping, AdaptiveDamping) or (heavy_ball and isinstance(damping, HeavyBall)):
        return damping
    if isinstance(damping, HeavyBall):
        raise ValueError(
            f"{owner}: pvi.HeavyBall needs synchronous rounds (every client against the same q); "
            "use a float or a pvi.AdaptiveDamping."
        )
    if not (
        isinstance(damping, (int, float)) and not isinstance(damping, bool) and 0.0 < damping <= 1.0
    ):
        raise ValueError(
            f"{owner}: damping must be in (0, 1], None (the default), a "
            f"pvi.AdaptiveDamping{' or a pvi.HeavyBall' if heavy_ball else ''}, got {damping!r}."
        )
    return float(damping)


def initial_state(damping: Damping, q: Any, factors: Any, family: Any = None) -> Any:
    """What ``PVIState.damping`` starts as: heavy ball's or an adaptive damping's state, a
    :class:`FixedDampingState` for a fixed one (its step sized for ``family``'s marginals, so that
    the state's shapes never change between rounds: the merge is compiled once)."""
    if isinstance(damping, HeavyBall):
        return damping.init(q, factors)
    if isinstance(damping, AdaptiveDamping):
        return damping.init()
    dtype, n = (
        jnp.result_type(float),
        0 if family is None else 2 * np.size(family.marginals(q).mean),
    )
    return FixedDampingState(
        jnp.full((n,), jnp.nan, dtype), jnp.zeros((), dtype), jnp.zeros((), jnp.int32)
    )


def current(damping: Damping, state: Any) -> Any:
    """The damping a merge starts from: the fixed value, or the adaptive state's (traced under
    ``jit``)."""
    return damping if isinstance(damping, float) else state.rho


def accelerate(
    damping: Damping, family: Any, before: Any, after: Any, clean: bool, rho_used: float
) -> Any:
    """The ``PVIState`` after a round's merge: :class:`~numpyro_pvi.HeavyBall`'s rescaling and
    momentum (see
    :meth:`HeavyBall.accelerate <numpyro_pvi.HeavyBall.accelerate>`); for a fixed damping, ``after``
    with the round's step recorded (:class:`FixedDampingState`); ``after`` unchanged otherwise."""
    if isinstance(damping, HeavyBall):
        return damping.accelerate(family, before, after, clean, rho_used)
    if isinstance(after.damping, FixedDampingState):
        return after._replace(damping=_record_step(after.damping, family, before.q, after.q))
    return after


def _record_step(fixed: FixedDampingState, family: Any, old: Any, new: Any) -> FixedDampingState:
    step = np.asarray(q_move(family, old, new), np.float64)
    change = largest(step)
    previous = np.asarray(fixed.step, np.float64)
    swing = False
    if previous.shape == step.shape and np.all(np.isfinite(step)) and np.all(np.isfinite(previous)):
        norms = np.linalg.norm(previous) * np.linalg.norm(step)
        swing = bool(
            norms > 0
            and previous @ step < SWING_COSINE * norms
            and min(change, float(fixed.change)) > SWING_CHANGE
        )
    dtype = fixed.change.dtype
    # a state made without the family: keep its shape (the merge's compilation)
    if previous.shape != step.shape:
        step = np.full(previous.shape, np.nan)
    return FixedDampingState(
        jnp.asarray(step, dtype),
        jnp.asarray(change, dtype),
        jnp.where(swing, fixed.swings + 1, 0).astype(fixed.swings.dtype),
    )


def after_round(damping: Damping, state: Any, elbo: float, backtracked: bool) -> Any:
    """``PVIState.damping`` after a round: an adaptive damping's next value, heavy ball's restart on
    an ELBO drop (:meth:`HeavyBall.after_round <numpyro_pvi.HeavyBall.after_round>`), a fixed
    damping's unchanged."""
    if isinstance(damping, AdaptiveDamping):
        return damping.adapt(state, elbo, backtracked)
    if isinstance(damping, HeavyBall):
        return damping.after_round(state, elbo)
    return state


def warning(damping: Damping, state: Any) -> tuple[str, str] | None:
    """``(cause, message)`` of a :class:`~numpyro_pvi.PVIWarning` the damping's state calls for
    after a round, or None: a fixed damping whose rounds swing ``q`` back and forth
    (:data:`SWING_ROUNDS` in a row), heavy ball whose ELBO fell :data:`DROP_ROUNDS` rounds in a row
    (restarts and halved dampings did not help)."""
    if isinstance(state, FixedDampingState) and int(state.swings) >= SWING_ROUNDS:
        return (
            "oscillating",
            f"The fixed damping {damping} is oscillating: each of the last {int(state.swings)} "
            f"rounds moved q back against the round before (by {float(state.change):.2g} "
            "posterior sds in the last), a limit cycle, not convergence: the clients' deltas "
            "overlap (a correlated posterior) and the damping overshoots. Use damping <= "
            f"{damping / 2:.3g}, Synchronous() (heavy ball, which restarts on an ELBO drop) or "
            "Sequential().",
        )
    if isinstance(state, HeavyBallState) and int(state.drops) >= DROP_ROUNDS:
        return (
            "elbo falling",
            f"Synchronous(): the ELBO fell in each of the last {int(state.drops)} rounds although "
            "every drop restarted the momentum and halved the damping (now "
            f"{float(state.rho):.3g}): the clients' updates do not improve q from here (too "
            "noisy, or far from linear). Try more local steps or particles, a smaller local step "
            "size, or Sequential().",
        )
    return None


def after_new_client(damping: Damping, state: Any, q: Any, factors: Any) -> Any:
    """``PVIState.damping`` after :meth:`PVI.add_client`: heavy ball restarts (the round is another
    operator)."""
    return damping.init(q, factors) if isinstance(damping, HeavyBall) else state
