"""What a run says about itself: how far each round moved ``q``, whether it converged, and why it did not.

No run ends at a wrong answer without saying so. After every round :class:`RunMonitor` looks at the
round's :class:`~numpyro_pvi.RoundInfo` and issues a :class:`PVIWarning` (once per cause per run) when

* every update of the round was rejected or clamped away (with the reasons; for ``max_staleness``, the
  staleness seen and the value that would admit the updates);
* ``q`` has not moved for :data:`STALL_ROUNDS` rounds while updates were rejected or clamped;
* a client timed out in each of the last :data:`STALL_ROUNDS` rounds (Ray);
* a client's next update would exceed its privacy budget (once per client: it sends nothing from then on);
* the run ends without converging (``tol`` given) or far from it (after two rounds or more, the last
  round still moved ``q`` by more than :data:`FAR` posterior sds).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from numpyro_pvi.state import Rejection, RoundInfo

STALL_ROUNDS = 3  # rounds without movement, with rejected or clamped updates, before a run is called stalled
FAR = 0.5  # a last round that moved q by more than this many posterior sds ends a run far from converged


class PVIWarning(UserWarning):
    """A run that cannot do what was asked says so: rejected, clamped or stale updates, a stall, no convergence.

    **Example:** ``warnings.simplefilter("error", pvi.PVIWarning)`` turns them into errors.
    """


def q_change(family: Any, old: Any, new: Any) -> float:
    """How far ``q`` moved: the largest ``|change of a marginal mean| / new sd`` or ``|change of a log sd|``."""
    a, b = family.marginals(old), family.marginals(new)
    mean = np.abs(b.mean - a.mean) / np.sqrt(b.variance)
    log_sd = 0.5 * np.abs(np.log(b.variance) - np.log(a.variance))
    change = float(np.max(np.concatenate([mean, log_sd])))
    return change if np.isfinite(change) else float("inf")


class RunMonitor:
    """Watches the rounds of one run and warns, once per cause, when it cannot do what was asked."""

    def __init__(self, server: Any) -> None:
        self.server, self.warned, self.still = server, set(), 0
        self.timeouts: np.ndarray | None = None  # consecutive rounds in which each client timed out

    def warn(self, cause: str, message: str) -> None:
        if cause not in self.warned:
            self.warned.add(cause)
            warnings.warn(message, PVIWarning, stacklevel=4)

    def after_round(self, info: RoundInfo, staleness: list) -> None:
        """Check one round (``staleness``: of the updates rejected as stale)."""
        attempts = np.asarray(info.attempts) > 0
        rejection, clamped = np.asarray(info.rejection), np.asarray(info.clamped)
        # rejected, or merged as nothing because every step was clamped (a converged exact update also sends 0)
        lost = (rejection > 0) | (~np.asarray(info.moved) & (clamped > 0))
        budget = np.flatnonzero(rejection == Rejection.BUDGET)
        for client in budget.tolist():
            self.warn(f"budget {client}", f"Client {client} has spent its privacy budget: its next update would exceed "
                                          "privacy_budget, so it sends nothing from now on (Rejection.BUDGET).")
        if attempts.any() and np.all(lost[attempts]) and not np.all(rejection[attempts] == Rejection.BUDGET):
            self._nothing_merged(info, staleness)
        timed_out = rejection == Rejection.TIMEOUT
        self.timeouts = np.where(timed_out, (0 if self.timeouts is None else self.timeouts) + 1, 0)
        late = np.flatnonzero(self.timeouts >= STALL_ROUNDS)
        if late.size:
            self.warn("timeouts", f"Client(s) {late.tolist()} timed out (or their actors died) in each of the last "
                                  f"{STALL_ROUNDS} rounds: their data never reach q. Raise RayBackend(timeout=...) "
                                  "or give the clients less local work.")
        troubled = info.num_rejected > 0 or np.asarray(info.clamped).sum() > 0
        self.still = self.still + 1 if info.change == 0.0 and troubled else 0
        if self.still >= STALL_ROUNDS:
            self.warn("stalled", f"q has not moved for {self.still} rounds while client updates were rejected or "
                                 "clamped: the run is stalled, not converged. RoundInfo.rejection says why updates "
                                 "were rejected; RoundInfo.clamped counts steps halved to stay valid.")

    def _nothing_merged(self, info: RoundInfo, staleness: list) -> None:
        codes = np.asarray(info.rejection)[np.asarray(info.attempts) > 0]
        if staleness and np.all(codes == Rejection.STALE):
            limit = getattr(self.server, "max_staleness", None)
            self.warn("stale", f"Asynchronous(max_staleness={limit}) rejected every update: they were "
                               f"{min(staleness)}-{max(staleness)} merges stale; max_staleness >= {min(staleness)} "
                               "would admit the freshest (with M clients of equal speed updates are about M - 1 "
                               "merges stale).")
            return
        reasons = ", ".join(f"{Rejection(code).name.lower()} x{n}" for code, n in
                            zip(*np.unique(codes[codes > 0], return_counts=True)))
        clamped = int(np.asarray(info.clamped).sum())
        self.warn("nothing merged", "Every client update of a round was rejected or clamped away: q did not move ("
                                    f"rejected: {reasons or 'none'}; steps clamped: {clamped}). Try a smaller "
                                    "step size or damping, more particles, or check the data.")

    def at_end(self, info: RoundInfo | None, tol: float | None, num_rounds: int) -> bool | None:
        """Whether the run converged (``None`` without ``tol``); warn if it ends unconverged or far from it."""
        if info is None:
            return None
        converged = None if tol is None else bool(info.change <= tol)
        if converged is False:
            self.warn("not converged", f"The run did not converge in {num_rounds} rounds: its last round moved q by "
                                       f"{info.change:.3g} posterior sds (tol={tol}). Run more rounds.")
        elif tol is None and num_rounds > 1 and info.change > FAR:  # a first round always moves q from the prior
            self.warn("far", f"The run ended far from converged: its last round moved q by {info.change:.3g} "
                             "posterior sds. Run more rounds, or pass tol= to run until q settles.")
        return converged
