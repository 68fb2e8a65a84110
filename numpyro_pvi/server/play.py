"""One round from the server's side, whatever runs the clients: the prior factor's step, the
server's schedule over a :class:`~numpyro_pvi.server.round.Round`, the damping, the
hyperparameters' step, the round's record and the run's monitor.

:meth:`PVI.run <numpyro_pvi.PVI.run>` (clients in process or on Ray) and
:class:`~numpyro_pvi.flower.PVIStrategy` (clients at Flower sites) both call :func:`play_round`:
a server, a damping or a check written once runs on every runtime.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax

from numpyro_pvi.server.elbo import round_elbo
from numpyro_pvi.server.monitor import RunMonitor, largest, q_move
from numpyro_pvi.server.round import Round
from numpyro_pvi.server.steps import Steps
from numpyro_pvi.state import PVIState, RoundInfo

# the round's three keys in one compiled program (eagerly, the split and the unstacking compile one
# each in a fresh process); the same keys as ``jax.random.split(key, 3)``
_round_keys = jax.jit(lambda key: tuple(jax.random.split(key, 3)))


def play_round(
    server: Any,
    family: Any,
    state: PVIState,
    steps: Steps,
    make_round: Callable[[jax.Array, jax.Array], Round],
    num_clients: int,
    monitor: RunMonitor,
    pooled_elbo: Callable[[PVIState], float],
    prior_step: Callable[[PVIState], PVIState] | None = None,
) -> tuple[PVIState, RoundInfo]:
    """One round: ``(state, info)`` after the server ran its schedule over ``make_round(round_key,
    sample_key)``.

    :param steps: the compiled steps (``hyper_step`` is used here, the rest by the round).
    :param make_round: the round's :class:`~numpyro_pvi.server.round.Round` from its keys (the
        state's key split as every round splits it).
    :param monitor: the run's monitor (warnings, convergence).
    :param pooled_elbo: ``pooled_elbo(start)``, the ELBO of the ``q`` the round started from
        (``start``, after the prior's step) where the clients did not all report their terms of it
        (they were sent different ``q``): a pass over the data in process, ``nan`` where the
        server has none. Where they did, the round's ELBO is the sum of their terms and the prior's
        (:func:`~numpyro_pvi.server.elbo.round_elbo`).
    :param prior_step: the prior factor's step before the clients run (``None``: Gaussian prior).

    **Example:** ``state, info = play_round(server, family, state, steps, make_round, M,
    RunMonitor(server), pooled_elbo)``
    """
    start, old_q = time.perf_counter(), state.q
    round_key, sample_key, next_key = _round_keys(state.rng_key)
    rho = float(server.damping.rho(state.damping))
    if prior_step is not None:
        state = prior_step(state)
    round = make_round(round_key, sample_key)
    if server.damping.reads_previous_factors:
        round.owned.release()  # `before` keeps the factors the round starts from
    before = state
    state = server.run_round(state, round, num_clients)
    backtracked = round.backtracked(rho)
    state = server.damping.after_merge(
        family, before, state, round.every_client_merged() and not backtracked, rho
    )
    if steps.hyper_step is not None and round.hyper_grad:
        grads = state.hyper_grads
        for m, grad in round.hyper_grad.items():
            grads = jax.tree.map(lambda stack, g, m=m: stack.at[m].set(g), grads, grad)
        state = steps.hyper_step(
            state._replace(hyper_grads=grads), jax.tree.map(lambda g: g.sum(0), grads)
        )
    if round.reported_elbo():
        value = round_elbo(round.elbo_terms, round.prior_term)
    else:
        value = float(pooled_elbo(before))
    state = state._replace(damping=server.damping.after_round(state.damping, value, backtracked))
    move = q_move(family, old_q, state.q)
    info = RoundInfo(
        value, time=time.perf_counter() - start, change=largest(move), **round.record()
    )
    monitor.after_round(info, round.staleness, move, num_clients)
    # an oscillating or falling run says so
    note = server.damping.warning(state.damping)
    if note is not None:
        monitor.warn(*note)
    return state._replace(rng_key=next_key), info
