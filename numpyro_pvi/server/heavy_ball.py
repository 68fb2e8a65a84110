"""Synchronous rounds with heavy-ball momentum whose damping and momentum come from the round's own
spectrum.

Near the optimum a synchronous round moves ``q`` by ``rho * Delta(q)``, where the clients' summed
delta ``Delta(q) ~ -P (q - q*)`` and ``P`` is the linearised round (``(D + O/M)^-1 Lambda`` for
mean-field factors on a posterior of precision ``Lambda = D + O``; see
``docs/servers/synchronous.md``). A fixed damping converges like ``1 - 2 / kappa(P)`` per round,
which on a correlated posterior is many rounds. Polyak's heavy ball,

    ``x_{k+1} = x_k + rho * Delta(x_k) + beta * (x_k - x_{k-1})``,  ``x = (q, t_1..t_M)``,

with ``rho = 4 / (sqrt(l_max) + sqrt(l_min))^2`` and ``beta = ((sqrt(kappa) - 1) / (sqrt(kappa) +
1))^2`` converges like ``1 - 2 / sqrt(kappa)``. The server does not know ``P``'s spectrum, but every
round gives a secant pair: the step ``s = q_k - q_{k-1}`` and the change of the clients' (undamped)
summed delta, ``y = -(Delta_k - Delta_{k-1}) ~ P s``. The Ritz values of ``P`` on the span of the
last ``window`` steps bound its spectrum from inside, so the estimate is widened (``l_min`` halved,
``l_max`` times 1.25, the smallest ``l_min`` and the median ``l_max`` of the last ``memory``
estimates) before Polyak's formulas.

The momentum moves every factor by ``beta`` times its own last change (so ``q`` stays the prior
times the factors) and is halved until ``q`` and every cavity are valid. A round in which a client
was not run, was rejected or was merged with a backtracked damping gives no secant pair and no
momentum (a restart).

The spectrum estimate is only as good as the clients' deltas, which are noisy and, far from the
optimum, not linear. So the global ELBO (``RoundInfo.elbo``, the same draws every round) guards the
steps, as in the adaptive restart of momentum methods (O'Donoghue & Candes 2015): after a round
whose step lowered the ELBO by more than ``elbo_tolerance`` nats the momentum restarts (the velocity
is dropped), and if that step had no momentum (the damping itself overshot) a ceiling on the damping
is set to half the damping of that step; every step that does not lower the ELBO raises the ceiling
by ``grow`` (up to ``maximum``). :meth:`HeavyBall.warning` says when the ELBO keeps falling all the
same.

``RoundInfo.elbo`` is the ELBO of the ``q`` a round *started from*, summed from the clients' reports
(:mod:`numpyro_pvi.server.elbo`): round ``k``'s ELBO judges the step of round ``k - 1``, one round
late. The state keeps that step's damping and momentum (``step_rho``, ``step_beta``) for the
judgement.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.server.merge import is_valid_state

DROP_ROUNDS = 3  # rounds in a row whose ELBO fell before heavy ball says so


class HeavyBallState(NamedTuple):
    """:class:`HeavyBall`'s state (in ``PVIState.damping``).

    :ivar rho: the damping of the next round's merge.
    :ivar beta: the momentum applied after the last round.
    :ivar previous_q: ``q`` (flattened natural parameters) when the last round started.
    :ivar previous_delta: the clients' undamped summed delta of the last round, NaN if it gave none.
    :ivar steps, changes: ``(window, n)`` the last secant pairs ``s`` and ``y``, newest last.
    :ivar num_pairs: how many of them are filled.
    :ivar lambda_min, lambda_max: ``(memory,)`` the last spectrum estimates, newest last (NaN if
        unused).
    :ivar velocity: each factor's change in the last round (stacked like ``PVIState.factors``).
    :ivar elbo: the ELBO after the last round (``-inf`` before the first).
    :ivar ceiling: the largest damping allowed now (halved by an ELBO drop, regrown by rounds that
        do not drop).
    :ivar drops: rounds in a row whose ELBO fell by more than ``elbo_tolerance``.
    :ivar restarts: rounds so far whose ELBO fell (each restarted the momentum).
    :ivar step_rho, step_beta: the damping and momentum of the last round's step, which the next
        round's ELBO (that of the ``q`` the step reached) judges.
    """

    rho: jax.Array
    beta: jax.Array
    previous_q: jax.Array
    previous_delta: jax.Array
    steps: jax.Array
    changes: jax.Array
    num_pairs: jax.Array
    lambda_min: jax.Array
    lambda_max: jax.Array
    velocity: Any
    elbo: jax.Array
    ceiling: jax.Array
    drops: jax.Array
    restarts: jax.Array
    step_rho: jax.Array
    step_beta: jax.Array


class HeavyBall:
    """Damping and heavy-ball momentum for :class:`~numpyro_pvi.Synchronous`, set every round from
    an estimate of the round's spectrum (see the module docstring): the default of
    ``Synchronous()``.

    :param float initial: the damping until two secant pairs exist (the first three rounds).
    :param int window: secant pairs (rounds) in one spectrum estimate.
    :param int memory: spectrum estimates combined (the smallest ``l_min``, the median ``l_max``).
    :param float max_momentum: the largest ``beta`` (it bounds how much Monte Carlo noise is
        amplified).
    :param float maximum: the largest damping.
    :param float elbo_tolerance: an ELBO drop (nats) larger than this restarts the momentum, and
        halves the ceiling of the damping if the round added no momentum.
    :param float grow: the ceiling's growth after a round whose ELBO did not drop.
    :param float minimum: the smallest ceiling.

    **Example:** ``pvi.Synchronous()`` (the default) or
    ``pvi.Synchronous(pvi.HeavyBall(max_momentum=0.5))``; ``pvi.Synchronous(0.5)`` keeps a fixed
    damping and no momentum.
    """

    synchronous_only = True  # its spectrum estimate compares whole synchronous rounds
    reads_previous_factors = True  # the velocity is the round's change of every factor

    def __init__(
        self,
        *,
        initial: float = 0.5,
        window: int = 10,
        memory: int = 5,
        max_momentum: float = 0.7,
        maximum: float = 1.0,
        elbo_tolerance: float = 2.0,
        grow: float = 1.25,
        minimum: float = 1 / 64,
    ) -> None:
        if not 0.0 < minimum <= initial <= maximum <= 1.0:
            raise ValueError(
                f"HeavyBall: need 0 < minimum <= initial <= maximum <= 1, got minimum={minimum}, "
                f"initial={initial}, maximum={maximum}."
            )
        if not (isinstance(elbo_tolerance, (int, float)) and elbo_tolerance >= 0.0):
            raise ValueError(
                f"HeavyBall: elbo_tolerance must be a non-negative number, got {elbo_tolerance!r}."
            )
        if not (isinstance(grow, (int, float)) and grow >= 1.0):
            raise ValueError(f"HeavyBall: grow must be >= 1, got {grow!r}.")
        for name, value in (("window", window), ("memory", memory)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 2:
                raise ValueError(f"HeavyBall: {name} must be an integer >= 2, got {value!r}.")
        if not 0.0 <= max_momentum < 1.0:
            raise ValueError(f"HeavyBall: max_momentum must be in [0, 1), got {max_momentum!r}.")
        self.initial, self.window, self.memory = initial, window, memory
        self.max_momentum, self.maximum = max_momentum, maximum
        self.elbo_tolerance, self.grow, self.minimum = float(elbo_tolerance), float(grow), minimum

    def init(self, q: Any, factors: Any, family: Any) -> HeavyBallState:
        """The state before the first round: damping ``initial``, no momentum, no secant pairs.

        Built in NumPy and sent with ``jax.device_put`` (no eager JAX operation, and not
        ``jnp.asarray``, which compiles a copy for every shape of ``q``)."""
        flat = _flat(q)
        n, dtype = flat.shape[0], flat.dtype
        nan = np.full((self.memory,), np.nan, dtype)
        return jax.device_put(
            HeavyBallState(
                np.asarray(self.initial, dtype),
                np.zeros((), dtype),
                flat,
                np.full(n, np.nan, dtype),
                np.zeros((self.window, n), dtype),
                np.zeros((self.window, n), dtype),
                np.zeros((), np.int32),
                nan,
                nan,
                jax.tree.map(lambda f: np.zeros(f.shape, f.dtype), factors),
                np.asarray(-np.inf, dtype),
                np.asarray(self.maximum, dtype),
                np.zeros((), np.int32),
                np.zeros((), np.int32),
                np.asarray(self.initial, dtype),
                np.zeros((), dtype),
            )
        )

    def rho(self, state: HeavyBallState) -> jax.Array:
        """The damping of the next round's merge (traced under ``jit``)."""
        return state.rho

    def after_merge(
        self, family: Any, before: Any, after: Any, clean: bool, rho_used: float
    ) -> Any:
        """The state after a round: ``after`` (the merged ``PVIState``, from ``before``), its merge
        rescaled to the new damping and the momentum added when both keep ``q`` and every cavity
        valid, with the next round's damping. ``clean``: every client ran and was merged with the
        full damping ``rho_used``.
        """
        # q-sized bookkeeping in NumPy (sent with device_put), factor-sized arithmetic compiled
        # once per structure: no eager JAX operation (each compiles a program for every shape)
        hb, q_start = after.damping, _flat(before.q)
        if clean:
            delta = np.asarray(_step(after.q, before.q, rho_used))
            hb = self._record(hb, q_start, delta)
            rho, beta = self._parameters(hb, rho_used)
        else:
            delta, rho, beta = np.full_like(q_start, np.nan), rho_used, 0.0
        if not bool(_any_nonzero(hb.velocity)):
            # restarted (or the first round): no velocity, no momentum, and a drop now halves the
            # damping
            beta = 0.0
        merged = _subtract(after.factors, before.factors)
        q, factors = _extrapolate(
            family, after.q, after.factors, merged, hb.velocity, rho / rho_used - 1.0, beta
        )
        dtype = hb.rho.dtype
        hb = hb._replace(
            **jax.device_put(
                dict(
                    rho=np.asarray(rho, dtype),
                    beta=np.asarray(beta, dtype),
                    previous_q=q_start,
                    previous_delta=delta,
                )
            ),
            velocity=_subtract(factors, before.factors),
        )
        return after._replace(q=q, factors=factors, damping=hb)

    def _record(self, hb: HeavyBallState, q_start: jax.Array, delta: jax.Array) -> HeavyBallState:
        """Add the secant pair ``(q_k - q_{k-1}, -(Delta_k - Delta_{k-1}))`` and the spectrum
        estimate it gives."""
        previous_delta = np.asarray(hb.previous_delta)
        step = q_start - np.asarray(hb.previous_q)
        if not np.all(np.isfinite(previous_delta)) or not np.any(step != 0):
            return hb
        steps = np.concatenate([np.asarray(hb.steps)[1:], step[None]])
        changes = np.concatenate([np.asarray(hb.changes)[1:], (previous_delta - delta)[None]])
        num_pairs = min(int(hb.num_pairs) + 1, self.window)
        hb = hb._replace(
            **jax.device_put(
                dict(steps=steps, changes=changes, num_pairs=np.asarray(num_pairs, np.int32))
            )
        )
        if num_pairs < 2:
            return hb
        bounds = ritz_bounds(steps[-num_pairs:], changes[-num_pairs:])
        if bounds is None:
            return hb
        low, high = bounds

        def push(memory: jax.Array, value: float) -> jax.Array:
            memory = np.asarray(memory)
            return jax.device_put(np.concatenate([memory[1:], np.asarray([value], memory.dtype)]))

        return hb._replace(
            lambda_min=push(hb.lambda_min, low), lambda_max=push(hb.lambda_max, high)
        )

    def _parameters(self, hb: HeavyBallState, rho_used: float) -> tuple[float, float]:
        """Polyak's damping and momentum for the widened spectrum estimate (``rho_used`` and none
        before one)."""
        ceiling = float(hb.ceiling)
        if bool(jnp.all(jnp.isnan(hb.lambda_min))):
            return min(rho_used, ceiling), 0.0
        low = 0.5 * float(jnp.nanmin(hb.lambda_min))
        high = 1.25 * float(jnp.nanmedian(hb.lambda_max))
        rho, beta = polyak_parameters(low, high, self.max_momentum)
        return min(rho, self.maximum, ceiling), beta

    def after_round(self, hb: HeavyBallState, elbo: float, backtracked: bool) -> HeavyBallState:
        """The state once the round's ELBO (of the ``q`` the round started from, which the last
        round's step reached) is known: a drop restarts the momentum (the next round adds none)
        and, if the step it judges had no momentum, caps the damping at half that step's; a round
        without a drop raises the cap by ``grow``."""
        dtype = hb.rho.dtype
        # the step this ELBO judges (the last round's); this round's is judged by the next ELBO
        judged_rho, judged_beta = float(hb.step_rho), float(hb.step_beta)
        hb = hb._replace(step_rho=hb.rho, step_beta=hb.beta)
        dropped = (
            bool(np.isfinite(float(hb.elbo))) and not elbo >= float(hb.elbo) - self.elbo_tolerance
        )
        # a NaN ELBO is a drop, never the reference
        elbo = elbo if np.isfinite(elbo) else float(hb.elbo)
        # a drop with momentum: restart it; a drop without (the damping overshot): halve the damping
        if dropped:
            ceiling = (
                max(0.5 * judged_rho, self.minimum) if judged_beta == 0.0 else float(hb.ceiling)
            )
            return hb._replace(
                rho=jnp.asarray(min(float(hb.rho), ceiling), dtype),
                beta=jnp.zeros((), dtype),
                velocity=jax.tree.map(jnp.zeros_like, hb.velocity),
                elbo=jnp.asarray(elbo, dtype),
                ceiling=jnp.asarray(ceiling, dtype),
                drops=hb.drops + 1,
                restarts=hb.restarts + 1,
            )
        ceiling = min(float(hb.ceiling) * self.grow, self.maximum)
        return hb._replace(
            elbo=jnp.asarray(elbo, dtype),
            ceiling=jnp.asarray(ceiling, dtype),
            drops=jnp.zeros_like(hb.drops),
        )

    def after_new_client(self, state: HeavyBallState, q: Any, factors: Any) -> HeavyBallState:
        """A restart after :meth:`PVI.add_client <numpyro_pvi.PVI.add_client>` (the round is
        another operator)."""
        return self.init(q, factors, None)

    def warning(self, state: HeavyBallState) -> tuple[str, str] | None:
        """``(cause, message)`` when the ELBO fell :data:`DROP_ROUNDS` rounds in a row (restarts
        and halved dampings did not help), else None."""
        if int(state.drops) < DROP_ROUNDS:
            return None
        return (
            "elbo falling",
            f"Synchronous(): the ELBO fell in each of the last {int(state.drops)} rounds although "
            "every drop restarted the momentum and halved the damping (now "
            f"{float(state.rho):.3g}): the clients' updates do not improve q from here (too "
            "noisy, or far from linear). Try more local steps or particles, a smaller local step "
            "size, or Sequential().",
        )

    def __repr__(self) -> str:
        return (
            f"HeavyBall(initial={self.initial}, window={self.window}, "
            f"max_momentum={self.max_momentum})"
        )


def ritz_bounds(
    steps: np.ndarray, changes: np.ndarray, rcond: float = 1e-8
) -> tuple[float, float] | None:
    """The smallest and largest Ritz value of ``P`` on the span of ``steps`` given ``changes ~ steps
    @ P.T`` (rows are pairs), clipped to ``[1e-3, 1]`` and ``[1, 20]``; None if the steps span
    nothing (all zero).

    Steps that are (numerically) combinations of others add no direction: the Ritz matrix is taken
    on the orthonormal basis of their span, ``U^T P U = U^T Y V S^-1`` from the SVD ``steps.T = U S
    V^T``.

    **Example:** for ``P = diag(0.1, 1, 3)`` and steps ``eye(3)``, ``ritz_bounds(eye(3), eye(3) @
    P.T)`` is ``(0.1, 3.0)``.
    """
    s, y = np.asarray(steps, np.float64).T, np.asarray(changes, np.float64).T
    if not (np.all(np.isfinite(s)) and np.all(np.isfinite(y))):
        return None
    u, sigma, vt = np.linalg.svd(s, full_matrices=False)
    keep = sigma > rcond * max(sigma.max(initial=0.0), np.finfo(np.float64).tiny)
    if not np.any(keep):
        return None
    ritz = u[:, keep].T @ y @ vt[keep].T / sigma[keep]
    eigenvalues = np.linalg.eigvals(ritz).real
    return float(np.clip(eigenvalues.min(), 1e-3, 1.0)), float(
        np.clip(eigenvalues.max(), 1.0, 20.0)
    )


def polyak_parameters(
    lambda_min: float, lambda_max: float, max_momentum: float = 1.0
) -> tuple[float, float]:
    """Polyak's heavy-ball damping and momentum for a spectrum in ``[lambda_min, lambda_max]``, the
    momentum at most ``max_momentum``.

    Heavy ball contracts an eigenvalue ``l``'s mode at the rate ``sqrt(beta)`` while ``rho * l``
    lies in ``[(1 - sqrt(beta))^2, (1 + sqrt(beta))^2]``, and diverges once ``rho * l > 2 (1 +
    beta)``. Polyak's pair puts ``rho * lambda_max`` at the top of that interval; a momentum capped
    below Polyak's lowers the top, so the damping is lowered with it to ``(1 + sqrt(beta))^2 /
    lambda_max``. (Capping only the momentum diverged: the spectrum estimated on sklearn's diabetes
    data, ``[5e-4, 4.05]``, gave ``rho = 1`` and ``beta = 0.7``, and ``rho * lambda_max = 4.05 >
    3.4``.)

    **Example:** ``polyak_parameters(1.0, 1.0)`` is ``(1.0, 0.0)`` (one exact step); ``(0.139,
    4.61)`` gives ``(0.63, 0.50)``; ``(0.139, 4.61, 0.3)`` gives ``(0.52, 0.30)``.
    """
    low, high = np.sqrt(lambda_min), np.sqrt(lambda_max)
    rho, beta = 4.0 / (low + high) ** 2, ((high - low) / (high + low)) ** 2
    if beta > max_momentum:
        beta = max_momentum
        rho = min(rho, (1.0 + np.sqrt(beta)) ** 2 / lambda_max)
    return float(rho), float(beta)


def _extrapolate(
    family: Any, q: Any, factors: Any, merged: Any, velocity: Any, rescale: float, beta: float
) -> tuple:
    """``(q, factors)`` moved by ``rescale`` times the merge's change and ``beta`` times the last
    velocity, the move halved until ``q`` and every cavity are valid (none if no halving is)."""
    if rescale == 0.0 and beta == 0.0:
        return q, factors
    return _extrapolate_jit(
        family, q, factors, merged, velocity, jnp.asarray(rescale), jnp.asarray(beta)
    )


def _move(
    family: Any,
    q: Any,
    factors: Any,
    merged: Any,
    velocity: Any,
    rescale: jax.Array,
    beta: jax.Array,
) -> tuple:
    move = jax.tree.map(lambda m, v: rescale * m + beta * v, merged, velocity)

    def propose(t: jax.Array) -> tuple:
        new_factors = jax.tree.map(lambda f, d: f + t * d, factors, move)
        new_q = jax.tree.map(lambda a, d: a + t * d.sum(0), q, move)
        return (new_q, new_factors), is_valid_state(family, new_q, new_factors)

    out = backtrack(propose, 1.0, 4)
    keep = lambda new, old: jnp.where(out.valid, new, old)  # noqa: E731
    return jax.tree.map(keep, out.value[0], q), jax.tree.map(keep, out.value[1], factors)


_extrapolate_jit = jax.jit(_move, static_argnums=0)


def _flat(tree: Any) -> np.ndarray:
    """``ravel_pytree(tree)[0]`` in NumPy (the same order and values, nothing compiled)."""
    return np.concatenate([np.ravel(np.asarray(leaf)) for leaf in jax.tree.leaves(tree)])


@jax.jit
def _step(q: Any, q_start: Any, rho: float) -> jax.Array:
    """``(q - q_start) / rho``, flattened: the merge's step at full damping (compiled: XLA's
    division by a scalar rounds otherwise than NumPy's, and the secant pairs must not change)."""
    return (ravel_pytree(q)[0] - ravel_pytree(q_start)[0]) / rho


@jax.jit
def _subtract(a: Any, b: Any) -> Any:
    """``a - b`` leaf by leaf (the factors: one compiled program per structure)."""
    return jax.tree.map(jnp.subtract, a, b)


@jax.jit
def _any_nonzero(tree: Any) -> jax.Array:
    """Whether any entry of any leaf is nonzero."""
    return jnp.any(jnp.stack([jnp.any(leaf != 0) for leaf in jax.tree.leaves(tree)]))
