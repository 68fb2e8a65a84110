"""A PVI site as a Flower ``ClientApp``: it holds its own data and runs the library's
``client_update``.

The site receives its cavity ``q - t_m``, ``q`` and a random key, runs the local update bound to
*its own* problem (the model on its data alone: :meth:`PVI.build` with one partition), and answers
with the natural- parameter delta and its local free energy. Its data and its persistent local state
(e.g. local latent guides) never leave it: the state lives in Flower's per-node ``context.state``; a
new state is kept as pending and committed when the server's next message says the update was
merged.

Compiled functions are cached per process (per Flower run and node; sites of the same shapes share
them), so a site compiles once, not once per message.
"""

from __future__ import annotations

import json
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from numpyro_pvi.backends.base import failed_result, take
from numpyro_pvi.families import FactorFamily
from numpyro_pvi.flower.round import reply_result
from numpyro_pvi.flower.site_factors import (
    CHECK,
    COMMIT,
    UPDATE,
    forget_factor,
    site_check,
    site_commit,
    site_update,
)
from numpyro_pvi.flower.wire import (
    key_from_record,
    layout_to_text,
    tree_from_record,
    tree_to_record,
)
from numpyro_pvi.local_updates.base import Client, CountsRejectedUpdates, LocalUpdate
from numpyro_pvi.model.problem import Problem
from numpyro_pvi.privacy.accounting import PrivateUpdate
from numpyro_pvi.pvi import PVI
from numpyro_pvi.server.elbo import client_elbo_term
from numpyro_pvi.server.servers import Synchronous

# keys of the site's local state in Flower's context.state
STATE, PENDING = "pvi.state", "pvi.pending"

LoadData = Callable[[Context], tuple[tuple, dict]]
"""``load_data(context) -> (args, kwargs)``: the site's own data, e.g. read from a local file named
in ``context.node_config``."""


def partition_id(context: Context) -> int:
    """The site's client index: ``context.node_config["partition-id"]`` (set by Flower's simulation
    engine, and by ``flower-supernode --node-config "partition-id=0"`` in a deployment).

    **Example:** ``client_app(..., client_id=partition_id)`` (the default).
    """
    if "partition-id" not in context.node_config:
        raise ValueError(
            "The site has no node_config 'partition-id': start its SuperNode with "
            '--node-config "partition-id=<m>" (m = 0 .. num_clients - 1) or pass '
            "client_id=."
        )
    return int(context.node_config["partition-id"])


class Prepared(NamedTuple):
    """What a site builds once from its data: its problem, its (unpadded) data, the jitted local
    update."""

    client_id: int
    problem: Problem
    client: Client
    update: Callable
    hyper: Any


class Site:
    """The site's side of PVI (see the module docstring); :func:`client_app` wraps it as a Flower
    ``ClientApp``.

    :param model, family, local_update: as in :class:`~numpyro_pvi.PVI` (the same as the server's
        family).
    :param load_data: ``context -> (args, kwargs)``, the site's data for ``model(*args, **kwargs)``.
    :param client_id: ``context -> m``, the site's client index (default :func:`partition_id`).

    **Example:** ``site = Site(model, pvi.MeanFieldGaussian(), pvi.GradientUpdate(optax.adam(0.05),
    100), load)``
    """

    def __init__(
        self,
        model: Callable,
        family: FactorFamily,
        local_update: LocalUpdate,
        load_data: LoadData,
        client_id: Callable[[Context], int] | None = None,
    ) -> None:
        if not isinstance(local_update, LocalUpdate):
            raise TypeError(
                "local_update must be a local update such as pvi.GradientUpdate(...), got "
                f"{local_update!r}."
            )
        if not isinstance(family, FactorFamily):
            raise TypeError(
                "family must be a pvi family such as pvi.MeanFieldGaussian(), "
                f"pvi.SiteFamilies({{...}}) or pvi.Gamma(), got {family!r}."
            )
        self.model, self.family, self.local_update = model, family, local_update
        self.load_data, self.client_id = load_data, partition_id if client_id is None else client_id

    def prepare(self, context: Context) -> Prepared:
        """The site's problem and jitted update, built on the first message of a run and cached."""
        key = (context.run_id, context.node_id)
        if key not in _PREPARED:
            inference = _INFERENCES.setdefault(
                context.run_id,
                PVI(self.model, self.family, None, self.local_update, Synchronous(1.0)),
            )
            args, kwargs = self.load_data(context)
            problem = inference.build(*args, **kwargs)  # one partition: this site's rows only
            update = _jitted_once(
                problem.client_problem,
                "update",
                lambda: self.local_update.bind(problem.client_problem),
            )
            # the hyperparameters' structure (their initial values: no randomness)
            hyper = inference.init(jax.random.PRNGKey(0), problem).hyper
            _PREPARED[key] = Prepared(
                self.client_id(context), problem, take(problem.clients, 0), update, hyper
            )
        return _PREPARED[key]

    def hello(self, message: Message, context: Context) -> Message:
        """Answer the server's first query of a run: the site's client index and the prior's natural
        parameters.

        The prior is the model's (public, the same at every site): the server starts ``q`` from it
        and checks that every site agrees; so are the hyperparameters' initial values, which the
        server then steps from the sites' gradients. The reply names the global sites whose prior
        is not Gaussian in unconstrained space, whose prior factor the server refits from the
        model it was given (``PVIStrategy(..., model=...)``), or refuses before any round.
        """
        prep = self.prepare(context)
        problem = prep.problem
        # a new run (of this or another strategy) starts from a fresh local state
        for key in (STATE, PENDING):
            context.state.pop(key, None)
        forget_factor(context)  # a site that keeps its factor (factors="sites") starts flat
        # prior (and t_0), the hyperparameters' initial values: no randomness
        start = _INFERENCES[context.run_id].init(jax.random.PRNGKey(0), problem)
        hyper_shapes = {h: list(np.shape(v)) for h, v in (start.hyper or {}).items()}
        info = ConfigRecord(
            {
                "client": prep.client_id,
                "dim": int(problem.sites.dim),
                "layout": layout_to_text(problem.family, problem.sites),
                "hyper": json.dumps(hyper_shapes),
                # Flower rejects empty strings
                **({"fitted-prior-sites": ",".join(problem.rest)} if problem.rest else {}),
            }
        )
        content = {"q0": tree_to_record(start.q), "hyper": tree_to_record(start.hyper), "pvi": info}
        return Message(RecordDict(content), reply_to=message)

    def train(self, message: Message, context: Context) -> Message:
        """One local update against the cavity in ``message`` (with the hyperparameters it carries);
        reply with the :class:`~numpyro_pvi.local_updates.base.ClientResult` but the local state
        (:func:`~numpyro_pvi.flower.round.reply_result`), and a DP site's release count
        (:func:`release_report`)."""
        prep = self.prepare(context)
        # the family as laid out for the site
        like = prep.problem.family.zeros(prep.problem.sites.dim)
        content, config = message.content, message.content.config_records["pvi"]
        cavity = tree_from_record(content.array_records["cavity"], like, "cavity")
        q = tree_from_record(content.array_records["q"], like, "q")
        rng_key = key_from_record(content.array_records["key"], str(config["key-impl"]))
        hyper = (
            tree_from_record(content.array_records["hyper"], prep.hyper, "hyperparameters")
            if prep.hyper
            else ()
        )
        state = self._local_state(context, prep, bool(config["accepted"]))
        try:
            result = jax.block_until_ready(
                prep.update(rng_key, prep.client, cavity, q, state, hyper)
            )
        except Exception:  # noqa: BLE001 - a failing update is reported (non-finite delta, RAISED), not fatal
            result = failed_result(cavity, state, hyper)
        context.state[PENDING] = tree_to_record(result.state)
        reported = {"free-energy": float(result.free_energy), "failure": int(result.failure)}
        reported.update(release_report(self.local_update, result.state, prep.client))
        num_particles = int(config.get("elbo-particles", 0))
        if num_particles > 0:  # the site's term of the ELBO of q (the same draws as in process)
            term = _elbo_term(prep.problem, num_particles)
            reported["elbo-term"] = float(term(q, prep.client_id, prep.client, state, hyper))
        metrics = MetricRecord(reported)
        # everything the server's merge reads (ClientResult), but the local state, which stays here
        return Message(
            RecordDict({"result": tree_to_record(reply_result(result)), "pvi": metrics}),
            reply_to=message,
        )

    def _local_state(self, context: Context, prep: Prepared, accepted: bool) -> Any:
        """The site's persistent local state, after committing its last update's if the server
        merged it."""
        if accepted and PENDING in context.state:
            context.state[STATE] = context.state[PENDING]
        like = self.local_update.init_state(prep.problem.client_problem)
        if not accepted and PENDING in context.state:
            self._keep_rejected(context, like)
        # through a record even at first, so that every round passes the same (non-weak) types: no
        # recompilation
        record = (
            context.state.array_records[STATE] if STATE in context.state else tree_to_record(like)
        )
        return tree_from_record(record, like, "site's local state")

    def _keep_rejected(self, context: Context, like: Any) -> None:
        """The site's last update was not merged: keep ``rejected_state(old, new)``, as the
        in-process server keeps it for an update that counts rejected updates
        (:class:`~numpyro_pvi.local_updates.CountsRejectedUpdates`: a DP site's release still counts
        towards its budget); other updates keep their old state."""
        if not isinstance(self.local_update, CountsRejectedUpdates):
            return
        old = (
            tree_from_record(context.state.array_records[STATE], like, "site's local state")
            if STATE in context.state
            else like
        )
        new = tree_from_record(context.state.array_records[PENDING], like, "site's local state")
        context.state[STATE] = tree_to_record(self.local_update.rejected_state(old, new))


def release_report(local_update: LocalUpdate, state: Any, client: Client) -> dict:
    """What a DP site reports with each reply for the server's privacy accounting
    (:meth:`PVIStrategy.privacy_spent <numpyro_pvi.flower.PVIStrategy.privacy_spent>`): its releases
    so far, the count its budget gate reads (``num_releases`` of its state after this update), and
    its number of rows (the accountant's ``n_m``); nothing for an update that is not
    differentially private.

    **Example:** ``release_report(pvi.DPLocalAveraging(...), state, client)`` is e.g.
    ``{"releases": 3, "rows": 40}``.
    """
    if not isinstance(local_update, PrivateUpdate):
        return {}
    released = np.asarray(local_update.num_releases(state))
    return {"releases": int(released), "rows": int(np.asarray(client.size))}


# (run, node) -> the site's problem: one build per site and process
_PREPARED: dict[tuple, Prepared] = {}
# run -> a PVI whose cache lets sites of the same shapes share compiled steps
_INFERENCES: dict[int, PVI] = {}
# (id(client problem), what) -> (client problem, jitted function): the update, the ELBO term
_JITTED: dict[tuple, tuple] = {}


def _elbo_term(problem: Problem, num_particles: int) -> Callable:
    """The jitted :func:`~numpyro_pvi.server.elbo.client_elbo_term` of a site's problem, built
    once per process."""
    return _jitted_once(
        problem.client_problem,
        ("elbo term", num_particles),
        lambda: client_elbo_term(problem.client_problem, num_particles),
    )


def _jitted_once(client_problem: Any, what: Any, build: Callable[[], Callable]) -> Callable:
    """``jax.jit(build())`` for this client problem, built once per process (sites of the same
    shapes share it; the entry is checked to be for this very problem, not one whose id was
    reused)."""
    key = (id(client_problem), what)
    cached = _JITTED.get(key)
    if cached is None or cached[0] is not client_problem:
        cached = (client_problem, jax.jit(build()))
        _JITTED[key] = cached
    return cached[1]


def client_app(
    model: Callable,
    family: FactorFamily,
    local_update: LocalUpdate,
    load_data: LoadData,
    client_id: Callable[[Context], int] | None = None,
) -> ClientApp:
    """A Flower ``ClientApp`` running PVI's local update at a site that holds its own data
    (:class:`Site`).

    It answers the server's query (``"query"`` messages: client index and prior) and its training
    messages (``"train"``: cavity, q and key in, delta and free energy out).

    **Example:** ``app = client_app(model, pvi.MeanFieldGaussian(),
    pvi.GradientUpdate(optax.adam(0.05), 100), load_data=lambda context: ((x_site,), {"y":
    y_site}))``
    """
    site = Site(model, family, local_update, load_data, client_id)
    app = ClientApp()

    @app.query()
    def hello(message: Message, context: Context) -> Message:
        return site.hello(message, context)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return site.train(message, context)

    # factors="sites": the update from its own cavity, the check of its new cavity, the commit
    @app.train(UPDATE.split(".")[1])
    def update_from_q(message: Message, context: Context) -> Message:
        return site_update(site, message, context)

    @app.query(CHECK.split(".")[1])
    def check(message: Message, context: Context) -> Message:
        return site_check(site, message, context)

    @app.train(COMMIT.split(".")[1])
    def commit(message: Message, context: Context) -> Message:
        return site_commit(site, message, context)

    return app
