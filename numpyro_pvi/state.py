"""The server's state and what a round reports: named tuples (pytrees), checkpointed as they are."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.families import NatParams
from numpyro_pvi.families.site_families import family_name


@dataclass(frozen=True)
class MadeFor:
    """What a :class:`PVIState` was made for, stamped by :meth:`PVI.init <numpyro_pvi.PVI.init>`.

    A pytree node without leaves (static, hashable): ``jit`` treats it as part of the state's
    structure; it is the same in every round of a run, so a run's compiled steps are reused as
    before. ``PVI.update``/``run`` compare it with the set-up they are given and raise a
    ``ValueError`` naming every difference; checkpoints save and restore it. The empty record
    ``MadeFor()`` (a state built by hand) checks nothing.

    :ivar sites: the global latent sites, ``((name, shape), ...)`` in the model's order.
    :ivar family: the family, e.g. ``"MeanFieldGaussian()"``.
    :ivar server: the server's ``repr``, e.g. ``"Synchronous(damping=0.5)"``.
    :ivar capacity: the number of client slots: the number of clients, or more after
        :meth:`PVI.add_client <numpyro_pvi.PVI.add_client>` (the number of clients itself is not
        recorded: adding a client would change the record, and so recompile the round, within the
        same slots).

    **Example:** ``inference.init(key, X, y=y).made_for.sites`` is e.g. ``(("w", (3,)),)``.
    """

    sites: tuple = ()
    family: str = ""
    server: str = ""
    capacity: int = 0

    @classmethod
    def of(cls, config: Any, problem: Any) -> MadeFor:
        """The record of a configuration (:class:`~numpyro_pvi.config.PVIConfig`) on a
        :class:`~numpyro_pvi.model.problem.Problem`."""
        return cls(
            tuple((s.name, tuple(int(n) for n in s.shape)) for s in problem.sites.globals),
            family_name(config.family),
            repr(config.server),
            int(problem.capacity),
        )

    @property
    def known(self) -> bool:
        """Whether this records a set-up (``MadeFor()`` does not)."""
        return self != MadeFor()

    def differences(self, current: MadeFor, only: tuple = ()) -> list[str]:
        """``"field: made for X, now Y"`` for each field (of ``only``, if given) that differs from
        ``current`` (the capacity is labelled ``client slots``)."""
        made, now = asdict(self), asdict(current)
        return [
            f"{_LABELS.get(name, name)}: made for {_show(made[name])}, now {_show(now[name])}"
            for name in only or made
            if made[name] != now[name]
        ]


_LABELS = {"capacity": "client slots"}


def _show(value: Any) -> str:
    if isinstance(value, tuple):  # the sites
        return "[" + ", ".join(f"{name} {list(shape)}" for name, shape in value) + "]"
    return repr(value)


jax.tree_util.register_static(MadeFor)


class PVIState(NamedTuple):
    """The server's state (a pytree).

    Arrays with a client axis have one entry per client *slot*: the number of clients, or more after
    :meth:`PVI.add_client` (capacity grows geometrically so that adding clients rarely recompiles;
    the slots past ``problem.num_clients`` hold flat factors and no data).

    :ivar q: natural parameters of the global approximation ``q`` (``(D,)`` leaves).
    :ivar factors: client factors ``t_m`` stacked ``(M, ...)``.
    :ivar prior_factor: ``t_0`` for the non-Gaussian prior sites (zeros if the prior is Gaussian).
    :ivar client_states: each client's persistent local-update state, stacked ``(M, ...)``; never
        merged.
    :ivar server_state: the server's own bookkeeping (e.g. ``Asynchronous``'s stale copies of q).
    :ivar rng_key: the random key of the next round.
    :ivar hyper: the hyperparameters (``numpyro.param`` sites) in unconstrained space, ``()`` if
        none.
    :ivar hyper_state: the state of the server's ``hyper_optimizer``.
    :ivar damping: the server's damping's state (its
        :meth:`Damping.init <numpyro_pvi.server.damping.Damping.init>`).
    :ivar hyper_grads: each client's latest accepted gradient of its local free energy with respect
        to ``hyper``, stacked ``(M, ...)``; the server steps along their sum, so a client that did
        not report this round (asynchronous servers) still counts with its latest gradient.
    :ivar made_for: what the state was made for (:class:`MadeFor`: sites, family, server, client
        slots; no leaves); resuming it into another set-up is a ``ValueError`` naming the
        difference.

    **Example:** ``state = inference.init(key, X, y=y)``, ``state, info = inference.update(state, X,
    y=y)``; ``inference.get_posterior(state)`` is ``q``, ``pvi.save(state, "run.npz")`` a
    checkpoint.
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
    made_for: MadeFor = MadeFor()


class Rejection(IntEnum):
    """Why a client's update was not merged (``RoundInfo.rejection``; ``NONE`` if it was).

    **Example:** ``pvi.state.Rejection(int(info.rejection[m])).name`` is e.g. ``"STALE"``.
    """

    NONE = 0
    NON_FINITE = 1  # its delta or free energy was NaN or inf
    STALE = 2  # computed against a q older than Asynchronous(max_staleness) merges
    INVALID = 3  # every damping tried would have left q or a cavity invalid
    TIMEOUT = 4  # the client did not answer in time, or its actor died (Ray)
    RAISED = 5  # the client's update raised an exception
    # the client's next release would have exceeded its privacy budget (a zero delta, nothing
    # released)
    BUDGET = 6


class RoundInfo(NamedTuple):
    """What happened in a round (in ``history`` every field gains a leading round axis).

    :ivar elbo: the global ELBO of the ``q`` the round *started from* (the ``q`` after the
        previous round; in round 1 the initial ``q``), ``num_elbo_particles`` draws with the same
        key every round. In a :class:`~numpyro_pvi.Synchronous` round of every client it is the sum
        of the clients' terms, each computed with its update under the ``q`` it was sent, and the
        server's prior terms (:mod:`~numpyro_pvi.server.elbo`): no pass over the data; in other
        rounds (``Sequential``, ``Asynchronous``, ``Continual``, ``clients_per_round``), whose
        clients are sent different ``q``, it is a pooled pass over every client's data at the
        round's start. The last ``q``'s ELBO is :meth:`PVI.evaluate <numpyro_pvi.PVI.evaluate>`
        ``(state._replace(rng_key=numpyro_pvi.server.elbo.ELBO_KEY), ...)``.
    :ivar free_energy: ``(M,)`` each client's local free energy at the end of its last update (NaN
        if none).
    :ivar attempts: ``(M,)`` updates each client sent (1 per round except under
        ``Asynchronous``/``Continual``).
    :ivar accepted: ``(M,)`` how many of them were merged (finite, valid, not too stale).
    :ivar damping: ``(M,)`` the damping applied to each client's last update (0 if rejected).
    :ivar clamped: ``(M,)`` corrections each client's local update made to stay valid.
    :ivar time: wall-clock seconds of the round.
    :ivar rejection: ``(M,)`` why each client's last update this round was rejected (a
        :class:`Rejection` code, 0 if it was merged or the client did not run).
    :ivar moved: ``(M,)`` whether each client's last merged update changed its factor (an update
        whose every step was clamped away changes nothing).
    :ivar change: how far the round moved ``q``: the largest change of a marginal mean, in posterior
        sds, or of a marginal log sd (0 when nothing was merged).
    :ivar bytes_received: ``(M,)`` bytes each client received this round: per update, the natural
        parameters of ``q`` and of its cavity (and the hyperparameters, if any), counted from the
        arrays sent.
    :ivar bytes_sent: ``(M,)`` bytes each client sent this round: per update, its natural-parameter
        delta and its free energy (and its hyperparameter gradient, if any, and its term of the
        round's ELBO, if the round records it).
    :ivar inflation: ``(M,)`` the variance inflation each client's last update found in its tilted
        distribution beyond what the family can hold (``ClientResult.inflation``; EP and SNEP
        measure it, 1 otherwise); with a factorised family and several clients a large one ends the
        run unconverged (``stopped_because == "factorised_correlation"``).

    :ivar clients: ``None`` when the per-client fields (the ``(M,)`` ones above) hold every
        client, entry ``m`` client ``m``. With client sampling (``clients_per_round``) the ``(K,)``
        ids of the round's sampled clients, and each per-client field is ``(K,)``, entry ``i``
        client ``clients[i]``: a round's record, and a run's history, cost ``O(K)``, not ``O(M)``
        (a million clients' dense record took 81 MB a round). :meth:`dense` gives the ``(M,)``
        form.

    **Example:** ``state, info = inference.update(state, X, y=y)``; ``info.elbo``,
    ``info.num_rejected``; over a run, ``result.history.free_energy`` is ``(rounds, M)`` (with
    ``clients_per_round=K``, ``(rounds, K)`` and ``result.history.clients`` says whose;
    ``result.history.dense().free_energy`` is ``(rounds, M)``).
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
    inflation: Any = None
    clients: Any = None

    @property
    def num_rejected(self) -> Any:
        """Number of rejected client updates (per round in ``history``)."""
        return np.sum(np.asarray(self.attempts) - np.asarray(self.accepted), axis=-1)

    def dense(self, num_clients: int | None = None) -> RoundInfo:
        """The record with every per-client field over all clients (``(..., M)``, entry ``m``
        client ``m``; ``clients=None``): a client a round did not sample holds what a client that
        did not run holds (NaN free energy, inflation 1, zeros). Itself if it is dense already.

        :param num_clients: ``M`` (default: the largest sampled id + 1).

        **Example:** ``result.history.dense(M).attempts.sum(0)``: how often each client ran.
        """
        if self.clients is None:
            return self
        ids = np.asarray(self.clients, int)
        size = int(ids.max(initial=-1)) + 1 if num_clients is None else int(num_clients)
        fields = {}
        for name, fill in CLIENT_FIELDS.items():
            values = getattr(self, name)
            if values is None:
                continue
            values = np.asarray(values)
            full = np.full(values.shape[:-1] + (size,), fill, values.dtype)
            np.put_along_axis(full, ids, values, axis=-1)
            fields[name] = full
        return self._replace(clients=None, **fields)

    @classmethod
    def stacked(cls, infos: list) -> RoundInfo:
        """Rounds' records stacked: every field gains a leading round axis (a field that is
        ``None`` in every round stays ``None``).

        **Example:** ``RoundInfo.stacked(infos).elbo`` is ``(rounds,)``.
        """
        return cls(
            *(
                None if all(x is None for x in field) else np.stack([np.asarray(x) for x in field])
                for field in zip(*infos)
            )
        )


# RoundInfo's per-client fields and what a client that did not run holds
CLIENT_FIELDS = {
    "free_energy": np.nan,
    "attempts": 0,
    "accepted": 0,
    "damping": 0.0,
    "clamped": 0,
    "rejection": 0,
    "moved": False,
    "bytes_received": 0,
    "bytes_sent": 0,
    "inflation": 1.0,
}


class ClientOutcome(NamedTuple):
    """What merging a group of client updates did, per client of the group (``(G,)`` leaves).

    :ivar free_energy: each client's local free energy at the end of its update.
    :ivar accepted: whether its delta was merged.
    :ivar damping: the damping applied (0 if rejected).
    :ivar clamped: corrections its local update made to stay valid.
    :ivar hyper_grad: its gradient of the local free energy w.r.t. the hyperparameters (``()`` if
        none).
    :ivar rejection: why it was rejected (a :class:`Rejection` code, 0 if merged).
    :ivar moved: whether its delta was non-zero.
    :ivar inflation: the variance inflation of its tilted distribution beyond the family's form (1
        if not measured).
    :ivar elbo_term: its term of the ELBO of the ``q`` it was sent, ``E_q[log p(y_m, z_m | theta)
        - log q_m(z_m)]`` (:func:`~numpyro_pvi.server.elbo.client_elbo_term`), or ``None`` when the
        server's rounds do not record it.
    :ivar prior_term: the prior's terms of the same ELBO, ``E_q[log p(theta)] + H[q]``
        (:func:`~numpyro_pvi.server.elbo.prior_elbo_term`, the same for every client sent that
        ``q``), or ``None``.
    """

    free_energy: jax.Array
    accepted: jax.Array
    damping: jax.Array
    clamped: jax.Array
    hyper_grad: Any
    rejection: jax.Array
    moved: jax.Array
    inflation: Any = 1.0
    elbo_term: Any = None
    prior_term: Any = None


def broadcast_slots(tree: Any, capacity: int, zero: bool = False) -> Any:
    """``tree`` repeated over ``capacity`` client slots (zeros of its shape if ``zero``), built in
    NumPy and sent with ``device_put`` (eager JAX operations compile one program each in a fresh
    process)."""
    fill = (
        (lambda x: np.zeros((capacity,) + np.shape(x), jnp.result_type(x)))
        if zero
        else (lambda x: np.broadcast_to(np.asarray(x), (capacity,) + np.shape(x)).copy())
    )
    return jax.device_put(jax.tree.map(fill, tree))


def grow_slots(old: Any, fresh: Any) -> Any:
    """``fresh`` (sized for more client slots) holding ``old``'s entries in its first slots."""
    return jax.tree.map(
        lambda o, f: o if jnp.shape(o) == jnp.shape(f) else f.at[: jnp.shape(o)[0]].set(o),
        old,
        fresh,
    )
