"""The server's state and what a round reports: named tuples (pytrees), checkpointed as they are."""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

import jax
import numpy as np

from numpyro_pvi.families import NatParams


class PVIState(NamedTuple):
    """The server's state (a pytree).

    Arrays with a client axis have one entry per client *slot*: the number of clients, or more after
    :meth:`PVI.add_client` (capacity grows geometrically so that adding clients rarely recompiles;
    the slots past ``problem.num_clients`` hold flat factors and no data).

    :ivar q: natural parameters of the global approximation ``q`` (``(D,)`` leaves).
    :ivar factors: client factors ``t_m`` stacked ``(M, ...)``.
    :ivar prior_factor: ``t_0`` for the non-Gaussian prior sites (zeros if the prior is Gaussian).
    :ivar client_states: each client's persistent local-update state, stacked ``(M, ...)``; never merged.
    :ivar server_state: the server's own bookkeeping (e.g. ``Asynchronous``'s stale copies of q).
    :ivar rng_key: the random key of the next round.
    :ivar hyper: the hyperparameters (``numpyro.param`` sites) in unconstrained space, ``()`` if none.
    :ivar hyper_state: the state of the server's ``hyper_optimizer``.
    :ivar damping: an adaptive damping's state (:class:`~numpyro_pvi.damping.DampingState`), ``()`` if fixed.
    :ivar hyper_grads: each client's latest accepted gradient of its local free energy with respect to
        ``hyper``, stacked ``(M, ...)``; the server steps along their sum, so a client that did not
        report this round (asynchronous servers) still counts with its latest gradient.

    **Example:** ``state = inference.init(key, X, y=y)``, ``state, info = inference.update(state, X, y=y)``;
    ``inference.get_posterior(state)`` is ``q``, ``pvi.save(state, "run.npz")`` a checkpoint.
    """

    q: NatParams
    factors: NatParams
    prior_factor: NatParams
    client_states: Any
    server_state: Any
    rng_key: jax.Array
    hyper: Any = ()
    hyper_state: Any = ()
    hyper_grads: Any = ()
    damping: Any = ()


class Rejection(IntEnum):
    """Why a client's update was not merged (``RoundInfo.rejection``; ``NONE`` if it was).

    **Example:** ``pvi.Rejection(int(info.rejection[m])).name`` is e.g. ``"STALE"``.
    """

    NONE = 0
    NON_FINITE = 1  # its delta or free energy was NaN or inf
    STALE = 2  # computed against a q older than Asynchronous(max_staleness) merges
    INVALID = 3  # every damping tried would have left q or a cavity invalid
    TIMEOUT = 4  # the client did not answer in time, or its actor died (Ray)
    RAISED = 5  # the client's update raised an exception
    BUDGET = 6  # the client's next release would have exceeded its privacy budget (a zero delta, nothing released)


class RoundInfo(NamedTuple):
    """What happened in a round (in ``history`` every field gains a leading round axis).

    :ivar elbo: global ELBO estimate of ``q`` after the round.
    :ivar free_energy: ``(M,)`` each client's local free energy at the end of its last update (NaN if none).
    :ivar attempts: ``(M,)`` updates each client sent (1 per round except under ``Asynchronous``/``Continual``).
    :ivar accepted: ``(M,)`` how many of them were merged (finite, valid, not too stale).
    :ivar damping: ``(M,)`` the damping applied to each client's last update (0 if rejected).
    :ivar clamped: ``(M,)`` corrections each client's local update made to stay valid.
    :ivar time: wall-clock seconds of the round.
    :ivar rejection: ``(M,)`` why each client's last update this round was rejected (a :class:`Rejection`
        code, 0 if it was merged or the client did not run).
    :ivar moved: ``(M,)`` whether each client's last merged update changed its factor (an update whose every
        step was clamped away changes nothing).
    :ivar change: how far the round moved ``q``: the largest change of a marginal mean, in posterior sds,
        or of a marginal log sd (0 when nothing was merged).
    :ivar bytes_received: ``(M,)`` bytes each client received this round: per update, the natural parameters
        of ``q`` and of its cavity (and the hyperparameters, if any), counted from the arrays sent.
    :ivar bytes_sent: ``(M,)`` bytes each client sent this round: per update, its natural-parameter delta and
        its free energy (and its hyperparameter gradient, if any).

    **Example:** ``state, info = inference.update(state, X, y=y)``; ``info.elbo``, ``info.num_rejected``;
    over a run, ``result.history.free_energy`` is ``(rounds, M)``.
    """

    elbo: Any
    free_energy: Any
    attempts: Any
    accepted: Any
    damping: Any
    clamped: Any
    time: Any
    rejection: Any = None
    moved: Any = None
    change: Any = None
    bytes_received: Any = None
    bytes_sent: Any = None

    @property
    def num_rejected(self) -> Any:
        """Number of rejected client updates (per round in ``history``)."""
        return np.sum(np.asarray(self.attempts) - np.asarray(self.accepted), axis=-1)


class ClientOutcome(NamedTuple):
    """What merging a group of client updates did, per client of the group (``(G,)`` leaves).

    :ivar free_energy: each client's local free energy at the end of its update.
    :ivar accepted: whether its delta was merged.
    :ivar damping: the damping applied (0 if rejected).
    :ivar clamped: corrections its local update made to stay valid.
    :ivar hyper_grad: its gradient of the local free energy w.r.t. the hyperparameters (``()`` if none).
    :ivar rejection: why it was rejected (a :class:`Rejection` code, 0 if merged).
    :ivar moved: whether its delta was non-zero.
    """

    free_energy: jax.Array
    accepted: jax.Array
    damping: jax.Array
    clamped: jax.Array
    hyper_grad: Any
    rejection: jax.Array
    moved: jax.Array
