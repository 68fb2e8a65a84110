"""Privacy accounting for the DP local updates, with Google's ``dp-accounting`` (the optional extra
``dp``).

Each DP local update (:class:`~numpyro_pvi.DPGradientUpdate`,
:class:`~numpyro_pvi.DPLocalAveraging`) says what one of its releases is as a
``dp_accounting.DpEvent`` (:class:`PrivateUpdate`); a client's privacy loss over a run is the
composition of the releases it made, which the RDP accountant turns into an ``epsilon`` for a given
``delta``. The neighbouring relation is add/remove one row of a client (record-level DP for each
client's own rows, Heikkilä et al. 2023).

* DP-SGD (``DPGradientUpdate``): each step is the Poisson-subsampled Gaussian mechanism at rate
  ``q = batch_size / n_m`` with noise multiplier ``sigma``; a release is ``num_steps`` such steps:
  ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), num_steps * releases)``.
* Local averaging (``DPLocalAveraging``): a release is one Gaussian mechanism:
  ``SelfComposed(Gaussian(sigma), releases)``.

The number of releases of client ``m`` is read from the run's *state*, the count the client's budget
gate reads (``PrivateUpdate.num_releases``, e.g. ``DPState.releases``), so that ``privacy_spent``
and the budget never disagree, and a run resumed from a checkpoint (without its history) still
counts every release. Every update the client sent counts, merged or rejected (the server saw it,
:class:`~numpyro_pvi.local_updates.CountsRejectedUpdates`); a round refused for its budget
    (``Rejection.BUDGET``)
releases nothing, and so does an update that raised or timed out (``Rejection.RAISED``/``TIMEOUT``:
the server never reads it; a timed-out Ray actor is killed).

**Client sampling** (``Synchronous(clients_per_round=K)``): if the draw of each round's clients is
random, independent of the data and unpredictable to the adversary, a round is, for one row of
client ``m``, the mechanism "with probability ``p_m`` run the client's release, otherwise release
nothing" (``p_m = K / M`` for uniform sampling). It is *not* dp-accounting's
``PoissonSampledDpEvent(p_m, release)``: that event subsamples records while the mechanism still
runs on the others, whereas here the whole client is in or out and its absence is visible; the
Poisson pair is a post-processing of this one (map "nothing" to a run without the row), so its
epsilon can be smaller than the truth. The Renyi divergence of order ``alpha`` of the "run or
nothing" pair is exactly ``log(1 - p + p exp((alpha - 1) D_alpha(release))) / (alpha - 1)`` (the
"nothing" outcome has the same probability on both sides): :func:`client_sampled_rdp` applies it to
the release's RDP curve from dp-accounting, composes it over the rounds and converts it with
``dp_accounting.rdp.compute_epsilon`` (:func:`client_sampled_epsilon`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from numpyro_pvi.state import Rejection, RoundInfo

# integer Renyi orders (no fractional ones)
RDP_ORDERS = tuple(range(2, 129)) + (160, 192, 256, 384, 512, 1024)


def _accounting() -> Any:
    try:
        import dp_accounting
    except (
        ImportError
    ) as error:  # pragma: no cover - the extra is installed in the test environment
        raise ImportError(
            "Privacy accounting needs Google's dp-accounting: pip install 'numpyro-pvi[dp]'."
        ) from error
    return dp_accounting


@runtime_checkable
class PrivateUpdate(Protocol):
    """A local update whose releases are differentially private: ``dp_event(num_rows,
    num_releases)``, and ``num_releases(client_states)``, each client's releases so far as its state
    counts them (the one count that drives both its budget and :func:`privacy_spent`).

    **Example:** ``pvi.DPGradientUpdate(...).dp_event(100, 3)`` is the ``DpEvent`` of 3 releases of
    a client of 100 rows; ``update.num_releases(result.state.client_states)`` each client's count.
    """

    def dp_event(self, num_rows: int, num_releases: int) -> Any: ...

    def num_releases(self, client_states: Any) -> Any: ...


def dp_sgd_event(sampling_rate: float, noise_multiplier: float, num_steps: int) -> Any:
    """``num_steps`` steps of DP-SGD: the Poisson-subsampled Gaussian mechanism, self-composed.

    **Example:** ``dp_sgd_event(0.1, 1.1, 500)``.
    """
    accounting = _accounting()
    step = accounting.PoissonSampledDpEvent(
        float(sampling_rate), accounting.GaussianDpEvent(float(noise_multiplier))
    )
    return accounting.SelfComposedDpEvent(step, int(num_steps))


def gaussian_event(noise_multiplier: float, num_releases: int) -> Any:
    """``num_releases`` Gaussian mechanisms of noise ``noise_multiplier`` times the sensitivity.

    **Example:** ``gaussian_event(2.0, 10)``.
    """
    accounting = _accounting()
    return accounting.SelfComposedDpEvent(
        accounting.GaussianDpEvent(float(noise_multiplier)), int(num_releases)
    )


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
    """A ``privacy_budget`` as ``(epsilon, delta)`` floats (``None`` stays ``None``); a bad one is
    named.

    **Example:** ``check_budget((1.0, 1e-5), "DPGradientUpdate")`` is ``(1.0, 1e-05)``.
    """
    if budget is None:
        return None
    if not (isinstance(budget, tuple) and len(budget) == 2):
        raise ValueError(
            f"{name}: privacy_budget must be a tuple (epsilon, delta), got {budget!r}."
        )
    eps, delta = budget
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"{name}: privacy_budget's epsilon must be positive, got {eps!r}.")
    check_delta(delta)
    return float(eps), float(delta)


def within_budget(
    update: PrivateUpdate, budget: tuple[float, float], num_rows: int, num_releases: int
) -> bool:
    """Whether ``num_releases`` releases of a client of ``num_rows`` rows stay within ``budget =
    (eps, delta)``.

    **Example:** ``within_budget(update, (1.0, 1e-5), 100, 4)``.
    """
    return (
        num_releases == 0
        or epsilon(update.dp_event(num_rows, num_releases), budget[1]) <= budget[0]
    )


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    num_steps: int,
    *,
    client_sampling_rate: float = 1.0,
    num_rounds: int = 1,
) -> float:
    """The smallest noise multiplier for which ``num_steps`` Poisson-subsampled Gaussian steps at
    ``sampling_rate`` are ``(target_epsilon, delta)``-DP (RDP accountant;
    ``dp_accounting.calibrate_dp_mechanism``).

    For :class:`~numpyro_pvi.DPGradientUpdate`: ``sampling_rate = batch_size / n_m`` and
    ``num_steps`` = steps per round times rounds. For :class:`~numpyro_pvi.DPLocalAveraging` (one
    Gaussian mechanism per round): ``sampling_rate=1.0`` and ``num_steps`` = rounds.

    With ``client_sampling_rate=p < 1`` (the client's chance of being drawn in a round, ``K / M``
    for ``Synchronous(clients_per_round=K)``; valid only when that draw is secret, see
    :func:`client_sampled_epsilon`), the ``num_steps`` are spread over ``num_rounds`` rounds
    (``num_steps / num_rounds`` steps a release) and every round counts as "with probability ``p`` a
    release"; the noise multiplier is then found by bisection on :func:`client_sampled_epsilon`.

    **Example:** ``sigma = pvi.calibrate_noise_multiplier(1.0, 1e-5, sampling_rate=0.2,
    num_steps=500)``; ``pvi.calibrate_noise_multiplier(1.0, 1e-5, 0.2, 500,
    client_sampling_rate=0.1, num_rounds=10)``.
    """
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be positive, got {target_epsilon!r}.")
    check_delta(delta)
    if not 0.0 < sampling_rate <= 1.0:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}.")
    if not (isinstance(num_steps, int) and num_steps >= 1):
        raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}.")
    if client_sampling_rate != 1.0:
        return _calibrate_client_sampled(
            target_epsilon, delta, sampling_rate, num_steps, client_sampling_rate, num_rounds
        )
    accounting = _accounting()
    return float(
        accounting.calibrate_dp_mechanism(
            lambda: accounting.rdp.RdpAccountant(orders=list(RDP_ORDERS)),
            lambda sigma: dp_sgd_event(sampling_rate, sigma, num_steps),
            target_epsilon,
            delta,
            accounting.LowerEndpointAndGuess(1e-3, 1.0),
            tol=1e-4,
        )
    )


def releases(local_update: Any, client_states: Any, num_clients: int) -> np.ndarray:
    """``(M,)`` how many updates each client released in the run, read from its state (the count its
    budget gate reads): sent updates, merged or rejected; none for a round refused for budget,
    raised or timed out.

    **Example:** ``pvi.privacy.accounting.releases(result.config.local_update,
    result.state.client_states,
    result.num_clients)`` is ``[20, 20, ...]`` after 20 synchronous rounds.
    """
    counts = np.asarray(_private(local_update).num_releases(client_states))
    return counts[:num_clients].astype(int)


def _private(update: Any) -> PrivateUpdate:
    if not isinstance(update, PrivateUpdate):
        raise TypeError(
            f"privacy_spent: the run's local update {type(update).__name__} is not differentially "
            "private (use pvi.DPGradientUpdate or pvi.DPLocalAveraging)."
        )
    return update


def _rounds_covering(history: RoundInfo | None, released: np.ndarray) -> int:
    """The number of rounds in ``history``, checked to hold every release the state counts (a run
    resumed without ``init_history`` has fewer rounds in its history than it ran: "secret" credits
    each round)."""
    num_clients = len(released)
    seen = np.zeros(num_clients, int)
    if history is not None:
        history = history.dense(num_clients)  # a sampled history holds (rounds, K)
        attempts = np.asarray(history.attempts)[:, :num_clients]
        silent = np.isin(
            np.asarray(history.rejection)[:, :num_clients],
            [int(Rejection.BUDGET), int(Rejection.TIMEOUT), int(Rejection.RAISED)],
        )
        seen = np.sum(np.where(silent, 0, attempts), axis=0)
    if not np.array_equal(seen, released):
        raise ValueError(
            "client_sampling='secret' credits every round of the run, but this result's history "
            f"holds {seen.tolist()} releases where the clients' states count {released.tolist()} "
            "(a run resumed without its earlier rounds): pass init_history=<the earlier result's "
            "history> when resuming, or use client_sampling='known'."
        )
    return 0 if history is None else len(np.asarray(history.attempts))


def privacy_spent(
    local_update: Any,
    server: Any,
    state: Any,
    history: RoundInfo | None,
    sizes: Any,
    delta: float,
    *,
    client_sampling: str = "known",
    client_rates: Any = None,
    released: Any = None,
) -> np.ndarray:
    """``(M,)`` each client's ``epsilon`` at ``delta`` (0 if it released nothing), from a run's
    values: its DP ``local_update`` and ``server``, its final ``state``, its ``history`` and the
    clients' ``sizes`` (rows).

    ``released``: each client's releases, where ``state`` does not hold the clients' states (over
    Flower they stay at the sites, which report their counts:
    :meth:`PVIStrategy.privacy_spent <numpyro_pvi.flower.PVIStrategy.privacy_spent>`); default: read
    from ``state``.

    ``client_sampling="known"`` (the default, conservative): every release the client made in the
    run, composed; valid however the clients were chosen. ``client_sampling="secret"``: every round
    of a server that draws each round's clients afresh (``Synchronous``) counts as "with
    probability ``p_m`` a release" (:func:`client_sampled_epsilon`, ``p_m`` from
    :func:`client_sampling_rates` or ``client_rates``); valid only if the draw of each round's
    clients is random, independent of the data and unpredictable to the adversary.

    **Example:** ``result.privacy_spent(1e-5)``; ``result.privacy_spent(1e-5,
    client_sampling="secret")`` (the result passes its values here).
    """
    update = _private(local_update)
    check_delta(delta)
    if client_sampling not in ("known", "secret"):
        raise ValueError(f"client_sampling must be 'known' or 'secret', got {client_sampling!r}.")
    sizes = np.asarray(sizes)
    if released is None:
        released = releases(update, state.client_states, len(sizes))
    released = np.asarray(released, int)
    if client_sampling == "secret":
        rates = client_sampling_rates(server, len(sizes), client_rates)
        rounds = _rounds_covering(history, released)
        return np.array(
            [
                client_sampled_epsilon(update.dp_event(int(n), 1), float(p), rounds, delta)
                if r > 0
                else 0.0
                for n, p, r in zip(sizes, rates, released)
            ]
        )
    return np.array(
        [
            epsilon(update.dp_event(int(n), int(r)), delta) if r > 0 else 0.0
            for n, r in zip(sizes, released)
        ]
    )


def rdp_curve(event: Any) -> np.ndarray:
    """The RDP of ``event`` at the orders :data:`RDP_ORDERS` (dp-accounting's RDP accountant).

    **Example:** ``rdp_curve(gaussian_event(2.0, 1))`` is ``alpha / (2 * 2.0**2)`` at each order
    ``alpha``.
    """
    return np.asarray(
        _accounting().rdp.RdpAccountant(orders=list(RDP_ORDERS)).compose(event).rdp, float
    )


def client_sampled_rdp(release_rdp: np.ndarray, rate: float) -> np.ndarray:
    """The RDP of "with probability ``rate`` a release of RDP ``release_rdp``, otherwise nothing".

    ``log(1 - rate + rate * exp((alpha - 1) * release_rdp)) / (alpha - 1)`` at each order ``alpha``
    of :data:`RDP_ORDERS`: exact for the pair of mixtures that share the "nothing" outcome (see the
    module docstring), computed in log space; ``rate=1`` gives ``release_rdp``.

    **Example:** ``client_sampled_rdp(rdp_curve(gaussian_event(2.0, 1)), 0.1)``.
    """
    orders = np.asarray(RDP_ORDERS, float)
    release_rdp = np.asarray(release_rdp, float)
    if rate == 1.0:
        return release_rdp
    with np.errstate(over="ignore"):  # an infinite release RDP stays infinite
        return np.logaddexp(np.log1p(-rate), np.log(rate) + (orders - 1) * release_rdp) / (
            orders - 1
        )


def client_sampled_epsilon(release: Any, rate: float, num_rounds: int, delta: float) -> float:
    """``epsilon`` at ``delta`` of ``num_rounds`` rounds that each make the ``release`` (a
    ``DpEvent``) with probability ``rate``, independently: client sampling's amplification.

    Valid only if the draw of the round's clients is random, independent of the data and unknown to
    the adversary beforehand (whoever holds the run's key can predict it); the outcome (who took
    part) may be seen. ``rate=1`` is ``num_rounds`` releases, exactly as
    ``epsilon(SelfComposed(release, num_rounds))``.

    **Example:** ``client_sampled_epsilon(update.dp_event(100, 1), 0.1, 50, 1e-5)``.
    """
    check_delta(delta)
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"client sampling rate must be in (0, 1], got {rate!r}.")
    rdp = num_rounds * client_sampled_rdp(rdp_curve(release), rate)
    return float(_accounting().rdp.compute_epsilon(list(RDP_ORDERS), rdp, delta)[0])


def _calibrate_client_sampled(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    num_steps: int,
    rate: float,
    num_rounds: int,
) -> float:
    """Bisection (in ``log sigma``, to 1e-4 relative) for :func:`calibrate_noise_multiplier` with
    client sampling."""
    client_rate_checked(rate)
    if not (isinstance(num_rounds, int) and num_rounds >= 1):
        raise ValueError(f"num_rounds must be a positive integer, got {num_rounds!r}.")
    if num_steps % num_rounds:
        raise ValueError(
            f"num_steps={num_steps} must be a multiple of num_rounds={num_rounds} (steps per "
            "release)."
        )

    def eps(sigma: float) -> float:
        return client_sampled_epsilon(
            dp_sgd_event(sampling_rate, sigma, num_steps // num_rounds), rate, num_rounds, delta
        )

    low, high = 1.0, 1.0
    while eps(high) > target_epsilon:
        high *= 2.0
    while low > 1e-3 and eps(low) <= target_epsilon:
        low /= 2.0
    while high / low > 1.0 + 1e-4:
        middle = float(np.sqrt(low * high))
        low, high = (low, middle) if eps(middle) <= target_epsilon else (middle, high)
    return high


def client_rate_checked(rate: float) -> float:
    """``rate`` if it is a probability in ``(0, 1]``; a ``ValueError`` naming it otherwise."""
    if not (isinstance(rate, (int, float)) and 0.0 < rate <= 1.0):
        raise ValueError(f"client_sampling_rate must be in (0, 1], got {rate!r}.")
    return float(rate)


def client_sampling_rates(server: Any, num_clients: int, client_rates: Any = None) -> np.ndarray:
    """``(M,)`` each client's probability of being drawn in a round of ``server``, a server whose
    every round draws its clients afresh (:meth:`~numpyro_pvi.server.servers.Server.sampling_rates`:
    ``Synchronous``).

    ``K / M`` for uniform ``clients_per_round=K`` (1 without sampling). With ``client_weights`` the
    inclusion probability of drawing ``K`` without replacement is not ``K w_m``: pass it as
    ``client_rates``.

    **Example:** ``pvi.privacy.accounting.client_sampling_rates(result.config.server, 10)`` is
    ``[0.2, 0.2,
    ...]`` for 2 of 10 clients.
    """
    rates = server.sampling_rates(num_clients)
    if rates is None:
        raise ValueError(
            "client_sampling='secret' is derived for rounds that each draw their clients afresh "
            f"(Synchronous), not {server!r}."
        )
    if client_rates is not None:
        rates = np.asarray(client_rates, float)
        if rates.shape != (num_clients,) or not np.all((rates > 0) & (rates <= 1)):
            raise ValueError(
                f"client_rates must be {num_clients} probabilities in (0, 1], got {client_rates!r}."
            )
        return rates
    if server.sampling.client_weights is not None:
        raise ValueError(
            "client_sampling='secret' with client_weights: pass client_rates=, each client's "
            "probability of being drawn in a round (weighted sampling without replacement)."
        )
    return rates
