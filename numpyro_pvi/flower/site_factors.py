"""Factors kept at the sites (``PVIStrategy(..., factors="sites")``): the server holds ``q`` only.

Each site keeps its own factor ``t_m`` (and its local state) in Flower's per-node
``context.state``, and, when its node config names a ``"factor-path"``, in that file too, so that
the factor survives a restart of the site's process within a run. A merge of a group of sites
takes three exchanges:

1. **update** (``train.pvi_sites``): the server sends ``q``, the key and the hyperparameters; the
   site forms its own cavity ``q - t_m``, runs the local update (the same code as with the factors
   at the server, :meth:`~numpyro_pvi.flower.client.Site.train`), keeps its delta (and ``q``) and
   replies with the delta. A dense family's site whose cavity is invalid does not update and says so
   (``Rejection.INVALID``), as the server's own check on a visit would.
2. **check** (``query.pvi_check``): the server sums the merged deltas, ``total``, and sends it with
   the damping ``rho`` (and ``q`` to the sites that were not sent it with an update); each site
   answers the number of halvings ``k_m`` after which its new cavity ``(q + rho 2^-k total) - (t_m
   + rho 2^-k delta_m)`` is valid (every site for diagonal precisions, whose merges check every
   cavity; the merging sites for dense ones, as :func:`~numpyro_pvi.server.merge.merge` checks).
   The server checks ``q`` itself; the merge takes the largest count (validity is convex in
   ``rho`` and holds at ``rho = 0``, so this is the step the server's backtracking finds with every
   factor in hand) and is rejected if no step is valid.
3. **commit** (``train.pvi_commit``): the server tells the merging sites the damping it used; each
   adds ``rho_used * delta_m`` to its factor.

With the same seeds ``q`` equals the run with the factors at the server (to float rounding).
Servers whose steps need every factor at the server are refused (:func:`check_server`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from numpyro_pvi.backends.base import failed_result
from numpyro_pvi.backtracking import backtrack
from numpyro_pvi.families import NatParams
from numpyro_pvi.flower.round import (
    PULL_INTERVAL,
    FlowerRound,
    FlowerRunner,
    Sent,
    reply_result,
    result_like,
)
from numpyro_pvi.flower.wire import content_bytes, tree_from_record, tree_to_record
from numpyro_pvi.server.heavy_ball import HeavyBall
from numpyro_pvi.server.merge import checks_every_cavity, rejection_codes, screen
from numpyro_pvi.server.servers import Asynchronous, Server
from numpyro_pvi.state import ClientOutcome, PVIState, Rejection

FACTORS = ("server", "sites")
"""Where a Flower run keeps the sites' factors (``PVIStrategy(..., factors=)``)."""

# the message types of the three exchanges (Flower routes "train.<action>" to @app.train(action))
UPDATE, CHECK, COMMIT = (
    f"{MessageType.TRAIN}.pvi_sites",
    f"{MessageType.QUERY}.pvi_check",
    f"{MessageType.TRAIN}.pvi_commit",
)
# keys of the site's factor and its last update's reply in Flower's context.state
FACTOR, DELTA, SENT_Q = "pvi.factor", "pvi.delta", "pvi.sent-q"
FACTOR_PATH = "factor-path"
"""The node-config entry naming the file a site keeps its factor in (optional)."""


def check_factors(factors: Any, server: Server) -> None:
    """Refuse, by name, a ``factors`` that is not ``"server"`` or ``"sites"``, and a server that
    cannot run with the factors at the sites (:func:`check_server`).

    **Example:** ``check_factors("sites", pvi.Synchronous(0.5))`` passes; ``check_factors("sites",
    pvi.Synchronous())`` raises ``ValueError`` (HeavyBall).
    """
    if not isinstance(factors, str) or factors not in FACTORS:
        raise ValueError(f'factors must be "server" or "sites", got {factors!r}.')
    if factors == "sites":
        check_server(server)


def check_server(server: Server) -> None:
    """Refuse the servers that need every factor at the server.

    * ``HeavyBall`` damping (``Synchronous()``'s default) extrapolates every factor by its own
      velocity and then checks every cavity: it needs ``t_m`` and its last change for every site;
    * ``Asynchronous`` merges one reply while the other sites compute: each merge would need a
      check from every site (a round trip to all of them per merge), and its stale updates a
      server-side record of what each site was sent.

    **Example:** ``check_server(pvi.Asynchronous(0.5))`` raises ``NotImplementedError``.
    """
    if isinstance(server.damping, HeavyBall):
        raise ValueError(
            'factors="sites" cannot use HeavyBall damping (the default of pvi.Synchronous()): '
            "its extrapolation moves every factor by its own velocity and checks every cavity, "
            "so the server must hold every t_m. Pass a damping: pvi.Synchronous(0.5) or "
            "pvi.Synchronous(pvi.AdaptiveDamping())."
        )
    if isinstance(server, Asynchronous):
        raise NotImplementedError(
            'factors="sites" does not run pvi.Asynchronous: each merge needs every site to check '
            "its new cavity (a round trip to all sites per merge, while they compute). Use "
            'pvi.Synchronous(0.5), pvi.Sequential() or pvi.Continual(), or factors="server".'
        )


# ---------------------------------------------------------------------------- the server's side


class SiteFactorsRunner(FlowerRunner):
    """A :class:`~numpyro_pvi.flower.round.FlowerRunner` whose sites hold their factors: an update
    message carries ``q`` (no cavity), and :meth:`check` / :meth:`commit` are the merge's other
    two exchanges (see the module docstring). The parameters are
    :class:`~numpyro_pvi.flower.round.FlowerRunner`'s.

    **Example:** ``SiteFactorsRunner(grid, {0: node_a, 1: node_b}, result_like(q, ()), 600,
    ConfigRecord())``
    """

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
        """Push site ``m`` ``q``, its key and the hyperparameters (``cavity`` is not sent: the site
        forms its own)."""
        content = self.update_content(m, key, q, hyper)
        return self._push(m, content, UPDATE)

    def check(
        self,
        ids: list,
        q: NatParams,
        total: NatParams,
        included: dict,
        rho: float,
        backtracks: int,
        sent_q: set,
    ) -> list:
        """Sites ``ids``' halvings of ``rho`` after which their new cavity is valid (``backtracks
        + 1``: none is, or the site did not answer); ``included[m]``: whether ``m``'s delta is in
        ``total``; the sites ``sent_q`` were sent this ``q`` with their update (it is not sent
        again)."""
        q_record, total_record = tree_to_record(q), tree_to_record(total)
        contents = {
            m: RecordDict(
                {
                    **({} if m in sent_q else {"q": q_record}),
                    "total": total_record,
                    "pvi": ConfigRecord(
                        {
                            "rho": float(rho),
                            "backtracks": int(backtracks),
                            "included": int(included.get(m, False)),
                        }
                    ),
                }
            )
            for m in ids
        }
        replies = self._exchange(contents, CHECK)
        none = backtracks + 1
        return [
            int(replies[m].content.config_records["pvi"]["halvings"]) if m in replies else none
            for m in ids
        ]

    def commit(self, ids: list, rho_used: float) -> None:
        """Sites ``ids`` add ``rho_used`` times their last delta to their factors (and say so)."""
        content = lambda: RecordDict({"pvi": ConfigRecord({"rho": float(rho_used)})})  # noqa: E731
        replies = self._exchange({m: content() for m in ids}, COMMIT)
        if len(replies) < len(ids):
            raise RuntimeError(
                f"{len(ids) - len(replies)} site(s) did not confirm the merge of their update in "
                f"{self.timeout} s: their factors no longer match q."
            )

    def _push(self, m: int, content: RecordDict, message_type: str) -> Sent:
        self.down += content_bytes(content)
        message = Message(content, dst_node_id=self.node_of[int(m)], message_type=message_type)
        (message_id,) = self.grid.push_messages([message])
        return Sent(message_id, time.time() + self.timeout)

    def _exchange(self, contents: dict, message_type: str) -> dict:
        """``{m: content}`` to the sites, their replies ``{m: reply}`` (errors and the silent left
        out)."""
        handles = {m: self._push(m, content, message_type) for m, content in contents.items()}
        replies = {}
        for m, handle in handles.items():
            self._pull([handle.message_id])
            while handle.message_id not in self.replies and time.time() <= handle.deadline:
                time.sleep(PULL_INTERVAL)
                self._pull([handle.message_id])
            reply = self.replies.pop(handle.message_id, None)
            if reply is not None and not reply.has_error():
                self.up += content_bytes(reply.content)
                replies[m] = reply
        return replies


class SiteFactorsRound(FlowerRound):
    """A :class:`~numpyro_pvi.flower.round.FlowerRound` whose sites hold their factors
    (:class:`SiteFactorsRunner` is ``steps.runner``): a group's merge is the update, check and
    commit exchanges of the module docstring, and records what
    :meth:`~numpyro_pvi.flower.round.FlowerRound.__call__` records.

    :param server: the run's server (its damping and ``max_backtracks``).

    The other parameters are :class:`~numpyro_pvi.flower.round.FlowerRound`'s.

    **Example:** ``SiteFactorsRound(steps, family, pvi.Synchronous(0.5), round_key, M, M)``
    """

    def __init__(self, steps: Any, family: Any, server: Server, *args: Any) -> None:
        super().__init__(steps, family, *args)
        self.server = server

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
        like = jax.tree.map(lambda x: jnp.broadcast_to(x, (len(ids),) + x.shape), pulled)
        keys = self.site_keys(ids, salt)
        result = self.steps.runner(ids, keys, like, pulled, (), None, state.hyper)
        state, out = self._merge(state, ids, pulled, result, allow)
        return state, self.note_group(ids, pulled, state, out)

    def _merge(
        self, state: PVIState, ids: list, pulled: NatParams, result: Any, allow: bool
    ) -> tuple[PVIState, ClientOutcome]:
        """The sites' deltas merged into ``q``, the step checked by the server (``q``) and the
        sites (their cavities)."""
        runner, backtracks = self.steps.runner, self.server.max_backtracks
        rho = self.server.damping.rho(state.damping)
        finite, moved = screen(result.delta, result.free_energy)
        include = finite & allow
        propose = _propose_jit(self.family, backtracks)
        total, k_q = propose(state.q, result.delta, include, rho)
        included = {m: bool(ok) for m, ok in zip(ids, np.asarray(include))}
        merging = [m for m in ids if included[m]]
        checked = sorted(runner.node_of) if checks_every_cavity(state.q) else merging
        k = int(k_q)
        if merging:
            # the group's sites were sent this q with their update (synchronous, sequential rounds)
            sent_q = set(ids) if pulled is state.q else set()
            halvings = runner.check(
                checked, state.q, total, included, float(rho), backtracks, sent_q
            )
            k = max([k, *halvings])
        valid = k <= backtracks
        rho_used = _step(rho, k) if valid else jnp.zeros_like(jnp.asarray(rho, float))
        accepted = include & valid
        if valid and merging:
            runner.commit(merging, float(rho_used))
            state = state._replace(q=_add(state.q, rho_used, total))
        elbo = self._elbo(ids, pulled)
        return state, ClientOutcome(
            result.free_energy,
            accepted,
            jnp.broadcast_to(rho_used, include.shape) * accepted,
            result.clamped,
            result.hyper_grad,
            rejection_codes(result.failure, finite, jnp.asarray(valid), allow),
            moved & accepted,
            result.inflation,
            None if elbo is None else elbo[0],
            None if elbo is None else jnp.broadcast_to(elbo[1], include.shape),
        )


_PROPOSE: dict = {}


def _propose_jit(family: Any, backtracks: int) -> Any:
    """``(q, deltas, include, rho) -> (total, halvings)``: the sum of the included deltas (as
    :func:`~numpyro_pvi.server.merge.merge` sums them) and the halvings of ``rho`` after which
    ``q + rho 2^-k total`` is valid, the server's own check."""
    key = (id(family), backtracks)
    if key not in _PROPOSE or _PROPOSE[key][0] is not family:

        def propose(q: NatParams, deltas: NatParams, include: jax.Array, rho: Any) -> tuple:
            mask = lambda d: jnp.reshape(include, include.shape + (1,) * (d.ndim - 1))  # noqa: E731
            deltas = jax.tree.map(lambda d: jnp.where(mask(d), d, 0.0), deltas)
            total = jax.tree.map(lambda d: jnp.sum(d, axis=0), deltas)
            out = backtrack(lambda r: ((), family.is_valid(q + r * total)), rho, backtracks)
            return total, out.halvings

        _PROPOSE[key] = (family, jax.jit(propose))
    return _PROPOSE[key][1]


@jax.jit
def _step(rho: Any, halvings: Any) -> jax.Array:
    """``rho`` halved ``halvings`` times, as :func:`~numpyro_pvi.backtracking.backtrack` halves."""
    return rho * 0.5 ** jnp.asarray(halvings, jnp.int32)


@jax.jit
def _add(x: NatParams, rho: jax.Array, d: NatParams) -> NatParams:
    """``x + rho * d``, as the server's merge adds a damped step."""
    return jax.tree.map(lambda a, b: a + rho * b, x, d)


# ---------------------------------------------------------------------------- the site's side


def site_update(site: Any, message: Message, context: Context) -> Message:
    """The site's update against its own cavity ``q - t_m`` (its factor from ``context.state``, or
    the node config's ``"factor-path"`` after a restart; flat at first): ``site.train`` on it, the
    reply kept for the commit.

    **Example:** ``@app.train("pvi_sites")`` ``def update(message, context): return
    site_update(site, message, context)`` (:func:`~numpyro_pvi.flower.client_app` registers it).
    """
    prep = site.prepare(context)
    like = prep.problem.family.zeros(prep.problem.sites.dim)
    q = tree_from_record(message.content.array_records["q"], like, "q")
    factor = load_factor(context, like)
    cavity = jax.tree.map(jnp.subtract, q, factor)
    context.state.pop(DELTA, None)
    context.state[SENT_Q] = message.content.array_records["q"]  # the check may not send it again
    if not checks_every_cavity(q) and not bool(prep.problem.family.is_valid(cavity)):
        # a dense cavity is checked on a visit, as the server checks it (merge.cavities)
        result = failed_result(cavity, (), prep.hyper or (), Rejection.INVALID)
        return Message(
            RecordDict({"result": tree_to_record(reply_result(result))}), reply_to=message
        )
    message.content["cavity"] = tree_to_record(cavity)
    reply = site.train(message, context)
    context.state[DELTA] = reply.content.array_records["result"]
    return reply


def site_check(site: Any, message: Message, context: Context) -> Message:
    """The halvings of the server's ``rho`` after which the site's new cavity is valid.

    **Example:** ``@app.query("pvi_check")`` ``def check(message, context): return
    site_check(site, message, context)`` (:func:`~numpyro_pvi.flower.client_app` registers it).
    """
    prep = site.prepare(context)
    like = prep.problem.family.zeros(prep.problem.sites.dim)
    content, config = message.content, message.content.config_records["pvi"]
    sent = content.array_records["q"] if "q" in content else context.state.array_records[SENT_Q]
    q = tree_from_record(sent, like, "q")
    total = tree_from_record(content.array_records["total"], like, "total")
    delta = _last_delta(context, prep, like) if int(config["included"]) else like
    check = _check_jit(prep.problem.family, int(config["backtracks"]))
    halvings = check(q, total, load_factor(context, like), delta, float(config["rho"]))
    reply = ConfigRecord({"halvings": int(halvings)})
    return Message(RecordDict({"pvi": reply}), reply_to=message)


def site_commit(site: Any, message: Message, context: Context) -> Message:
    """Add the damping the server used times the site's last delta to its factor.

    **Example:** ``@app.train("pvi_commit")`` ``def commit(message, context): return
    site_commit(site, message, context)`` (:func:`~numpyro_pvi.flower.client_app` registers it).
    """
    prep = site.prepare(context)
    like = prep.problem.family.zeros(prep.problem.sites.dim)
    rho = float(message.content.config_records["pvi"]["rho"])
    factor = _add(load_factor(context, like), rho, _last_delta(context, prep, like))
    save_factor(context, factor)
    context.state.pop(DELTA, None)
    return Message(RecordDict(), reply_to=message)


SITE_ACTIONS = {UPDATE: site_update, CHECK: site_check, COMMIT: site_commit}
"""``message type -> handler(site, message, context)``: what a site answers with its factor."""


def load_factor(context: Context, like: NatParams) -> NatParams:
    """The site's factor ``t_m``: from ``context.state``; else from the node config's
    ``"factor-path"`` if it holds this run's; else flat (``like``).

    **Example:** ``t_m = load_factor(context, pvi.MeanFieldGaussian().zeros(dim))``
    """
    if FACTOR in context.state:
        return tree_from_record(context.state.array_records[FACTOR], like, "site's factor")
    path = context.node_config.get(FACTOR_PATH)
    if path and os.path.exists(str(path)):
        with np.load(str(path)) as saved:
            if int(saved["run"]) == int(context.run_id):
                leaves = [saved[str(i)] for i in range(len(jax.tree.leaves(like)))]
                factor = jax.tree.unflatten(jax.tree.structure(like), leaves)
                context.state[FACTOR] = tree_to_record(factor)
                return load_factor(context, like)
    return like


def save_factor(context: Context, factor: NatParams) -> None:
    """Keep ``factor`` in ``context.state`` and, where the node config names a ``"factor-path"``,
    in that file (written whole, then renamed: a crash leaves the old one).

    **Example:** ``save_factor(context, t_m)``
    """
    context.state[FACTOR] = tree_to_record(factor)
    path = context.node_config.get(FACTOR_PATH)
    if path:
        leaves = {str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(factor))}
        partial = f"{path}.partial.npz"
        np.savez(partial, run=np.asarray(int(context.run_id)), **leaves)
        os.replace(partial, str(path))


def forget_factor(context: Context) -> None:
    """A new run starts from a flat factor (``q`` restarts from the prior): forget the site's.

    **Example:** ``forget_factor(context)`` (:meth:`Site.hello
    <numpyro_pvi.flower.client.Site.hello>` calls it).
    """
    for key in (FACTOR, DELTA, SENT_Q):
        context.state.pop(key, None)


def _last_delta(context: Context, prep: Any, like: NatParams) -> NatParams:
    record: ArrayRecord = context.state.array_records[DELTA]
    return tree_from_record(record, result_like(like, prep.hyper or ()), "site's delta").delta


_CHECK: dict = {}


def _check_jit(family: Any, backtracks: int) -> Any:
    """``(q, total, factor, delta, rho) -> halvings`` of ``rho`` after which the new cavity ``(q +
    r total) - (factor + r delta)`` is valid (``backtracks + 1``: none is)."""
    key = (id(family), backtracks)
    if key not in _CHECK or _CHECK[key][0] is not family:

        def check(q: NatParams, total: NatParams, factor: NatParams, delta: NatParams, rho: Any):
            def propose(r: jax.Array) -> tuple:
                cavity = jax.tree.map(
                    lambda a, t, f, d: (a + r * t) - (f + r * d), q, total, factor, delta
                )
                return (), family.is_valid(cavity)

            return backtrack(propose, rho, backtracks).halvings

        _CHECK[key] = (family, jax.jit(check))
    return _CHECK[key][1]
