"""Privacy accounting for the DP local updates, with Google's ``dp-accounting`` (the optional extra ``dp``).

Each DP local update (:class:`~numpyro_pvi.DPGradientUpdate`, :class:`~numpyro_pvi.DPLocalAveraging`) says
what one of its releases is as a ``dp_accounting.DpEvent`` (:class:`PrivateUpdate`); a client's privacy
loss over a run is the composition of the releases it made, which the RDP accountant turns into an
``epsilon`` for a given ``delta``. The neighbouring relation is add/remove one row of a client
(record-level DP for each client's own rows, Heikkilä et al. 2023).

* DP-SGD (``DPGradientUpdate``): each step is the Poisson-subsampled Gaussian mechanism at rate
  ``q = batch_size / n_m`` with noise multiplier ``sigma``; a release is ``num_steps`` such steps:
  ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), num_steps * releases)``.
* Local averaging (``DPLocalAveraging``): a release is one Gaussian mechanism:
  ``SelfComposed(Gaussian(sigma), releases)``.

The number of releases of client ``m`` is read from the run's history: the updates it sent
(``history.attempts[:, m]``), less the rounds whose update was refused for its budget
(``Rejection.BUDGET``, which releases nothing). Every sent update counts, merged or not: the server saw it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from numpyro_pvi.state import Rejection

if TYPE_CHECKING:
    from numpyro_pvi.results import PVIRunResult

RDP_ORDERS = tuple(range(2, 129)) + (160, 192, 256, 384, 512, 1024)  # integer Renyi orders (no fractional ones)


def _accounting() -> Any:
    try:
        import dp_accounting
    except ImportError as error:  # pragma: no cover - the extra is installed in the test environment
        raise ImportError("Privacy accounting needs Google's dp-accounting: pip install 'numpyro-pvi[dp]'.") from error
    return dp_accounting


@runtime_checkable
class PrivateUpdate(Protocol):
    """A local update whose releases are differentially private: ``dp_event(num_rows, num_releases)``.

    **Example:** ``pvi.DPGradientUpdate(...).dp_event(100, 3)`` is the ``DpEvent`` of 3 releases of a
    client of 100 rows.
    """

    def dp_event(self, num_rows: int, num_releases: int) -> Any: ...


def dp_sgd_event(sampling_rate: float, noise_multiplier: float, num_steps: int) -> Any:
    """``num_steps`` steps of DP-SGD: the Poisson-subsampled Gaussian mechanism, self-composed.

    **Example:** ``dp_sgd_event(0.1, 1.1, 500)``.
    """
    accounting = _accounting()
    step = accounting.PoissonSampledDpEvent(float(sampling_rate), accounting.GaussianDpEvent(float(noise_multiplier)))
    return accounting.SelfComposedDpEvent(step, int(num_steps))


def gaussian_event(noise_multiplier: float, num_releases: int) -> Any:
    """``num_releases`` Gaussian mechanisms of noise ``noise_multiplier`` times the sensitivity.

    **Example:** ``gaussian_event(2.0, 10)``.
    """
    accounting = _accounting()
    return accounting.SelfComposedDpEvent(accounting.GaussianDpEvent(float(noise_multiplier)), int(num_releases))


def epsilon(event: Any, delta: float) -> float:
    """The ``epsilon`` of ``event`` at ``delta`` by the RDP accountant (orders :data:`RDP_ORDERS`).

    **Example:** ``epsilon(dp_sgd_event(0.1, 1.1, 500), 1e-5)``.
    """
    check_delta(delta)
    accountant = _accounting().rdp.RdpAccountant(orders=list(RDP_ORDERS))
    return float(accountant.compose(event).get_epsilon(delta))


def check_delta(delta: float) -> None:
    """Name a ``delta`` outside ``(0, 1)``.

    **Example:** ``check_delta(1e-5)`` passes, ``check_delta(0)`` raises a ``ValueError``.
    """
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}.")


def check_budget(budget: Any, name: str) -> tuple[float, float] | None:
    """A ``privacy_budget`` as ``(epsilon, delta)`` floats (``None`` stays ``None``); a bad one is named.

    **Example:** ``check_budget((1.0, 1e-5), "DPGradientUpdate")`` is ``(1.0, 1e-05)``.
    """
    if budget is None:
        return None
    if not (isinstance(budget, tuple) and len(budget) == 2):
        raise ValueError(f"{name}: privacy_budget must be a tuple (epsilon, delta), got {budget!r}.")
    eps, delta = budget
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"{name}: privacy_budget's epsilon must be positive, got {eps!r}.")
    check_delta(delta)
    return float(eps), float(delta)


def within_budget(update: PrivateUpdate, budget: tuple[float, float], num_rows: int, num_releases: int) -> bool:
    """Whether ``num_releases`` releases of a client of ``num_rows`` rows stay within ``budget = (eps, delta)``.

    **Example:** ``within_budget(update, (1.0, 1e-5), 100, 4)``.
    """
    return num_releases == 0 or epsilon(update.dp_event(num_rows, num_releases), budget[1]) <= budget[0]


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sampling_rate: float, num_steps: int) -> float:
    """The smallest noise multiplier for which ``num_steps`` Poisson-subsampled Gaussian steps at
    ``sampling_rate`` are ``(target_epsilon, delta)``-DP (RDP accountant; ``dp_accounting.calibrate_dp_mechanism``).

    For :class:`~numpyro_pvi.DPGradientUpdate`: ``sampling_rate = batch_size / n_m`` and ``num_steps`` =
    steps per round times rounds. For :class:`~numpyro_pvi.DPLocalAveraging` (one Gaussian mechanism per
    round): ``sampling_rate=1.0`` and ``num_steps`` = rounds.

    **Example:** ``sigma = pvi.calibrate_noise_multiplier(1.0, 1e-5, sampling_rate=0.2, num_steps=500)``.
    """
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be positive, got {target_epsilon!r}.")
    check_delta(delta)
    if not 0.0 < sampling_rate <= 1.0:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}.")
    if not (isinstance(num_steps, int) and num_steps >= 1):
        raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}.")
    accounting = _accounting()
    return float(accounting.calibrate_dp_mechanism(
        lambda: accounting.rdp.RdpAccountant(orders=list(RDP_ORDERS)),
        lambda sigma: dp_sgd_event(sampling_rate, sigma, num_steps),
        target_epsilon, delta, accounting.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-4))


def releases(result: PVIRunResult) -> np.ndarray:
    """``(M,)`` how many updates each client released in the run: attempts, less rounds refused for budget.

    **Example:** ``pvi.privacy.releases(result)`` is ``[20, 20, ...]`` after 20 synchronous rounds.
    """
    history = result.history
    if history is None:
        return np.zeros(result.num_clients, dtype=int)
    attempts = np.asarray(history.attempts)[:, :result.num_clients]
    refused = np.asarray(history.rejection)[:, :result.num_clients] == Rejection.BUDGET
    return np.sum(np.where(refused, 0, attempts), axis=0).astype(int)


def privacy_spent(result: PVIRunResult, delta: float) -> np.ndarray:
    """``(M,)`` each client's ``epsilon`` at ``delta`` over every release it made in the run (0 if none).

    **Example:** ``result.privacy_spent(1e-5)`` (the method delegates here).
    """
    update = result.inference.local_update
    if not isinstance(update, PrivateUpdate):
        raise TypeError(f"privacy_spent: the run's local update {type(update).__name__} is not differentially private "
                        "(use pvi.DPGradientUpdate or pvi.DPLocalAveraging).")
    check_delta(delta)
    sizes = result.problem.sizes
    return np.array([epsilon(update.dp_event(int(n), int(r)), delta) if r > 0 else 0.0
                     for n, r in zip(sizes, releases(result))])
