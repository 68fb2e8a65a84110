"""How much of the clients' deltas a server merges: one :class:`Damping` protocol, three dampings.

A synchronous round adds every client's delta computed against the same ``q``. On a correlated
posterior with mean-field factors the deltas overlap, and the undamped sum overshoots (a Jacobi
iteration); a small fixed damping (:class:`Fixed`) cures that but slows every round.
:class:`AdaptiveDamping` grows the damping while the global ELBO improves and halves it when the
ELBO falls by more than its tolerance or the merge had to backtrack to stay valid. The ELBO of
:class:`~numpyro_pvi.RoundInfo` is estimated with the same draws every round (common random
numbers), so rounds compare without most of the sampling noise; it is the ELBO of the ``q`` a round
started from (summed from the clients' reports, :mod:`numpyro_pvi.server.elbo`), so a round's ELBO
judges the step of the round before: a fall is answered one round late, a backtracked merge at
once. :class:`~numpyro_pvi.HeavyBall`
(``Synchronous()``'s default, :mod:`numpyro_pvi.server.heavy_ball`) sets the damping and a momentum
from the round's estimated spectrum.

A server resolves its ``damping`` argument once, in its constructor (:func:`resolve_damping`): a
float becomes :class:`Fixed`, ``None`` the server's default; the round then only calls the protocol.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.server.monitor import largest, q_move

# a round that moved q back against the last one: the cosine of their steps below this ...
SWING_COSINE = -0.5
SWING_CHANGE = 0.25  # ... and both moved q by more than this many posterior sds
SWING_ROUNDS = 4  # rounds in a row that swung back before a fixed damping is called oscillating


@runtime_checkable
class Damping(Protocol):
    """What a server's damping does in a round; its state lives in ``PVIState.damping``.

    :ivar synchronous_only: it needs every client of a round against the same ``q`` (heavy ball).
    :ivar reads_previous_factors: :meth:`after_merge` reads ``before.factors`` (heavy ball), so a
        round's merges may not reuse the memory of the factors it started from.

    **Example:** ``pvi.Synchronous(pvi.Fixed(0.5))`` (or ``pvi.Synchronous(0.5)``),
    ``pvi.Synchronous(pvi.AdaptiveDamping())``, ``pvi.Synchronous(pvi.HeavyBall())``.
    """

    synchronous_only: bool
    reads_previous_factors: bool

    def init(self, q: Any, factors: Any, family: Any) -> Any:
        """The state before the first round (its shapes never change: the merge compiles once)."""

    def rho(self, state: Any) -> Any:
        """The damping the next merge starts from (a float, or the state's: traced under jit)."""

    def after_merge(
        self, family: Any, before: Any, after: Any, clean: bool, rho_used: float
    ) -> Any:
        """The ``PVIState`` after a round's merge (``after``, from ``before``); ``clean``: every
        client ran and was merged with the full damping ``rho_used``."""

    def after_round(self, state: Any, elbo: float, backtracked: bool) -> Any:
        """The damping's state once the round's ELBO is known: ``elbo`` is that of the ``q`` the
        round started from (``RoundInfo.elbo``: it judges the previous round's step),
        ``backtracked`` whether this round's merge backtracked."""

    def after_new_client(self, state: Any, q: Any, factors: Any) -> Any:
        """The damping's state after :meth:`PVI.add_client <numpyro_pvi.PVI.add_client>`."""

    def warning(self, state: Any) -> tuple[str, str] | None:
        """``(cause, message)`` of a :class:`~numpyro_pvi.PVIWarning` the state calls for, or
        None."""


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


class Fixed:
    """The same damping ``rho`` in ``(0, 1]`` every round; a run whose rounds swing ``q`` back and
    forth (:data:`SWING_ROUNDS` in a row) warns that it is oscillating.

    **Example:** ``pvi.Synchronous(pvi.Fixed(0.5))``, the same as ``pvi.Synchronous(0.5)``.
    """

    synchronous_only = False
    reads_previous_factors = False

    def __init__(self, rho: float) -> None:
        if not (isinstance(rho, (int, float)) and not isinstance(rho, bool) and 0.0 < rho <= 1.0):
            raise ValueError(f"Fixed: rho must be a number in (0, 1], got {rho!r}.")
        self._rho = float(rho)

    def init(self, q: Any, factors: Any, family: Any) -> FixedDampingState:
        # the step sized for family's marginals: the state's shapes never change between rounds
        dtype, n = jnp.result_type(float), 2 * np.size(family.marginals(q).mean)
        # built in NumPy and sent: eager jnp.full / zeros compile in a fresh process
        return FixedDampingState(
            *jax.device_put(
                (np.full((n,), np.nan, dtype), np.zeros((), dtype), np.zeros((), np.int32))
            )
        )

    def rho(self, state: Any) -> float:
        return self._rho

    def after_merge(
        self, family: Any, before: Any, after: Any, clean: bool, rho_used: float
    ) -> Any:
        return after._replace(damping=_record_step(after.damping, family, before.q, after.q))

    def after_round(self, state: Any, elbo: float, backtracked: bool) -> Any:
        return state

    def after_new_client(self, state: Any, q: Any, factors: Any) -> Any:
        return state

    def warning(self, state: FixedDampingState) -> tuple[str, str] | None:
        if int(state.swings) < SWING_ROUNDS:
            return None
        return (
            "oscillating",
            f"The fixed damping {self._rho} is oscillating: each of the last {int(state.swings)} "
            f"rounds moved q back against the round before (by {float(state.change):.2g} "
            "posterior sds in the last), a limit cycle, not convergence: the clients' deltas "
            "overlap (a correlated posterior) and the damping overshoots. Use damping <= "
            f"{self._rho / 2:.3g}, Synchronous() (heavy ball, which restarts on an ELBO drop) or "
            "Sequential().",
        )

    def __repr__(self) -> str:
        return f"Fixed({self._rho})"

    def __str__(self) -> str:
        # a server's repr shows the number, as before Fixed existed: the server a checkpoint
        # records (``MadeFor.server``) is unchanged, and older checkpoints still resume
        return str(self._rho)


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
    # sent with device_put: jnp.asarray / jnp.where here compiled three eager ops in round 1
    swings = int(np.asarray(fixed.swings)) + 1 if swing else 0
    return FixedDampingState(
        jax.device_put(np.asarray(step, fixed.change.dtype)),
        jax.device_put(np.asarray(change, fixed.change.dtype)),
        jax.device_put(np.asarray(swings, fixed.swings.dtype)),
    )


class DampingState(NamedTuple):
    """An adaptive damping's state (in ``PVIState.damping``): the damping ``rho`` and the last
    round's ELBO."""

    rho: jax.Array
    elbo: jax.Array


class AdaptiveDamping:
    """Damping that grows by ``grow`` after a round that did not lower the ELBO by more than
    ``elbo_tolerance`` nats, and shrinks by ``shrink`` after one that did or whose merge
    backtracked, within ``[minimum, maximum]``.

    :param float elbo_tolerance: an ELBO fall (nats) up to this counts as no fall. The round's ELBO
        is a Monte Carlo estimate (``num_elbo_particles`` draws, the same every round), and a
        stale asynchronous update moves it by a little either way; halving on every tiny fall
        drives the damping to its floor. The default, 1 nat, is well above the estimate's Monte
        Carlo spread on the tests' models (sd 0.145 nats over keys with 64 draws on the asynchronous
        SiteFamilies run of ``tests/families/test_site_families.py``, whose stale updates lower it
        by up to
        0.6 nats: with 0 the damping fell to 1/64 and the means stayed 0.165 posterior sds off
        after 48 rounds, with 1 they are 1.4e-5 sds off).

    **Example:** ``pvi.Asynchronous()`` (its default), ``pvi.Synchronous(pvi.AdaptiveDamping(
    initial=0.2))``.
    """

    synchronous_only = False
    reads_previous_factors = False

    def __init__(
        self,
        *,
        initial: float = 0.5,
        grow: float = 1.25,
        shrink: float = 0.5,
        minimum: float = 1 / 64,
        maximum: float = 1.0,
        elbo_tolerance: float = 1.0,
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
        if not (isinstance(elbo_tolerance, (int, float)) and elbo_tolerance >= 0.0):
            raise ValueError(
                "AdaptiveDamping: elbo_tolerance must be a non-negative number, got "
                f"{elbo_tolerance!r}."
            )
        self.initial, self.grow, self.shrink = initial, grow, shrink
        self.minimum, self.maximum, self.elbo_tolerance = minimum, maximum, float(elbo_tolerance)

    def init(self, q: Any, factors: Any, family: Any) -> DampingState:
        # not weak-typed: the state after a round has these types (no recompilation)
        dtype = jnp.result_type(float)
        return DampingState(jnp.asarray(self.initial, dtype), jnp.asarray(-jnp.inf, dtype))

    def rho(self, state: DampingState) -> jax.Array:
        return state.rho

    def after_merge(
        self, family: Any, before: Any, after: Any, clean: bool, rho_used: float
    ) -> Any:
        return after

    def after_round(self, state: DampingState, elbo: float, backtracked: bool) -> DampingState:
        """The damping for the next round, after a round that started from a ``q`` of ELBO
        ``elbo`` (the last round's step reached it) and whose merge ``backtracked`` or not."""
        better = elbo >= float(state.elbo) - self.elbo_tolerance and not backtracked
        rho = float(state.rho) * (self.grow if better else self.shrink)
        rho = float(np.clip(rho, self.minimum, self.maximum))
        return DampingState(jnp.asarray(rho, state.rho.dtype), jnp.asarray(elbo, state.elbo.dtype))

    def after_new_client(self, state: Any, q: Any, factors: Any) -> Any:
        return state

    def warning(self, state: Any) -> tuple[str, str] | None:
        return None

    def __repr__(self) -> str:
        return f"AdaptiveDamping(initial={self.initial})"


def resolve_damping(damping: Any, owner: str, default: Damping, synchronous: bool) -> Damping:
    """A server's ``damping`` argument as a :class:`Damping`, once, in the server's constructor:
    a float in ``(0, 1]`` becomes :class:`Fixed`, ``None`` is ``default``; a damping that needs
    synchronous rounds (``HeavyBall``) is refused unless the server's rounds are (``synchronous``).
    """
    if damping is None:
        return default
    if isinstance(damping, (int, float)) and not isinstance(damping, bool):
        if not 0.0 < damping <= 1.0:
            raise ValueError(f"{owner}: damping must be in (0, 1], got {damping!r}.")
        return Fixed(damping)
    if not isinstance(damping, Damping):
        raise ValueError(
            f"{owner}: damping must be a float in (0, 1], None (the default), pvi.Fixed, "
            f"pvi.AdaptiveDamping or pvi.HeavyBall, got {damping!r}."
        )
    if damping.synchronous_only and not synchronous:
        raise ValueError(
            f"{owner}: {damping!r} needs synchronous rounds (every client in every round, against "
            "the same q; no clients_per_round): use a float, pvi.Fixed or pvi.AdaptiveDamping."
        )
    return damping
