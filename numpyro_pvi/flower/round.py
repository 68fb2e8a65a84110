"""The round contract over Flower: the library's servers schedule sites that hold their own data.

:class:`FlowerRunner` is a :class:`~numpyro_pvi.backends.ConcurrentRunner` whose clients are Flower
sites: ``submit`` pushes site ``m`` its cavity, ``q``, its key and the hyperparameters
(``grid.push_messages``), ``wait_any`` pulls replies until one arrives (``grid.pull_messages``) and
``result`` reads the site's :class:`~numpyro_pvi.local_updates.base.ClientResult` from it (its
local state stays at the site). :class:`FlowerRound` is the library's
:class:`~numpyro_pvi.server.round.Round` over that runner: a group of sites gets its messages at
once and their replies merge together with the library's merge (``steps.apply``), the
``start`` / ``wait`` / ``finish`` of :class:`~numpyro_pvi.Asynchronous` send a site its next cavity
as soon as its reply is merged. So ``server.run_round(state, round, num_clients)`` is the in-process
server's own code whichever runtime the sites live on.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from numpyro_pvi.backends.base import failed_result, stack, take
from numpyro_pvi.families import NatParams
from numpyro_pvi.flower.wire import content_bytes, key_to_record, tree_from_record, tree_to_record
from numpyro_pvi.local_updates.base import ClientResult
from numpyro_pvi.server.merge import cavities
from numpyro_pvi.server.round import Round
from numpyro_pvi.state import ClientOutcome, PVIState, Rejection

PULL_INTERVAL = 0.05  # seconds between polls for replies


class Sent(NamedTuple):
    """A message on its way to a site: its Flower id and when the server stops waiting for it."""

    message_id: str
    deadline: float


def result_like(delta: NatParams, hyper: Any) -> ClientResult:
    """What a site's reply holds (a :class:`ClientResult` without the site's local state), as the
    zeros :func:`~numpyro_pvi.flower.wire.tree_from_record` reads it by: per-client scalars but for
    the delta and the hyperparameters' gradient."""
    scalars = ClientResult(delta, 0.0, ())
    return jax.tree.map(
        lambda x: jnp.zeros(jnp.shape(x), jnp.result_type(x)),
        scalars._replace(
            delta=delta,
            free_energy=jnp.zeros((), jnp.result_type(float)),
            clamped=jnp.zeros((), jnp.int32),
            hyper_grad=hyper,
            failure=jnp.zeros((), jnp.int32),
            inflation=jnp.ones((), jnp.result_type(float)),
        ),
    )


def reply_result(result: ClientResult) -> ClientResult:
    """The site's side of :func:`result_like`: ``result`` without its local state, every entry but
    the delta and the hyperparameters' gradient a scalar (``clamped`` summed)."""
    return result._replace(
        state=(),
        free_energy=jnp.asarray(result.free_energy, jnp.result_type(float)),
        clamped=jnp.asarray(jnp.sum(result.clamped), jnp.int32),
        failure=jnp.asarray(result.failure, jnp.int32),
        inflation=jnp.asarray(result.inflation, jnp.result_type(float)),
    )


class FlowerRunner:
    """The sites of a Flower run as a :class:`~numpyro_pvi.backends.ConcurrentRunner` (see the
    module docstring).

    :param grid: the run's Flower ``Grid``.
    :param node_of: ``{client index: Flower node id}`` (grows as sites join).
    :param like: the zeros of a site's reply (:func:`result_like`).
    :param timeout: seconds a site has to answer a message; a silent site is rejected
        (``Rejection.TIMEOUT``).
    :param config: settings sent with every message (Flower's ``train_config``).

    ``accepted[m]`` tells site ``m`` with its next message whether its last update was merged (it
    then keeps the local state that update left); ``down`` / ``up`` count the bytes Flower sent and
    received.

    **Example:** ``FlowerRunner(grid, {0: node_a, 1: node_b}, result_like(q, ()), 600,
    ConfigRecord())``
    """

    def __init__(
        self,
        grid: Grid,
        node_of: dict[int, int],
        like: ClientResult,
        timeout: float,
        config: ConfigRecord,
    ) -> None:
        self.grid, self.node_of, self.like = grid, node_of, like
        self.timeout, self.config = timeout, config
        self.accepted: dict[int, bool] = {}
        # site m's term of the ELBO of the q it was sent, from its last reply (when it reported one)
        self.elbo_terms: dict[int, float] = {}
        # q -> the server's terms of the ELBO (prior and entropy), set by the strategy; None: not
        # recorded
        self.prior_term: Callable | None = None
        self.replies: dict[str, Message] = {}  # message id -> the site's reply
        # site m's (releases so far, rows), reported by a DP site with each reply
        self.releases: dict[int, tuple[int, int]] = {}
        self.down, self.up, self.sent = 0, 0, 0

    # -------------------------------------------------------------- ConcurrentRunner

    def submit(
        self,
        m: int,
        key: jax.Array,
        cavity: NatParams,
        q: NatParams,
        state: Any,
        hyper: Any,
        clients: Any = None,
    ) -> Sent:
        """Push site ``m`` its cavity, ``q``, key and hyperparameters; the handle for
        :meth:`result`."""
        content = self.update_content(m, key, q, hyper, cavity)
        self.down += content_bytes(content)
        message = Message(content, dst_node_id=self.node_of[int(m)], message_type=MessageType.TRAIN)
        (message_id,) = self.grid.push_messages([message])
        return Sent(message_id, time.time() + self.timeout)

    def update_content(
        self, m: int, key: jax.Array, q: NatParams, hyper: Any, cavity: NatParams | None = None
    ) -> RecordDict:
        """The records of site ``m``'s update message: ``q``, its key, the hyperparameters, the
        round's settings and, unless the site forms its own (``None``), its cavity."""
        key_record, impl = key_to_record(key)
        self.sent += 1
        settings = ConfigRecord(
            {
                **dict(self.config),
                "message": self.sent,
                "client": int(m),
                "key-impl": impl,
                "accepted": int(self.accepted.get(int(m), False)),
            }
        )
        cavity_record = {} if cavity is None else {"cavity": tree_to_record(cavity)}
        return RecordDict(
            {
                **cavity_record,
                "q": tree_to_record(q),
                "key": key_record,
                "hyper": tree_to_record(hyper),
                "pvi": settings,
            }
        )

    def wait_any(self, handles: dict) -> int:
        """The client (a key of ``{client: Sent}``) whose reply comes first (or whose time is
        up)."""
        while True:
            self._pull([h.message_id for h in handles.values()])
            now = time.time()
            for m, handle in handles.items():
                if handle.message_id in self.replies or now > handle.deadline:
                    return m
            time.sleep(PULL_INTERVAL)

    def result(
        self, m: int, handle: Sent, cavity: NatParams, state: Any, hyper: Any = ()
    ) -> ClientResult:
        """Site ``m``'s reply to ``handle`` (waiting for it): a failed site gives a non-finite
        delta and ``RAISED``, a silent one ``TIMEOUT``; the server rejects both."""
        # pulled at least once: a reply that came while the server merged others is not late
        self._pull([handle.message_id])
        while handle.message_id not in self.replies and time.time() <= handle.deadline:
            time.sleep(PULL_INTERVAL)
            self._pull([handle.message_id])
        reply = self.replies.pop(handle.message_id, None)
        if reply is None:
            return failed_result(cavity, state, hyper, Rejection.TIMEOUT)
        if reply.has_error():
            return failed_result(cavity, state, hyper, Rejection.RAISED)
        self.up += content_bytes(reply.content)
        metrics = reply.content.metric_records.get("pvi")
        if metrics is not None and "elbo-term" in metrics:
            self.elbo_terms[int(m)] = float(metrics["elbo-term"])
        if metrics is not None and "releases" in metrics:
            released = max(int(metrics["releases"]), self.releases.get(int(m), (0, 0))[0])
            self.releases[int(m)] = (released, int(metrics["rows"]))
        like = self.like._replace(delta=jax.tree.map(jnp.zeros_like, cavity))
        return tree_from_record(reply.content.array_records["result"], like, f"reply of site {m}")

    def cancel(self, handles: dict) -> None:
        """Forget ``handles``: their replies are never read (Flower drops them with the run)."""
        for handle in handles.values():
            self.replies.pop(handle.message_id, None)

    def __call__(
        self,
        ids: Any,
        keys: Any,
        cavities: NatParams,
        q: NatParams,
        states: Any,
        clients: Any = None,
        hyper: Any = (),
    ) -> ClientResult:
        """Sites ``ids`` update from ``cavities`` (stacked over ``ids``) at once; their results
        stacked."""
        ids = [int(m) for m in ids]
        handles = [
            self.submit(m, keys[i], take(cavities, i), q, (), hyper) for i, m in enumerate(ids)
        ]
        return stack(
            [
                self.result(m, handle, take(cavities, i), (), hyper)
                for i, (m, handle) in enumerate(zip(ids, handles))
            ]
        )

    def _pull(self, message_ids: list) -> None:
        waiting = [i for i in message_ids if i not in self.replies]
        if waiting:
            for reply in self.grid.pull_messages(waiting):
                self.replies[reply.metadata.reply_to_message_id] = reply


class FlowerRound(Round):
    """A :class:`~numpyro_pvi.server.round.Round` whose clients are Flower sites
    (:class:`FlowerRunner` is ``steps.runner``): a group of sites updates at once, each against its
    cavity from ``pulled`` with the key ``fold_in(key, m)`` (the in-process round's), and their
    replies merge together with ``steps.apply``, the in-process merge.

    :param family: the family of ``q`` (whose cavities are checked before a site gets them, as the
        in-process round checks them).

    The other parameters are :class:`~numpyro_pvi.server.round.Round`'s, without the clients' data.

    **Example:** ``FlowerRound(steps, family, round_key, M, M, in_flight, sample_key)``
    """

    def __init__(
        self,
        steps: Any,
        family: Any,
        round_key: jax.Array,
        num_clients: int,
        capacity: int,
        in_flight: Any = None,
        sample_key: jax.Array | None = None,
    ) -> None:
        super().__init__(steps, None, round_key, num_clients, capacity, in_flight, sample_key)
        self.family = family

    def __call__(
        self,
        state: PVIState,
        ids: list,
        pulled: NatParams | None = None,
        salt: int = 0,
        allow: bool = True,
    ) -> tuple[PVIState, np.ndarray]:
        pulled = state.q if pulled is None else pulled
        ids = [int(m) for m in ids]
        index, keys = jnp.asarray(ids), self.site_keys(ids, salt)
        cavity, cavity_ok = cavities(self.family, pulled, state.factors, index)
        result = self.steps.runner(ids, keys, cavity, pulled, (), None, state.hyper)
        state, out = self.steps.apply(
            state,
            index,
            result,
            jnp.full(index.shape, allow),
            cavity_ok,
            None,
            self._elbo(ids, pulled),
        )
        return state, self.note_group(ids, pulled, state, out)

    def site_keys(self, ids: list, salt: int) -> list:
        """Each site's key of the round: the round's key folded with the site's index."""
        key = self.key(salt)
        return [jax.random.fold_in(key, m) for m in ids]

    def note_group(self, ids: list, pulled: NatParams, state: PVIState, out: Any) -> np.ndarray:
        """Note the group's outcomes (and the traffic) for the round; which updates were merged."""
        out = jax.tree.map(np.asarray, out)
        accepted = self._note(ids, out)
        self._count(ids, pulled, state.hyper, out)
        return accepted

    def _elbo(self, ids: list, pulled: NatParams) -> tuple | None:
        """The sites' reported terms of the ELBO of ``pulled`` and the server's, as
        ``steps.apply`` records them; ``None`` unless every site of the group reported one."""
        runner = self.steps.runner
        terms = [runner.elbo_terms.pop(m, None) for m in ids]
        if runner.prior_term is None or any(t is None for t in terms):
            return None
        return jnp.asarray(terms), runner.prior_term(pulled)

    def _note(self, ids: list, out: ClientOutcome) -> np.ndarray:
        accepted = super()._note(ids, out)
        for m, merged in zip(ids, np.asarray(accepted)[: len(ids)]):
            self.steps.runner.accepted[int(m)] = bool(merged)
        return accepted


def hyper_like(record: ArrayRecord, shapes: dict) -> dict:
    """The hyperparameters ``{name: value}`` a site reported, by their names and shapes."""
    like = {name: jnp.zeros(tuple(shape), jnp.result_type(float)) for name, shape in shapes.items()}
    return tree_from_record(record, like, "hyperparameters")
