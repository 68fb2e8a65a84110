"""What a run says about itself: how far each round moved ``q``, whether it converged, and why it
stopped.

No run ends at a wrong answer without saying so. After every round :class:`RunMonitor` looks at the
round's :class:`~numpyro_pvi.RoundInfo` and issues a :class:`PVIWarning` (once per cause per run)
when

* every update of the round was rejected or clamped away (with the reasons; for ``max_staleness``,
  the staleness seen and the value that would admit the updates);
* ``q`` has not moved for :data:`STALL_ROUNDS` rounds while updates were rejected or clamped;
* a client timed out in each of the last :data:`STALL_ROUNDS` rounds (Ray), or its update raised or
  was NaN in each of its last :data:`STALL_ROUNDS` attempts;
* a client's next update would exceed its privacy budget (once per client: it sends nothing from
  then on);
* the ELBO fell in each of the last :data:`STALL_ROUNDS` rounds, by more than :data:`ELBO_FALL` of
  its range;
* a factorised family (``MeanFieldGaussian``) meets correlated tilted distributions with more than
  one client (EP, SNEP): the fixed point's sds are then neither the posterior's nor mean-field VI's
  (:data:`CORRELATED`);
* the run ends without converging (``tol`` given) or far from it (after two rounds or more, the last
  round still moved ``q`` by more than :data:`FAR` posterior sds): the message (and
  ``PVIRunResult.stopped_because``) tells a ``q`` still moving from one jittering at the Monte Carlo
  noise floor of the local updates, or swinging back and forth.

A run is **converged** (:meth:`RunMonitor.earned`) only when its last round moved ``q`` by at most
``tol`` *and* every update that round was merged unclamped (none rejected, clamped away or clamped
at all; a client out of privacy budget aside) *and* every client has been merged at least once
(client sampling) *and* the ELBO is not falling *and* ``q`` is not drifting one way with more than
``tol`` still to go (:attr:`RunMonitor.drifting`) *and* no factorised EP fixed point is flagged
(:attr:`RunMonitor.correlated`: such a run stops once ``q`` settles, unconverged).
"""

from __future__ import annotations

import warnings
from collections import deque
from typing import Any

import numpy as np

from numpyro_pvi.state import Rejection, RoundInfo

STALL_ROUNDS = 3  # rounds without movement (or of failures, or of ELBO falls) before a run says so
# a last round that moved q by more than this many posterior sds ends a run far from converged
FAR = 0.5
TREND_ROUNDS = 6  # the last moves of q that tell "still moving" from "jittering at the noise floor"
FALLING = 0.8  # a change of q that shrinks by this factor a round (or faster) is still moving
DIRECTED = 0.5  # consecutive moves of q with a mean cosine above this go one way: still moving
SWINGING = -0.8  # ... below this, q swings back and forth
# a coordinate whose moves over the last TREND_ROUNDS sum to more than this many times their root
# mean square drifts (coordinate_drift; at a noise floor the sum is about one move's size)...
DRIFT = 4.0
DRIFT_FLOOR = 2.0  # ... if that sum is also more than this many times tol
# ... and more than this many times the squared moves of q over the streak (in nats: at the noise
# floor of GradientUpdate, Sequential, linear model, 8 seeds x 30 rounds, streaks lost up to 0.99
# times)
JITTER = 3.0
# a streak of ELBO falls counts when it loses this fraction of the ELBO's range so far
ELBO_FALL = 0.01
# M (v - 1) above this flags a factorised EP / SNEP fixed point: M clients, v their mean tilted
# variance inflation beyond the family's form (ClientResult.inflation). M (v - 1) / 2 approximates
# how far the fixed point's sds are above mean-field VI's (and they are below the posterior's).
# Measured on linear-Gaussian models in closed form (benchmarks/mean_field_ep.py: 2-5 coordinates,
# correlations 0.2-0.95, 2-20 iid or skewed clients, 126 cases): all 54 fixed points more than 10 %
# from both the posterior's and mean-field VI's sds are flagged, every one not flagged is within 8.8
# % of one of them.
CORRELATED = 0.2

#: ``PVIRunResult.stopped_because``: why a run stopped (every reason but ``"converged"`` and
#: ``"factorised_correlation"`` ran all its rounds).
STOP_REASONS = {
    "converged": "q settled within tol, every update of the last round merged, every client "
    "merged once",
    "num_rounds": "all rounds run; no tol was given and nothing went wrong",
    "not_merged": "updates of the last round were rejected or clamped away",
    "clamped": "updates of the last round were clamped: q stopped where the clamps held it, not "
    "where clients agree",
    "unmerged_clients": "some clients were never merged (client sampling)",
    "elbo_falling": "the ELBO fell in each of the last rounds",
    "still_moving": "q still moving (its change shrinking or going one way): more rounds help",
    "noise_floor": "q jittering at the Monte Carlo noise floor: more particles or steps help, not "
    "rounds",
    "factorised_correlation": "q settled at the EP / SNEP fixed point of a factorised family over "
    "correlated clients: its sds are neither the posterior's nor "
    "mean-field VI's (FullRankGaussian() helps)",
    "swinging": "q swinging back and forth: a smaller damping or Sequential() helps",
    "not_settled": "q moved more than tol; too few rounds to tell why",
}


class PVIWarning(UserWarning):
    """A run that cannot do what was asked says so: rejected, clamped or stale updates, a stall, no
    convergence.

    **Example:** ``warnings.simplefilter("error", pvi.PVIWarning)`` turns them into errors.
    """


def q_move(family: Any, old: Any, new: Any) -> np.ndarray:
    """How ``q`` moved, per coordinate: the change of each marginal mean in new sds, then of each
    log sd."""
    a, b = family.marginals(old), family.marginals(new)
    mean = (np.asarray(b.mean) - np.asarray(a.mean)) / np.sqrt(np.asarray(b.variance))
    log_sd = 0.5 * (np.log(np.asarray(b.variance)) - np.log(np.asarray(a.variance)))
    return np.concatenate([np.ravel(mean), np.ravel(log_sd)])


def largest(move: np.ndarray) -> float:
    """``RoundInfo.change`` of a move: its largest entry in absolute value (``inf`` if not
    finite)."""
    change = float(np.max(np.abs(move))) if np.size(move) else 0.0
    return change if np.isfinite(change) else float("inf")


def q_change(family: Any, old: Any, new: Any) -> float:
    """How far ``q`` moved: the largest ``|change of a marginal mean| / new sd`` or ``|change of a
    log sd|``."""
    return largest(q_move(family, old, new))


def trend(moves: list) -> tuple[str, float, float] | None:
    """``(kind, shrink, cosine)`` of the last non-zero moves of ``q`` (``None`` with fewer than 4).

    ``shrink``: the factor the change falls by per round (a log-linear fit); ``cosine``: the mean
    cosine of consecutive moves. ``kind``: ``"still_moving"`` (shrinking by :data:`FALLING` or
    faster, or going one way), ``"swinging"`` (back and forth, not shrinking) or ``"noise_floor"``
    (neither: moves in unrelated directions of a size that does not fall, the mark of Monte Carlo
    noise in the local updates).
    """
    moves = [m for m in moves if np.all(np.isfinite(m)) and np.any(m != 0)][-TREND_ROUNDS:]
    if len(moves) < 4:
        return None
    v = np.stack(moves)
    norm, change = np.linalg.norm(v, axis=1), np.max(np.abs(v), axis=1)
    unit = v / norm[:, None]
    cosine = float(np.mean(np.sum(unit[1:] * unit[:-1], axis=1)))
    shrink = float(np.exp(np.polyfit(np.arange(len(change)), np.log(change), 1)[0]))
    if shrink <= FALLING or cosine > DIRECTED:
        return "still_moving", shrink, cosine
    return ("swinging" if cosine < SWINGING else "noise_floor"), shrink, cosine


def coordinate_drift(moves: list, floor: float) -> tuple[float, int]:
    """``(to_go, coordinate)``: the largest distance (in posterior sds) still to go of a coordinate
    of ``q`` that drifts one way over the last :data:`TREND_ROUNDS` moves, and its index (``(0.0,
    -1)`` if none does).

    A coordinate drifts when its moves summed over each half of the window go the same way, by more
    than ``floor`` in all and by more than :data:`DRIFT` times the root mean square of its moves: at
    a noise floor the moves are differences of a jitter about a fixed point, so their sum over any
    window is one such difference (about one move's size), while a drift adds up (six moves of a
    steady size sum to six times it). A move against the drift here and there (Monte Carlo jitter)
    does not hide it. The distance is ``|late| r / (1 - r)`` for the ratio ``r = late / early`` of
    the two halves' sums (``inf`` if it is not below 1): what is left of a linearly converging
    coordinate. One slow coordinate goes unseen by the whole move of ``q``: on a correlated
    posterior (mean field, sklearn's diabetes data) two coefficients moved 0.04-0.07 sds a round,
    one way, while the others jittered by as much in unrelated directions, and q was still 0.57 sds
    from its optimum; later in such runs a coefficient moving 0.04 sds a round moved 0.002 sds the
    other way once, and a rule that asked for one sign in every move said converged=True 0.31 sds
    from the optimum.
    """
    moves = [m for m in moves if np.all(np.isfinite(m)) and np.any(m != 0)][-TREND_ROUNDS:]
    if len(moves) < TREND_ROUNDS:
        return 0.0, -1
    v = np.stack(moves)
    half = len(v) // 2
    early, late = v[:half].sum(0), v[half:].sum(0)
    net, rms = early + late, np.sqrt(np.mean(np.square(v), axis=0))
    one_way = (early * late > 0) & (np.abs(net) > floor) & (np.abs(net) > DRIFT * rms)
    if not np.any(one_way):
        return 0.0, -1
    ratio = late[one_way] / early[one_way]
    to_go = np.where(
        ratio < 1.0, np.abs(late[one_way]) * ratio / (1.0 - np.minimum(ratio, 1.0 - 1e-12)), np.inf
    )
    best = int(np.argmax(to_go))
    return float(to_go[best]), int(np.flatnonzero(one_way)[best])


def lost(info: RoundInfo) -> np.ndarray:
    """``(M,)`` whether each client's last update was rejected, or merged as nothing (every step
    clamped away; a converged exact update also sends 0, unclamped)."""
    rejection, clamped = np.asarray(info.rejection), np.asarray(info.clamped)
    moved = np.ones(rejection.shape, bool) if info.moved is None else np.asarray(info.moved, bool)
    return (rejection > 0) | (~moved & (clamped > 0))


def recorded_clients(info: RoundInfo) -> np.ndarray:
    """The ids of the clients a round's per-client fields describe: ``info.clients``, or every
    client (``0 .. M - 1``) where the record is dense."""
    if info.clients is not None:
        return np.asarray(info.clients, int)
    return np.arange(np.size(info.attempts))


def merged_clients(history: RoundInfo | None) -> np.ndarray:
    """``(M,)`` whether each client was merged (accepted, not clamped away) in some round of
    ``history`` (up to the largest id a sampled history recorded)."""
    if history is None or history.rejection is None:
        return np.zeros(0, bool)
    history = history.dense()
    accepted = np.atleast_2d(np.asarray(history.accepted)) > 0
    rejection, clamped = (
        np.atleast_2d(np.asarray(history.rejection)),
        np.atleast_2d(np.asarray(history.clamped)),
    )
    moved = accepted if history.moved is None else np.atleast_2d(np.asarray(history.moved, bool))
    away = ~moved & (clamped > 0) & (rejection == 0)
    return np.any(accepted & ~away, axis=0)


class RunMonitor:
    """Watches the rounds of one run, warns once per cause when it cannot do what was asked, and
    says whether (and why not) it converged.

    :param server: the run's server (for its settings in messages).
    :param tol: the run's ``tol`` (``None``: no convergence verdict).
    :param history: the rounds before this run (``init_history``): which clients were merged, the
        ELBOs.
    """

    def __init__(
        self, server: Any, tol: float | None = None, history: RoundInfo | None = None
    ) -> None:
        self.server, self.tol, self.warned, self.still = server, tol, set(), 0
        self.timeouts = np.zeros(0, int)  # consecutive rounds in which each client timed out
        # consecutive attempts in which each client's update raised or was NaN
        self.failures = np.zeros(0, int)
        self.failure_code = np.zeros(0, int)  # and the Rejection of its last failure
        self.merged = merged_clients(history)  # which clients have been merged at least once
        self.before = 0 if history is None else int(np.size(history.elbo))  # rounds before this run
        window = TREND_ROUNDS + STALL_ROUNDS + 1  # the ELBOs a falling streak is judged on
        # the ELBOs of q's that rounds reached: RoundInfo.elbo is the ELBO of the q a round started
        # from, so the first round's is the initial q's (often the prior's, thousands of nats below:
        # no round's result, left out of the spread and the range a fall is measured against)
        reached = [] if history is None else np.ravel(history.elbo)[1:]
        self.elbos: deque = deque(np.asarray(reached)[-window:].tolist(), maxlen=window)
        self.elbo_range = _span(reached)
        # how far the ELBO fell in its last STALL_ROUNDS rounds (0 unless it fell in each)
        self.fallen = 0.0
        self.moves: deque = deque(maxlen=TREND_ROUNDS)  # the last moves of q (q_move)
        self.last: RoundInfo | None = None
        self.all_merged, self.clamped, self.falling, self.rounds = False, False, False, 0
        # the last round's mean tilted variance inflation; clients merged
        self.inflation, self.num_merged = 1.0, int(np.sum(self.merged))
        self.num_clients = 0

    def warn(self, cause: str, message: str) -> None:
        if cause not in self.warned:
            self.warned.add(cause)
            warnings.warn(message, PVIWarning, stacklevel=4)

    @property
    def settled(self) -> bool:
        """Whether ``q`` settled in the last round: it moved by at most ``tol``, every update that
        round was merged, every client has been merged at least once, the ELBO is not falling and
        ``q`` is not drifting. The run stops there: it converged (:attr:`earned`), or ``q`` settled
        at a flagged fixed point (more rounds only hold it there)."""
        info = self.last
        return (
            info is not None
            and self.tol is not None
            and bool(info.change <= self.tol)
            and self.all_merged
            and not self.clamped
            and not self.falling
            and self.num_merged == self.merged.size
            and not self.drifting
        )

    @property
    def earned(self) -> bool:
        """Whether the last round converged: ``q`` settled (:attr:`settled`) where it is meant to
        (not :attr:`correlated`)."""
        return self.settled and not self.correlated

    @property
    def correlated(self) -> bool:
        """Whether ``q`` is a factorised EP / SNEP fixed point over correlated clients: ``M > 1``
        clients and ``M (v - 1) > CORRELATED``, ``v`` the mean over the last round's clients of
        ``RoundInfo.inflation`` (the variance inflation of their tilted distributions beyond the
        family's form; 1 for a family that holds correlations, and for updates that do not measure
        it). With one client EP's marginals are exact. ``M`` counts every client, merged or not: a
        factorised proposal of a correlated tilted distribution has a low effective sample size, so
        such clients' steps are clamped away, a symptom of the same mismatch."""
        return self.num_clients > 1 and self.num_clients * (self.inflation - 1.0) > CORRELATED

    @property
    def drifting(self) -> bool:
        """Whether ``q`` moves one way, slowly, with more than ``tol`` still to go (:meth:`to_go`).
        A small step is then not a settled ``q``: an ill-conditioned posterior can move ``q`` by
        0.04 sds a round while it is still 0.25 sds away."""
        return self.tol is not None and self.last is not None and self.to_go() > self.tol

    def to_go(self) -> float:
        """How far ``q`` still has to go, in posterior sds, if it is moving one way (0 if not): when
        its last moves go in one direction (mean cosine above :data:`DIRECTED`), ``change * r / (1 -
        r)`` for a change shrinking by ``r`` a round (a linearly converging iteration); and the most
        of any coordinate that drifted one way over the last :data:`TREND_ROUNDS` rounds, by more
        than :data:`DRIFT_FLOOR` ``* tol`` in all and
        :data:`DRIFT` times its moves' root mean square (:func:`coordinate_drift`)."""
        moves = list(self.moves)
        seen, whole = trend(moves), 0.0
        if seen is not None and seen[2] > DIRECTED and self.last is not None:
            shrink = seen[1]
            whole = np.inf if shrink >= 1.0 else self.last.change * shrink / (1.0 - shrink)
        return max(whole, self._slow_coordinate()[0])

    @property
    def _limit(self) -> float:
        """The change a run must get below: ``tol``, or :data:`FAR` without one."""
        return FAR if self.tol is None else self.tol

    def _slow_coordinate(self) -> tuple[float, int]:
        """:func:`coordinate_drift` of the last moves, counting coordinates that moved more than
        DRIFT_FLOOR limits."""
        return coordinate_drift(list(self.moves), DRIFT_FLOOR * self._limit)

    def after_round(
        self,
        info: RoundInfo,
        staleness: list,
        move: np.ndarray | None = None,
        num_clients: int | None = None,
    ) -> None:
        """Check one round (``staleness``: of the updates rejected as stale; ``move``:
        :func:`q_move`; ``num_clients``: ``M``, default the size of a dense record). A sampled
        round's record (``info.clients``) is checked in the time its ``K`` clients take."""
        self.last, self.rounds = info, self.rounds + 1
        if move is not None:
            self.moves.append(np.asarray(move))
        ids = recorded_clients(info)
        # every recorded id has a slot (a sampled record's ids are distinct)
        size = max(
            np.size(info.attempts) if num_clients is None else num_clients,
            int(ids.max(initial=-1)) + 1,
        )
        attempts = np.asarray(info.attempts) > 0
        rejection, gone = np.asarray(info.rejection), lost(info)
        budget = ids[rejection == Rejection.BUDGET]
        for client in budget.tolist():
            self.warn(
                f"budget {client}",
                f"Client {client} has spent its privacy budget: its next update would exceed "
                "privacy_budget, so it sends nothing from now on (Rejection.BUDGET).",
            )
        if (
            attempts.any()
            and np.all(gone[attempts])
            and not np.all(rejection[attempts] == Rejection.BUDGET)
        ):
            self._nothing_merged(info, staleness)
        # a client out of budget sends nothing more: its factor is final
        spent = rejection == Rejection.BUDGET
        self.all_merged = bool(np.any(attempts & ~gone)) and not np.any(attempts & gone & ~spent)
        self.clamped = bool(np.any(np.asarray(info.clamped)[attempts] > 0))
        # not clamped away
        merged_now = (np.asarray(info.accepted) > 0) & ~(gone & (rejection == 0))
        self.merged = _grown(self.merged, size, False)
        self.num_merged += int(np.sum(merged_now & ~self.merged[ids]))
        self.merged[ids] |= merged_now
        self.num_clients = int(size)
        if info.inflation is not None and np.any(attempts):
            self.inflation = float(np.mean(np.asarray(info.inflation)[attempts]))
        self._failing(ids, size, rejection, attempts)
        self._elbo(float(info.elbo))
        troubled = info.num_rejected > 0 or np.asarray(info.clamped).sum() > 0
        self.still = self.still + 1 if info.change == 0.0 and troubled else 0
        if self.still >= STALL_ROUNDS:
            self.warn(
                "stalled",
                f"q has not moved for {self.still} rounds while client updates were rejected or "
                "clamped: the run is stalled, not converged. RoundInfo.rejection says why "
                "updates were rejected; RoundInfo.clamped counts steps halved to stay valid.",
            )

    def _failing(
        self, ids: np.ndarray, size: int, rejection: np.ndarray, attempts: np.ndarray
    ) -> None:
        """Count the timeouts (rounds) and failed attempts (raised or NaN) of the round's clients
        ``ids`` (of ``size`` in all); warn naming the clients."""
        timed_out = rejection == Rejection.TIMEOUT
        # clients added since (a Flower site that joined mid-run) start with none
        self.timeouts = _grown(self.timeouts, size, 0)
        self.timeouts[ids] = np.where(timed_out, self.timeouts[ids] + 1, 0)
        late = ids[self.timeouts[ids] >= STALL_ROUNDS]
        if late.size:
            self.warn(
                "timeouts",
                f"Client(s) {late.tolist()} timed out (or their actors died) in each of the last "
                f"{STALL_ROUNDS} rounds: their data never reach q. Raise RayBackend(timeout=...) "
                "or give the clients less local work.",
            )
        failed = (rejection == Rejection.RAISED) | (rejection == Rejection.NON_FINITE)
        self.failures = _grown(self.failures, size, 0)
        self.failure_code = _grown(self.failure_code, size, 0)
        count, code = self.failures[ids], self.failure_code[ids]
        self.failures[ids] = np.where(attempts, np.where(failed, count + 1, 0), count)
        self.failure_code[ids] = np.where(attempts & failed, rejection, code)
        bad = ids[self.failures[ids] >= STALL_ROUNDS]
        if bad.size:
            how = ", ".join(
                f"{m}: {Rejection(int(self.failure_code[m])).name}" for m in bad.tolist()
            )
            self.warn(
                "failing",
                f"Client(s) {bad.tolist()} failed in each of their last {STALL_ROUNDS} updates "
                f"({how}; RAISED: the update raised an exception, NON_FINITE: its change or free "
                "energy was NaN or inf): their data never reach q. Check those clients' data, or "
                "use a smaller step size or more particles.",
            )

    def _elbo(self, elbo: float) -> None:
        """Whether the ELBO fell in each of the last STALL_ROUNDS rounds, by more than ELBO_FALL of
        its range so far, more than its spread over the TREND_ROUNDS rounds before and more than
        JITTER times the squared moves of q over those rounds (what jittering at a noise floor
        costs); warn if so. ``elbo`` is that of the ``q`` the round started from
        (``RoundInfo.elbo``): the falls seen are those of the rounds before this one, one round
        late."""
        if self.before + self.rounds == 1:  # the initial q's ELBO: no round reached it
            return
        self.elbos.append(elbo)
        if np.isfinite(elbo):
            self.elbo_range = (min(self.elbo_range[0], elbo), max(self.elbo_range[1], elbo))
        seen = list(self.elbos)
        streak, before = seen[-STALL_ROUNDS - 1 :], seen[: -STALL_ROUNDS - 1]
        falls = len(streak) == STALL_ROUNDS + 1 and all(b < a for a, b in zip(streak, streak[1:]))
        self.fallen = streak[0] - streak[-1] if falls else 0.0
        spread = max(before) - min(before) if len(before) >= 2 else 0.0
        span = self.elbo_range[1] - self.elbo_range[0]
        # q jittering by a move m (in sds) about its optimum costs about |m|^2 / 2 nats of ELBO a
        # round; the ELBOs seen are of the q each round started from: the falls are the moves of
        # the STALL_ROUNDS rounds before this one
        judged = list(self.moves)[-STALL_ROUNDS - 1 : -1]
        jitter = sum(float(np.sum(np.square(m))) for m in judged)
        self.falling = bool(falls and self.fallen > max(spread, ELBO_FALL * span, JITTER * jitter))
        if self.falling:
            self.warn(
                "elbo falling",
                f"The ELBO fell in each of the last {STALL_ROUNDS} rounds, by {self.fallen:.4g} "
                "in all (RoundInfo.elbo uses the same draws every round: the falls are real, not "
                "sampling noise): the server overshoots or the run diverges. Use a smaller "
                "damping or Sequential(); the run is not converged unless q settles after.",
            )

    def _nothing_merged(self, info: RoundInfo, staleness: list) -> None:
        codes = np.asarray(info.rejection)[np.asarray(info.attempts) > 0]
        if staleness and np.all(codes == Rejection.STALE):
            limit = getattr(self.server, "max_staleness", None)
            self.warn(
                "stale",
                f"Asynchronous(max_staleness={limit}) rejected every update: they were "
                f"{min(staleness)}-{max(staleness)} merges stale; max_staleness >= "
                f"{min(staleness)} would admit the freshest (with M clients of equal speed "
                "updates are about M - 1 merges stale).",
            )
            return
        reasons = _reasons(codes)
        clamped = int(np.asarray(info.clamped).sum())
        self.warn(
            "nothing merged",
            "Every client update of a round was rejected or clamped away: q did not move "
            f"(rejected: {reasons or 'none'}; steps clamped: {clamped}). Try a smaller step size "
            "or damping, more particles, or check the data.",
        )

    def at_end(self) -> tuple[bool | None, str]:
        """``(converged, stopped_because)`` of the run (``converged`` is ``None`` without ``tol``);
        a :class:`PVIWarning` naming ``stopped_because`` whenever the run did not converge."""
        if self.earned:
            return True, "converged"
        reason, message = self._why()
        if reason != "num_rounds":
            self.warn("end", f"{message} (result.stopped_because == {reason!r})")
        return (None if self.tol is None else False), reason

    def _why(self) -> tuple[str, str]:
        """The first reason the run is not converged, and the message that explains it."""
        info, tol = self.last, self.tol
        # first: with correlated clients a factorised family's clamps are a symptom
        if self.correlated:
            return "factorised_correlation", self._correlation_message()
        if tol is not None and not self.all_merged:
            codes = np.asarray(info.rejection)[lost(info) & (np.asarray(info.attempts) > 0)]
            return "not_merged", (
                f"The run did not converge in {self.rounds} rounds: updates of its last round "
                f"were rejected or clamped away (rejected: {_reasons(codes) or 'none'}; steps "
                f"clamped: {int(np.asarray(info.clamped).sum())}), so q's small change is not "
                "convergence."
            )
        if tol is not None and self.clamped:
            attempted = np.asarray(info.attempts) > 0
            clamped = attempted & (np.asarray(info.clamped) > 0)
            clients = recorded_clients(info)[clamped].tolist()
            return "clamped", (
                f"The run did not converge in {self.rounds} rounds: the updates of client(s) "
                f"{clients[:10]} in its last round were clamped "
                f"({int(np.asarray(info.clamped).sum())} steps halved or replaced to keep q "
                "valid), so q stopped where the clamps held it, not where the clients agree. Use "
                "a smaller local step size, more particles or chains, or start nearer the answer "
                "(init_loc_fn)."
            )
        if self.falling:
            return "elbo_falling", (
                f"The run did not converge in {self.rounds} rounds: the ELBO fell in each of its "
                f"last {STALL_ROUNDS} rounds (by {self.fallen:.4g}). Use a smaller damping or "
                "Sequential()."
            )
        if tol is not None and not np.all(self.merged):
            never = np.flatnonzero(~self.merged)
            return "unmerged_clients", (
                f"The run did not converge in {self.rounds} rounds: {never.size} of "
                f"{self.merged.size} clients were never merged (e.g. {never[:10].tolist()}), so q "
                "does not hold their data yet. With client sampling (clients_per_round) run more "
                "rounds until every client has been drawn; continuing from a bare state, pass "
                "init_history= so the run knows which clients were merged before."
            )
        limit = FAR if tol is None else tol
        drifting = tol is not None and self.drifting
        if (info.change <= limit and not drifting) or (
            tol is None and self.rounds + self.before < 2
        ):
            return "num_rounds", ""
        return self._moving(info.change, tol)

    def _correlation_message(self) -> str:
        m, v = self.num_clients, self.inflation
        return (
            f"The run did not converge in {self.rounds} rounds: the clients' tilted distributions "
            f"are correlated (mean variance inflation {v:.3g}: a coordinate's variance is {v:.3g} "
            "times what fixing the others leaves it), and the factorised family cannot represent "
            f"the correlation. With {m} clients the EP / SNEP fixed point's sds are then neither "
            "the posterior's marginals (they are smaller) nor mean-field VI's (about "
            f"{50 * m * (v - 1.0):.0f} % larger). Use FullRankGaussian() for the posterior's sds, "
            "or GradientUpdate / NaturalGradientUpdate for the mean-field VI optimum."
        )

    def _moving(self, change: float, tol: float | None) -> tuple[str, str]:
        """Still moving, jittering at the noise floor, or swinging: the message for a run that ended
        moving."""
        head = (
            f"The run did not converge in {self.rounds} rounds: its last round moved q by "
            f"{change:.3g} posterior sds (tol={tol})"
            if tol is not None
            else f"The run ended far from converged: its last round moved q by {change:.3g} "
            "posterior sds"
        )
        if tol is not None and change <= tol:
            head += (
                ", a small step but one of many in the same direction: q is still drifting toward "
                "its fixed point"
            )
        more = (
            "Run more rounds (run(..., init_state=result) continues; a DP run spends privacy "
            "budget every round)"
        )
        more += "." if tol is not None else ", or pass tol= to run until q settles."
        seen = trend(list(self.moves))
        if seen is None:
            return "not_settled", (
                f"{head}; too few rounds (moves of q) to tell a q still moving from one jittering "
                f"at the Monte Carlo noise floor (see result.history.change, plot_history). {more}"
            )
        kind, shrink, cosine = seen
        numbers = (
            f"over the last rounds the change shrank x{shrink:.2f} a round and consecutive moves "
            f"had a mean cosine of {cosine:.2f}"
        )
        to_go, coordinate = self._slow_coordinate()
        if coordinate >= 0 and to_go > self._limit:  # one slow coordinate, under the others' noise
            kind = "still_moving"
            numbers += (
                f"; coordinate {coordinate} of q (means, then log sds, in the family's order) "
                f"drifted one way over the last {TREND_ROUNDS} rounds, about {to_go:.2g} sds "
                "still to go"
            )
        if kind == "still_moving":
            return kind, f"{head}, and q is still moving ({numbers}). {more}"
        if kind == "swinging":
            return kind, (
                f"{head}, and q swings back and forth ({numbers}): the server overshoots. Use a "
                "smaller damping or Sequential(); more rounds will not help."
            )
        return kind, (
            f"{head}, and q is jittering at the Monte Carlo noise floor of the local updates "
            f"({numbers}: moves of a steady size in unrelated directions). More rounds will not "
            "help (and a DP run spends privacy budget every round): use more particles or local "
            "steps (e.g. GradientUpdate(num_particles=...)), a tol above the floor, or the "
            "averaged posterior (run(..., average_rounds=k), then result.averaged())."
        )


def _reasons(codes: np.ndarray) -> str:
    """``"stale x3, raised x1"``: the rejection codes counted."""
    codes = np.asarray(codes)
    return ", ".join(
        f"{Rejection(code).name.lower()} x{n}"
        for code, n in zip(*np.unique(codes[codes > 0], return_counts=True))
    )


def _grown(values: np.ndarray, size: int, fill: Any) -> np.ndarray:
    """``values`` padded with ``fill`` to ``size`` entries (clients added since); ``values``
    themselves (no copy) if they have as many."""
    if values.size >= size:
        return values
    return np.concatenate([values, np.full(size - values.size, fill, values.dtype)])


def _span(elbo: Any) -> tuple[float, float]:
    """The smallest and largest finite ELBO of a history (``(inf, -inf)`` if none)."""
    finite = np.asarray([] if elbo is None else np.ravel(elbo), float)
    finite = finite[np.isfinite(finite)]
    return (
        (float(finite.min()), float(finite.max())) if finite.size else (float("inf"), float("-inf"))
    )
