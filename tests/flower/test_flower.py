"""PVI on Flower's simulation engine gives the in-process run's q (same seeds, same data split).

The model has local latents (group intercepts), so a site's private state (its groups' guides, kept
in Flower's ``context.state`` and committed when the server merged the update) carries from round to
round: q after three rounds depends on it.
"""

import dataclasses
import gc
import importlib
import json
import re
import time
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import random

import numpyro_pvi as pvi

flwr = pytest.importorskip("flwr")
pytest.importorskip("ray")

# on the xdist worker of the Ray tests (`pytest -n 2 --dist loadgroup`): the simulation runs once,
# on one worker
pytestmark = pytest.mark.xdist_group("ray")

from flwr.app import ConfigRecord, Message, MessageType, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402

from numpyro_pvi.flower import (  # noqa: E402
    PVIStrategy,
    Site,
    client_app,
    run_simulation,
    tree_from_record,
    tree_to_record,
)
from numpyro_pvi.flower.wire import adopt_layout, layout_to_text  # noqa: E402

from fakes import SMALL_DP_UPDATE, LocalGrid  # noqa: E402
from models import (  # noqa: E402
    FLOWER_SITES,
    intercept_model,
    make_flower_data,
    normal_gamma_model,
)

NUM_CLIENTS, NUM_ROUNDS, DAMPING = FLOWER_SITES, 3, 0.5
# 2 of the 4 sites per round, weighted
SAMPLED = dict(clients_per_round=2, client_weights=[1.0, 2.0, 3.0, 4.0])
LOCAL = pvi.GradientUpdate(optax.adam(0.05), num_steps=30, num_particles=2)


@pytest.fixture(scope="module")
def by_value():
    """The sites run in Ray workers, which cannot import the test modules: ship their models by
    value (and run the workers at the tests' priority)."""
    import ray.cloudpickle

    modules = [importlib.import_module(name) for name in [__name__, "models", "fakes"]]
    for module in modules:
        ray.cloudpickle.register_pickle_by_value(module)
    with pytest.MonkeyPatch.context() as env:
        # the simulation's Ray starts its workers at nice 15: beside a busy process (CI's other
        # xdist worker) the sites get about 3 % of a core (the kernel's weights of nice 15 and 0: 36
        # and 1024); at 0 they share the cores evenly
        env.setenv("RAY_worker_niceness", "0")
        yield
    for module in modules:
        ray.cloudpickle.unregister_pickle_by_value(module)


# what Ray's start and stop raise
ALARMS = r"os\.fork\(\) was called|unclosed file|subprocess \d+ is still running"


@pytest.fixture(scope="module")
def engine(by_value):
    """Every strategy of this module's tests on Flower's simulation engine (:func:`_engine_jobs`,
    one simulation), and the alarms (fork, ResourceWarning) it raised: every warning is recorded,
    the others are raised again."""
    # earlier tests' garbage (e.g. the Ray session of test_ray_backend.py) warns here, not below
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jobs = _engine_jobs()
        _simulate(jobs)
        gc.collect()  # what the run left to the garbage collector warns inside the window
    alarms = [w for w in caught if re.search(ALARMS, str(w.message))]
    for w in caught:
        if w not in alarms:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return {name: job.strategies for name, job in jobs.items()}, alarms


@pytest.fixture(scope="module")
def flower_run(engine):
    """The intercept model's strategies (``run_flower``) on the engine."""
    return engine[0]["intercept"]


def test_a_flower_run_raises_no_fork_or_resource_warning(engine):
    """Before: Flower's engine started Ray beside JAX's threads (JAX's fork hook: "os.fork() was
    called ... will likely lead to a deadlock", 5 times) and left Ray's /dev/null handles and
    daemons to the garbage collector (ResourceWarnings); pyproject.toml filtered them out of the
    tests. run_simulation starts Ray first (start_ray)."""
    _, alarms = engine
    assert not alarms, [f"{w.category.__name__}: {w.message}" for w in alarms]


def run_flower():
    """``(sites' data, strategies)`` of the intercept model: 4 virtual sites, each loading only its
    own groups; a synchronous strategy, a sequential one, a sampling one and the synchronous one
    with the factors kept at the sites, run on the same sites."""
    X, y, parts = make_flower_data()
    strategies = {
        "sync": PVIStrategy(
            pvi.MeanFieldGaussian(), NUM_CLIENTS, random.PRNGKey(2), pvi.Synchronous(DAMPING)
        ),
        "seq": PVIStrategy(
            pvi.MeanFieldGaussian(), NUM_CLIENTS, random.PRNGKey(4), pvi.Sequential()
        ),
        "sampled": PVIStrategy(
            pvi.MeanFieldGaussian(),
            NUM_CLIENTS,
            random.PRNGKey(6),
            pvi.Synchronous(DAMPING, **SAMPLED),
        ),
        # "sync" with the factors kept at the sites
        "sync_at_sites": PVIStrategy(
            pvi.MeanFieldGaussian(),
            NUM_CLIENTS,
            random.PRNGKey(2),
            pvi.Synchronous(DAMPING),
            factors="sites",
        ),
    }
    return _sites_data(X, y, parts), strategies


def _in_process(*seeds, server=None):
    """The in-process vmap runs with these seeds (one PVI: the compiled round is shared)."""
    X, y, parts = make_flower_data()
    server = pvi.Synchronous(DAMPING) if server is None else server
    inference = pvi.PVI(
        intercept_model, pvi.MeanFieldGaussian(), parts, LOCAL, server, backend="vmap"
    )
    # three rounds, far from converged on purpose (PVIWarning "far")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)
        return [
            inference.run(random.PRNGKey(seed), NUM_ROUNDS, X, y=y, progress_bar=False)
            for seed in seeds
        ]


def test_flower_matches_in_process_vmap_run(flower_run):
    """Same seeds: the q (and every factor) of Flower's run equals the vmap run's to float32
    rounding.

    The sites run ``client_update`` unbatched (jitted) on their own rows, the vmap backend batched
    over the stacked clients, so XLA may round differently; measured on this machine (jax 0.10, CPU)
    the two runs are bitwise identical. A run with another seed differs by 2-6 (largest entry of
    each leaf), and so does a Flower run whose sites never commit their local state (measured: 2.1),
    so the tolerance (1e-4 relative) separates "the same computation" from a different one by four
    orders of magnitude.
    """
    state, (reference, other) = flower_run["sync"].state, _in_process(2, 3)
    for got, want, off in zip(
        jax.tree.leaves((state.q, state.factors)),
        jax.tree.leaves((reference.state.q, reference.state.factors)),
        jax.tree.leaves((other.state.q, other.state.factors)),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        # the seed matters: the test can fail
        assert np.max(np.abs(np.asarray(off) - np.asarray(want))) > 1e-2
    history = flower_run["sync"].history
    assert history.accepted.shape == (NUM_ROUNDS, NUM_CLIENTS) and np.all(history.accepted == 1)
    np.testing.assert_allclose(history.free_energy, reference.history.free_energy, rtol=1e-4)
    np.testing.assert_allclose(history.damping, reference.history.damping)


def test_flower_sequential_matches_in_process_sequential(flower_run):
    """The sequential schedule (each site against the q its predecessor left) equals
    PVI(server=Sequential()) in process, with the same tolerance as above (measured: bitwise equal
    here too)."""
    strategy, (reference,) = flower_run["seq"], _in_process(4, server=pvi.Sequential())
    for got, want in zip(
        jax.tree.leaves((strategy.state.q, strategy.state.factors)),
        jax.tree.leaves((reference.state.q, reference.state.factors)),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        strategy.history.free_energy, reference.history.free_energy, rtol=1e-4
    )


def test_flower_client_sampling_matches_in_process_sampling(flower_run):
    """K = 2 of 4 sites per round, weighted: the strategy draws the in-process run's sites from the
    same key, only they get a message (``attempts``), and q and every factor equal the vmap run's
    (tolerance as above)."""
    strategy = flower_run["sampled"]
    reference, other = _in_process(6, 7, server=pvi.Synchronous(DAMPING, **SAMPLED))
    # each round records its 2 sampled sites, as in process
    np.testing.assert_array_equal(strategy.history.clients, reference.history.clients)
    np.testing.assert_array_equal(strategy.history.attempts, reference.history.attempts)
    np.testing.assert_array_equal(strategy.history.dense(4).attempts.sum(1), 2)
    for got, want, off in zip(
        jax.tree.leaves((strategy.state.q, strategy.state.factors)),
        jax.tree.leaves((reference.state.q, reference.state.factors)),
        jax.tree.leaves((other.state.q, other.state.factors)),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        # the seed matters: the test can fail
        assert np.max(np.abs(np.asarray(off) - np.asarray(want))) > 1e-2
    # a site never drawn keeps a flat factor
    unsampled = strategy.history.dense(4).attempts.sum(0) == 0
    for leaf in jax.tree.leaves(strategy.state.factors):
        np.testing.assert_array_equal(np.asarray(leaf)[unsampled], 0.0)
    np.testing.assert_allclose(
        strategy.history.free_energy, reference.history.free_energy, rtol=1e-4
    )
    # the sites sent and received only in the rounds they were drawn: 2 updates' traffic per round
    assert all(down > 0 and up > 0 for down, up in strategy.traffic)


def test_factors_at_the_sites_on_flowers_engine_give_the_server_runs_q(flower_run):
    """Issue 27's check on Flower's simulation engine (4 sites, 3 rounds, same seeds): the
    synchronous run with ``factors="sites"`` holds no factor at the server and its q, dampings and
    ELBO equal the run with the factors at the server (``"sync"``, itself the in-process run's:
    above). Tolerance as above (measured bitwise equal over LocalGrid,
    ``tests/flower/test_site_factors.py``)."""
    at_sites, at_server = flower_run["sync_at_sites"], flower_run["sync"]
    assert at_sites.state.factors is None and at_server.state.factors is not None
    for got, want in zip(jax.tree.leaves(at_sites.state.q), jax.tree.leaves(at_server.state.q)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(at_sites.history.attempts, at_server.history.attempts)
    np.testing.assert_allclose(at_sites.history.damping, at_server.history.damping)
    np.testing.assert_allclose(at_sites.history.elbo, at_server.history.elbo, rtol=1e-5)


def test_natparams_round_trip_and_shape_check():
    q = pvi.FullRankGaussian().zeros(3)
    q = jax.tree.map(lambda x: x + jnp.arange(x.size, dtype=x.dtype).reshape(x.shape), q)
    back = tree_from_record(tree_to_record(q), pvi.FullRankGaussian().zeros(3))
    assert type(back) is type(q)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(back)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="same model and family"):
        tree_from_record(tree_to_record(q), pvi.FullRankGaussian().zeros(4))


def test_strategy_takes_every_server_and_refuses_bad_input():
    """Before: ``Synchronous()`` (HeavyBall, the library's default), ``AdaptiveDamping``,
    ``Asynchronous`` and ``Continual`` were refused; now every server runs (see the tests below)."""
    for server in [
        None,
        pvi.Synchronous(),
        pvi.Synchronous(pvi.AdaptiveDamping()),
        pvi.Asynchronous(0.5),
        pvi.Continual(),
    ]:
        PVIStrategy(pvi.MeanFieldGaussian(), 4, random.PRNGKey(0), server)
    with pytest.raises(TypeError, match="pvi server"):
        PVIStrategy(pvi.MeanFieldGaussian(), 4, random.PRNGKey(0), 0.5)
    with pytest.raises(TypeError, match="hyper_optimizer"):
        PVIStrategy(pvi.MeanFieldGaussian(), 4, random.PRNGKey(0), hyper_optimizer="adam")
    with pytest.raises(ValueError, match="num_clients"):
        PVIStrategy(pvi.MeanFieldGaussian(), 0, random.PRNGKey(0), pvi.Synchronous(0.5))
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="num_elbo_particles"):
            PVIStrategy(pvi.MeanFieldGaussian(), 4, random.PRNGKey(0), num_elbo_particles=bad)
    with pytest.raises(ValueError, match="only 4 clients"):
        PVIStrategy(
            pvi.MeanFieldGaussian(), 4, random.PRNGKey(0), pvi.Synchronous(0.5, clients_per_round=5)
        )
    with pytest.raises(ValueError, match="3 client_weights"):
        PVIStrategy(
            pvi.MeanFieldGaussian(),
            4,
            random.PRNGKey(0),
            pvi.Synchronous(0.5, clients_per_round=2, client_weights=[1, 1, 1]),
        )


@pytest.fixture
def flower_task(monkeypatch):
    """Flower's messages need a run and a task: set (and restored) for a test without Flower's
    engine."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


def test_flower_round_merges_good_deltas_and_rejects_the_rest(flower_task):
    """Without Ray: a FlowerRound over hand-made replies. A finite delta is merged at the damping
    by the library's merge; a NaN delta, a site's error and a silent site are rejected (NON_FINITE,
    RAISED, TIMEOUT) and leave their factors; the next message tells each site whether its update
    was merged (it then commits its local state)."""
    from flwr.app import ConfigRecord, Error, Message, RecordDict

    from numpyro_pvi.flower.round import FlowerRound, FlowerRunner, reply_result, result_like
    from numpyro_pvi.local_updates.base import ClientResult
    from numpyro_pvi.server.steps import Steps, make_apply

    family, rho, server = pvi.MeanFieldGaussian(), 0.5, pvi.Synchronous(0.5)
    prior = family.from_mean_precision(jnp.zeros(2), jnp.ones(2))
    factors = jax.tree.map(lambda x: jnp.zeros((4,) + x.shape), prior)
    state = pvi.PVIState(
        prior, factors, family.zeros(2), (), None, random.PRNGKey(0), (), (), (), ()
    )
    state = state._replace(damping=server.damping.init(prior, factors, family))
    good = family.from_mean_precision(jnp.array([1.0, -1.0]), jnp.full(2, 3.0)) - prior
    nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), good)

    class HandMade:
        def train(self, message, context):
            m = context.node_config["partition-id"]
            if m == 2:
                return Message(Error(code=0, reason="site failed"), reply_to=message)
            if m == 3:
                return None  # silent
            result = reply_result(ClientResult([good, nan][m], jnp.asarray(1.0), ()))
            return Message(RecordDict({"result": tree_to_record(result)}), reply_to=message)

    grid = LocalGrid(HandMade(), 4)
    runner = FlowerRunner(
        grid, {m: 100 + m for m in range(4)}, result_like(prior, ()), 0.2, ConfigRecord()
    )
    steps = Steps(None, jax.jit(make_apply(family, server, None)), runner, None, None, None, None)
    round = FlowerRound(steps, family, random.PRNGKey(1), 4, 4)
    state = server.run_round(state, round, 4)
    np.testing.assert_array_equal(round.log["accepted"], [1, 0, 0, 0])
    assert [pvi.state.Rejection(int(r)).name for r in round.log["rejection"]] == [
        "NONE",
        "NON_FINITE",
        "RAISED",
        "TIMEOUT",
    ]
    np.testing.assert_allclose(round.log["damping"], [rho, 0, 0, 0])
    for got, want in zip(jax.tree.leaves(state.q), jax.tree.leaves(prior + rho * good)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(state.factors), jax.tree.leaves(good)):
        np.testing.assert_allclose(got[0], rho * want, rtol=1e-6)
        np.testing.assert_array_equal(got[1:], 0.0)
    assert runner.down > 0 and runner.up > 0
    # the next round tells client 0 its update was merged, the others not
    grid.pushed.clear()
    server.run_round(state, FlowerRound(steps, family, random.PRNGKey(2), 4, 4), 4)
    sent = {
        int(m.content.config_records["pvi"]["client"]): int(
            m.content.config_records["pvi"]["accepted"]
        )
        for m in grid.pushed
    }
    assert sent == {0: 1, 1: 0, 2: 0, 3: 0}


def site_families():
    return pvi.SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})


def test_a_sites_layout_lays_out_a_copy_of_the_servers_family():
    """The layout a site sends (``layout_to_text``) lays out a copy of the server's family:
    ``adopt_layout`` returns it and leaves the server's own as it was (on main it laid the server's
    family out in place and returned None); a Dirichlet records its site's shape on the copy, a
    Gaussian needs no layout (itself back), and a layout of another grouping is refused by name."""
    X = random.normal(random.PRNGKey(4), (6, 2))
    problem = pvi.PVI(
        normal_gamma_model, site_families(), [np.arange(6)], LOCAL, pvi.Synchronous(DAMPING)
    ).build(X, y=X[:, 0])
    text = layout_to_text(problem.family, problem.sites)
    server = site_families()
    laid_out = adopt_layout(server, text)
    assert laid_out.layout() == ((("w",), 2), (("tau",), 1))
    with pytest.raises(RuntimeError, match="build the problem first"):
        server.layout()  # the server's own family is not laid out
    dirichlet = pvi.Dirichlet()
    got = adopt_layout(dirichlet, json.dumps({"shapes": {"probs": [2, 4]}, "layout": None}))
    assert got.shape == (2, 4) and dirichlet.shape is None
    gaussian = pvi.FullRankGaussian()
    assert adopt_layout(gaussian, text) is gaussian
    other = json.dumps({"shapes": {"w": [2], "tau": []}, "layout": [[["w", "tau"], 3]]})
    with pytest.raises(ValueError, match="same SiteFamilies"):
        adopt_layout(site_families(), other)


def _site_families_data():
    """``(X, y, parts)``: 24 rows of a linear model with noise sd 0.7, split iid over 2 sites."""
    X = random.normal(random.PRNGKey(4), (24, 2))
    y = X @ jnp.array([1.0, -0.5]) + 0.7 * random.normal(random.PRNGKey(5), (24,))
    return X, y, pvi.split_iid(random.PRNGKey(1), 24, 2)


# any update shows the layout at work; Adam's compiles in a third of CVI's time on this family
# (measured: 30 s against 88 s for the first in-process round, on this machine under load)
FAMILIES_UPDATE = pvi.GradientUpdate(optax.adam(0.05), num_steps=10, num_particles=2)


def _site_families_job():
    X, y, parts = _site_families_data()
    strategy = PVIStrategy(site_families(), 2, random.PRNGKey(2), pvi.Sequential())
    data = _sites_data(X, y, parts)
    return _Job(normal_gamma_model, site_families(), FAMILIES_UPDATE, data, {"seq": strategy}, 2)


def test_flower_site_families_match_in_process(engine):
    """SiteFamilies over Flower: the server's copy of the family is laid out from the sites' report
    (it has no data), q's leaves (one eta2 per block) equal the in-process vmap run's (same
    tolerance as above), and a site whose layout differs is refused by name.

    The data, update, server and seed are tests/backends/test_ray_backend.py's SiteFamilies
    test's: the sites' program (the Ray actors' HLO) and the in-process run are compiled once per
    test run (JAX's persistent cache)."""
    X, y, parts = _site_families_data()
    strategy = engine[0]["site_families"]["seq"]
    inference = pvi.PVI(
        normal_gamma_model, site_families(), parts, FAMILIES_UPDATE, pvi.Sequential()
    )
    reference = inference.run(random.PRNGKey(2), 2, X, y=y, progress_bar=False)
    assert len(strategy.state.q.eta2) == 2
    for got, want in zip(
        jax.tree.leaves((strategy.state.q, strategy.state.factors)),
        jax.tree.leaves((reference.state.q, reference.state.factors)),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(strategy.history.rejection, reference.history.rejection)
    with pytest.raises(ValueError, match="same SiteFamilies"):
        # w and tau in one block
        site_families().with_layout([[["w", "tau"], 3]], {"w": (2,), "tau": ()})


class _Job(NamedTuple):
    """One set of sites on the engine: their model, family, local update and data (an ``(args,
    kwargs)`` a site), and the strategies run on them one after the other, each for
    ``num_rounds`` rounds."""

    model: object
    family: object
    update: object
    data: list
    strategies: dict
    num_rounds: int


def _engine_jobs():
    """Every engine test's sites and strategies, by name (each built beside its test)."""
    data, strategies = run_flower()
    return {
        "intercept": _Job(
            intercept_model, pvi.MeanFieldGaussian(), LOCAL, data, strategies, NUM_ROUNDS
        ),
        "site_families": _site_families_job(),
        "servers": _servers_job(),
        "asynchronous": _asynchronous_job(),
        "dp": _dp_job(),
    }


# a message's record naming its set of sites; the query that asks a node its partition id
SITE_SET, WHOAMI = "test-site-set", "whoami"


def _simulate(jobs):
    """Flower's simulation engine, once for several sets of sites (``{name: _Job}``): as many
    virtual sites as the largest set has; each set runs on the sites of partition ids ``0 ..
    len(job.data) - 1``, answered by its own :func:`client_app` (:class:`_SiteSets`), and the
    sets' strategies run one after the other (the PVIWarnings of short runs silenced).

    One simulation for the module, not one per test: each starts Ray and an actor that imports
    JAX and the library at its first message (measured: a 16-round run and a 1-round run of the
    asynchronous test's sites cost the same 11 s of CPU, 4.7 s of it an empty simulation's)."""
    num_nodes = max(len(job.data) for job in jobs.values())
    app = ServerApp()

    @app.main()
    def main(grid, context):
        partitions = _partitions(grid, num_nodes)
        for name, job in jobs.items():
            nodes = {node for node, m in partitions.items() if m < len(job.data)}
            for strategy in job.strategies.values():
                strategy.start(
                    _SiteSetGrid(grid, name, nodes), num_rounds=job.num_rounds, timeout=600
                )

    sites = _SiteSets(
        {
            name: client_app(job.model, job.family, job.update, _loader(job.data))
            for name, job in jobs.items()
        }
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)
        run_simulation(
            app,
            sites,
            num_supernodes=num_nodes,
            backend_config={"init_args": {"num_cpus": 1}, "client_resources": {"num_cpus": 1}},
        )


def _loader(data):
    def load_data(context):
        return data[int(context.node_config["partition-id"])]

    return load_data


def _partitions(grid, num_nodes):
    """``{node id: partition id}`` of the engine's sites, asked of each (a ``WHOAMI`` query)."""
    deadline = time.monotonic() + 600
    while len(nodes := list(grid.get_node_ids())) < num_nodes:
        assert time.monotonic() < deadline, f"{len(nodes)} of {num_nodes} sites connected"
        time.sleep(0.1)
    asks = [
        Message(
            RecordDict({SITE_SET: ConfigRecord({"name": WHOAMI})}),
            dst_node_id=node,
            message_type=MessageType.QUERY,
        )
        for node in nodes
    ]
    replies = list(grid.send_and_receive(asks, timeout=600))
    assert len(replies) == num_nodes and not any(r.has_error() for r in replies)
    return {
        r.metadata.src_node_id: int(r.content.config_records[SITE_SET]["partition-id"])
        for r in replies
    }


class _SiteSetGrid:
    """Flower's grid as one set of sites sees it: only the nodes ``nodes``, and every message sent
    names the set (a ``SITE_SET`` record, which the sites' apps do not read). Everything else is
    the engine's grid."""

    def __init__(self, grid, name, nodes):
        self.grid, self.name, self.nodes = grid, name, nodes

    def get_node_ids(self):
        return [node for node in self.grid.get_node_ids() if node in self.nodes]

    def _named(self, messages):
        messages = list(messages)
        for message in messages:
            message.content[SITE_SET] = ConfigRecord({"name": self.name})
        return messages

    def push_messages(self, messages):
        return self.grid.push_messages(self._named(messages))

    def send_and_receive(self, messages, timeout=None):
        return self.grid.send_and_receive(self._named(messages), timeout=timeout)

    def __getattr__(self, name):
        return getattr(self.grid, name)


class _SiteSets(ClientApp):
    """The sites of every set in one ``ClientApp``: a message goes to the :func:`client_app` of the
    set it names, with a run id of the set's own (a site caches its problem and compiled update
    per run and node; the context's state, the site's, is the engine's).

    The engine sends the ``ClientApp`` with every message: once Ray runs, the apps (their models
    and data, pickled by value) go to Ray's object store once and a message carries their
    reference (measured: the driver pickled for 4.2 s over the module's 565 messages, 0.16 s with
    the reference)."""

    def __init__(self, apps, stored=None):
        super().__init__()
        self.apps, self.stored = apps, stored

    def __reduce__(self):
        import ray

        if not ray.is_initialized():
            return _SiteSets, (self.apps,)
        if self.stored is None:
            self.stored = ray.put(self.apps)
        return _SiteSets, (None, self.stored)

    def __call__(self, message, context):
        if self.apps is None:
            import ray

            self.apps = ray.get(self.stored)
        name = str(message.content.config_records[SITE_SET]["name"])
        if name == WHOAMI:
            partition = ConfigRecord({"partition-id": int(context.node_config["partition-id"])})
            return Message(RecordDict({SITE_SET: partition}), reply_to=message)
        run_id = context.run_id + list(self.apps).index(name)
        return self.apps[name](message, dataclasses.replace(context, run_id=run_id))


def _stand_in(model):
    """``PVIStrategy``'s ``model=`` arguments for a model of the three linear sites' columns: one
    row of zeros stands in for a site's data (the prior needs none)."""
    return dict(
        model=model,
        model_args=(np.zeros((1, 2), np.float32),),
        model_kwargs={"y": np.zeros(1, np.float32)},
    )


SERVERS_ON_THE_ENGINE = {
    "heavy_ball": pvi.Synchronous(),  # the default damping
    "adaptive": pvi.Synchronous(pvi.AdaptiveDamping()),
    "sequential": pvi.Sequential(),
    "continual": pvi.Continual(),
}


def _servers_job():
    from models import halfnormal_offset_model

    data, _ = _three_sites(halfnormal_offset_model, SMALL_UPDATE)
    stand_in = _stand_in(halfnormal_offset_model)
    strategies = {
        name: PVIStrategy(pvi.MeanFieldGaussian(), 3, random.PRNGKey(2), server, **stand_in)
        for name, server in SERVERS_ON_THE_ENGINE.items()
    }
    return _Job(halfnormal_offset_model, pvi.MeanFieldGaussian(), SMALL_UPDATE, data, strategies, 2)


def test_servers_a_halfnormal_prior_and_a_hyperparameter_on_flowers_engine(engine):
    """On Flower's simulation engine (Ray actors, Flower's own messaging), not only LocalGrid: the
    default ``Synchronous()`` (HeavyBall), ``Synchronous(AdaptiveDamping())``, ``Sequential()`` and
    ``Continual()`` run a model with a non-Gaussian prior (``sigma ~ HalfNormal(1)``: the strategy
    refits t_0 from the model) and a ``numpyro.param`` hyperparameter (stepped from the sites'
    gradients), 2 rounds each on the same 3 sites, and give the in-process run's q, factors, t_0
    and hyperparameter (same seeds); in the synchronous ones the round's ELBO too.

    Tolerances are the LocalGrid tests' (1e-4 relative for states, 1e-5 for the ELBO): the sites
    compute the same programs on the same draws. The hyperparameter and every leaf of t_0 moved
    from their start (the server's steps ran), t_0 is not zero, the synchronous rounds' ELBO is
    finite (before: NaN over Flower), and another seed moves the default server's q by far more
    than the tolerance."""
    from models import halfnormal_offset_model

    data, _ = _three_sites(halfnormal_offset_model, SMALL_UPDATE)
    strategies = engine[0]["servers"]
    for name, server in SERVERS_ON_THE_ENGINE.items():
        inference = pvi.PVI(
            halfnormal_offset_model,
            pvi.MeanFieldGaussian(),
            pvi.ClientData(data),
            SMALL_UPDATE,
            server,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pvi.PVIWarning)
            run = inference.run(random.PRNGKey(2), 2, progress_bar=False)
        state, reference = strategies[name].state, run.state
        factors = jax.tree.map(lambda f: f[:3], reference.factors)
        for got, want in zip(
            jax.tree.leaves((state.q, state.factors, state.prior_factor, state.hyper)),
            jax.tree.leaves((reference.q, factors, reference.prior_factor, reference.hyper)),
        ):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
        assert abs(float(state.hyper["offset"])) > 1e-3, name  # from 0
        start = inference.init(random.PRNGKey(2)).prior_factor
        assert min(np.max(np.abs(a - b)) for a, b in zip(start, state.prior_factor)) > 1e-3, name
        assert np.all(np.abs(state.prior_factor.eta2[-1]) > 1e-3), name
        if isinstance(server, pvi.Synchronous):
            # the round's ELBO from the sites' reports (their terms under the q they were sent and
            # the server's prior terms) is the in-process run's, the same draws
            assert np.all(np.isfinite(strategies[name].history.elbo)), name
            np.testing.assert_allclose(
                strategies[name].history.elbo, run.history.elbo, rtol=1e-5, err_msg=name
            )
        if name == "heavy_ball":  # the seed matters: the test can fail
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", pvi.PVIWarning)
                other = inference.run(random.PRNGKey(3), 2, progress_bar=False).state
            pairs = zip(jax.tree.leaves(reference.q), jax.tree.leaves(other.q))
            assert max(float(np.max(np.abs(a - b))) for a, b in pairs) > 1e-2, name


def _sites_data(X, y, parts):
    return [((np.asarray(X[p]),), {"y": np.asarray(y[p])}) for p in parts]


# 40 rows of the linear data over 3 sites: small, so that each case compiles in seconds
SMALL_UPDATE = pvi.GradientUpdate(optax.adam(0.05), num_steps=10, num_particles=2)


def test_every_server_over_flower_messages_gives_the_in_process_q(flower_task):
    """Without Ray (LocalGrid: the sites answer Flower messages in this process): ``Continual()``
    (before: refused) gives the in-process run's q and factors, same seeds, when the third site
    connects after round 1: it joins as ``PVI.add_client`` adds a client.

    Measured (this machine, jax CPU): bitwise equal; the tolerance is the other Flower tests' (1e-4
    relative). The default ``Synchronous()`` (HeavyBall damping; before: refused) and a
    ``numpyro.param`` hyperparameter stepped from the sites' gradients (before: refused), this
    test's other cases once, run on Flower's engine in
    ``test_servers_a_halfnormal_prior_and_a_hyperparameter_on_flowers_engine``, with every server
    and the checks these cases made (the in-process q, factors, hyperparameter and ELBO, a finite
    ELBO, another seed's q far off).
    """
    from models import linear_model, make_linear_data

    X, y = (a[:40] for a in make_linear_data())
    parts = pvi.split_iid(random.PRNGKey(1), 40, 3)
    data = _sites_data(X, y, parts)
    server = pvi.Continual()
    site = Site(
        linear_model,
        pvi.MeanFieldGaussian(),
        SMALL_UPDATE,
        lambda c: data[c.node_config["partition-id"]],
    )
    grid = LocalGrid(site, 3, hidden={102}, reveal_after=2)
    strategy = PVIStrategy(pvi.MeanFieldGaussian(), 2, random.PRNGKey(2), server)
    inference = pvi.PVI(
        linear_model, pvi.MeanFieldGaussian(), pvi.ClientData(data[:2]), SMALL_UPDATE, server
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)  # 2 rounds: far from converged
        strategy.start(grid, num_rounds=2, timeout=60)
        reference = inference.run(random.PRNGKey(2), 1, progress_bar=False).state
        reference, problem = inference.add_client(
            reference, inference.build(), *data[2][0], **data[2][1]
        )
        reference = inference.update(reference, problem)[0]
    # in process client slots grow geometrically (4 for 3 clients): the 3 real ones compare
    factors = jax.tree.map(lambda f: f[:3], reference.factors)
    pairs = zip(
        jax.tree.leaves((strategy.state.q, strategy.state.factors)),
        jax.tree.leaves((reference.q, factors)),
    )
    for got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # Continual's sites get different q: no sum of terms, and no data at the server (NaN)
    assert np.all(np.isnan(strategy.history.elbo))
    # round 1 visits the first two sites, round 2 only the one that joined
    np.testing.assert_array_equal(strategy.history.attempts, [[1, 1, 0], [0, 0, 1]])


def _three_sites(model, update):
    """``models.make_three_linear_sites``' data and their Flower sites."""
    from models import make_three_linear_sites

    data = make_three_linear_sites()
    site = Site(
        model, pvi.MeanFieldGaussian(), update, lambda c: data[c.node_config["partition-id"]]
    )
    return data, site


def test_a_halfnormal_prior_over_flower_messages_needs_the_model(flower_task):
    """A non-Gaussian prior (``sigma ~ HalfNormal(1)``, a Gaussian q) over Flower: the strategy
    needs the model (on a stand-in for a site's data) to run the in-process prior step of t_0
    before each round. Without it, with another model, or with bad model arguments the run is
    refused by name, before any round.

    That such a run gives the in-process run's q, factors, t_0 and ELBO (before: refused at the
    start of the run) is checked on Flower's engine, for every server, with
    ``halfnormal_offset_model`` (this test's ``halfnormal_scale_model`` with a hyperparameter):
    ``test_servers_a_halfnormal_prior_and_a_hyperparameter_on_flowers_engine``.
    """
    from models import halfnormal_scale_model, linear_model

    _, site = _three_sites(halfnormal_scale_model, SMALL_UPDATE)
    stand_in = _stand_in(halfnormal_scale_model)
    grid = LocalGrid(site, 3)
    # without the model the server cannot refit t_0: refused by name, before any round
    with pytest.raises(ValueError, match=r"\[sigma\].*model=model"):
        PVIStrategy(pvi.MeanFieldGaussian(), 3, random.PRNGKey(2)).start(
            grid, num_rounds=1, timeout=60
        )
    assert not [m for m in grid.pushed if m.metadata.message_type == "train"]
    # a model that is not the sites' (no sigma) is refused by name
    with pytest.raises(ValueError, match="other global sites"):
        PVIStrategy(
            pvi.MeanFieldGaussian(), 3, random.PRNGKey(2), **{**stand_in, "model": linear_model}
        ).start(grid, num_rounds=1, timeout=60)
    with pytest.raises(ValueError, match="pass model= too"):
        PVIStrategy(pvi.MeanFieldGaussian(), 3, random.PRNGKey(2), model_args=(1.0,))
    with pytest.raises(TypeError, match="model_args must be a tuple"):
        PVIStrategy(pvi.MeanFieldGaussian(), 3, random.PRNGKey(2), **{**stand_in, "model_args": 1})


@pytest.fixture(scope="module")
def dp_run():
    """The in-process DP run on the three linear sites (``SMALL_DP_UPDATE``, the default
    ``Synchronous()``, 2 rounds, seed 2): the reference of both DP tests below."""
    from models import linear_model

    data, _ = _three_sites(linear_model, SMALL_DP_UPDATE)
    inference = pvi.PVI(
        linear_model, pvi.MeanFieldGaussian(), pvi.ClientData(data), SMALL_DP_UPDATE
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)  # 2 rounds: far from converged
        return inference.run(random.PRNGKey(2), 2, progress_bar=False)


def _assert_the_in_process_dp_run(strategy, run):
    """``strategy``'s q and factors are the in-process DP run's (``dp_run``: 2 rounds, same seeds;
    the LocalGrid tests' tolerance), each site reported 2 releases of 10 rows, and
    ``strategy.privacy_spent`` gives ``result.privacy_spent``'s epsilons, positive, with either
    client sampling rule (1e-9: the same counts into the same accountant)."""
    factors = jax.tree.map(lambda f: f[:3], run.state.factors)
    for got, want in zip(
        jax.tree.leaves((strategy.state.q, strategy.state.factors)),
        jax.tree.leaves((run.state.q, factors)),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert strategy.releases == {m: (2, 10) for m in range(3)}
    for rule in ("known", "secret"):
        spent = strategy.privacy_spent(SMALL_DP_UPDATE, 1e-5, client_sampling=rule)
        np.testing.assert_allclose(spent, run.privacy_spent(1e-5, client_sampling=rule), rtol=1e-9)
        assert np.all(spent > 0)


def test_dp_updates_over_flower_messages_give_the_in_process_q_and_epsilon(flower_task, dp_run):
    """DP-SGD at the sites over Flower: q and the factors are the in-process run's (same seeds, to
    float rounding as in the tests above), and ``strategy.privacy_spent`` -- from the release and
    row counts the sites report and the strategy's history (before: no way to account a Flower run)
    -- gives the in-process ``result.privacy_spent``'s epsilons, with either client sampling rule.

    Measured (this machine): q equal to 1.2e-7; the epsilons equal to the last digit (the same
    counts into the same accountant), 17.27 for each site after 2 releases of 10 steps.
    """
    from models import linear_model

    _, site = _three_sites(linear_model, SMALL_DP_UPDATE)
    strategy = PVIStrategy(pvi.MeanFieldGaussian(), 3, random.PRNGKey(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)
        strategy.start(LocalGrid(site, 3), num_rounds=2, timeout=60)
    _assert_the_in_process_dp_run(strategy, dp_run)
    with pytest.raises(TypeError, match="not differentially private"):
        strategy.privacy_spent(SMALL_UPDATE, 1e-5)


def test_a_dp_site_counts_the_releases_the_server_rejected(flower_task):
    """A DP site whose updates the server does not merge still counts each as a release, as the
    in-process server keeps ``CountsRejectedUpdates.rejected_state`` (before: the Flower site kept
    its old state, so its budget gate forgot every rejected release and could overspend). With a
    budget of two releases, the third update is refused (``Rejection.BUDGET``) and counted no more.
    """
    from flwr.app import ConfigRecord

    from numpyro_pvi.flower.round import FlowerRunner, result_like
    from numpyro_pvi.privacy.accounting import epsilon

    from models import linear_model

    family = pvi.MeanFieldGaussian()
    two, three = (epsilon(SMALL_DP_UPDATE.dp_event(10, n), 1e-5) for n in (2, 3))
    update = pvi.DPGradientUpdate(
        optax.adam(0.05),
        num_steps=10,
        batch_size=5,
        clip_norm=1.0,
        noise_multiplier=1.0,
        privacy_budget=((two + three) / 2, 1e-5),
    )
    _, site = _three_sites(linear_model, update)
    q = family.from_mean_precision(jnp.zeros(2), jnp.ones(2))
    runner = FlowerRunner(LocalGrid(site, 1), {0: 100}, result_like(q, ()), 60, ConfigRecord())
    failures = []
    for n in range(3):
        runner.accepted[0] = False  # the server merged none of them
        handle = runner.submit(0, random.PRNGKey(n), q, q, (), ())
        failures.append(int(runner.result(0, handle, q, ()).failure))
        assert runner.releases[0] == (min(n + 1, 2), 10)
    assert failures == [0, 0, int(pvi.state.Rejection.BUDGET)]


def _assert_the_exact_linear_posterior(q, X, y):
    """Full-rank ``q`` within 0.01 posterior sds of the exact posterior's mean and 0.02 (relative to
    the sds) of its covariance."""
    from models import exact_linear_posterior

    mean, cov = exact_linear_posterior(X, y)
    q = pvi.FullRankGaussian().to_dist(q)
    sd = np.sqrt(np.diag(cov))
    assert np.max(np.abs(np.asarray(q.mean) - mean) / sd) < 0.01
    assert np.max(np.abs(np.asarray(q.covariance_matrix) - cov) / np.outer(sd, sd)) < 0.02


def test_asynchronous_over_flower_messages_reaches_the_exact_posterior(flower_task):
    """``Asynchronous`` over Flower (before: refused) is truly asynchronous: a site gets its next
    cavity as soon as its reply is merged (push/pull), so its updates are computed against a ``q``
    up to two merges stale and the arrival order is not the in-process clock's. On the conjugate
    linear model each site's exact (CVI, step 1) factor is a fixed point, so q reaches the exact
    posterior whatever the order.

    Measured (8 rounds = 24 merges, seeds 0-2, this machine): worst mean error 3.7e-4 posterior sds,
    worst covariance error 3.9e-3 (relative to the sds), the same for every seed (the update is
    deterministic on a Gaussian likelihood); after 3 rounds the mean is still 0.013 sds off and
    the covariance 0.14. The tolerances (0.01, 0.02) sit between the two.
    """
    from models import linear_model

    X, y, data = _asynchronous_sites()
    site = Site(
        linear_model,
        pvi.FullRankGaussian(),
        EXACT_UPDATE,
        lambda c: data[c.node_config["partition-id"]],
    )
    strategy = PVIStrategy(pvi.FullRankGaussian(), 3, random.PRNGKey(0), pvi.Asynchronous(0.5))
    grid = LocalGrid(site, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)
        strategy.start(grid, num_rounds=8, timeout=60)
    # a round is M merges; each site was sent its next cavity before the others' replies merged
    np.testing.assert_array_equal(strategy.history.accepted.sum(1), 3)
    assert len(grid.pushed) > 24
    _assert_the_exact_linear_posterior(strategy.state.q, X, y)


def _asynchronous_sites():
    """``(X, y, data)``: 40 rows of the linear data split iid over 3 sites."""
    from models import make_linear_data

    X, y = (a[:40] for a in make_linear_data())
    return X, y, _sites_data(X, y, pvi.split_iid(random.PRNGKey(1), 40, 3))


# the exact (CVI, step 1) update of the conjugate linear model
EXACT_UPDATE = pvi.NaturalGradientUpdate(step_size=1.0, num_particles=32)


def _asynchronous_job():
    from models import linear_model

    _, _, data = _asynchronous_sites()
    strategy = PVIStrategy(pvi.FullRankGaussian(), 3, random.PRNGKey(0), pvi.Asynchronous(0.5))
    return _Job(linear_model, pvi.FullRankGaussian(), EXACT_UPDATE, data, {"async": strategy}, 16)


def test_asynchronous_on_flowers_engine_reaches_the_exact_posterior(engine):
    """``Asynchronous(0.5)`` on Flower's simulation engine (Ray actors answering Flower's
    push/pull messages): the arrival order is the engine's, so q is compared with the exact
    posterior of the conjugate linear model, a fixed point of every site's exact (CVI, step 1)
    factor whatever the order; every round merges each site's reply once.

    Tolerances are the LocalGrid test's above (0.01 posterior sds on the mean, 0.02 on the
    covariance; there 8 rounds gave 3.7e-4 and 3.9e-3 for every seed, 3 rounds 0.013 and 0.14).
    The engine's order can be slower to settle: in one CI run 8 rounds ended 0.0118 sds off, with
    q's change still halving each round (0.0088, 0.0032 in rounds 7 and 8), so this runs 16 rounds,
    eight more halvings.
    """
    X, y, _ = _asynchronous_sites()
    strategy = engine[0]["asynchronous"]["async"]
    np.testing.assert_array_equal(strategy.history.accepted.sum(1), 3)
    _assert_the_exact_linear_posterior(strategy.state.q, X, y)


def _dp_job():
    from models import linear_model

    data, _ = _three_sites(linear_model, SMALL_DP_UPDATE)
    strategy = PVIStrategy(pvi.MeanFieldGaussian(), 3, random.PRNGKey(2))
    return _Job(linear_model, pvi.MeanFieldGaussian(), SMALL_DP_UPDATE, data, {"sync": strategy}, 2)


def test_dp_updates_on_flowers_engine_give_the_in_process_q_and_epsilon(engine, dp_run):
    """``DPGradientUpdate`` sites on Flower's simulation engine, the default ``Synchronous()``:
    the in-process run's q, factors and epsilons (``_assert_the_in_process_dp_run``)."""
    _assert_the_in_process_dp_run(engine[0]["dp"]["sync"], dp_run)


@pytest.mark.parametrize("case", ["converges", "far", "stalled"])
def test_tol_and_the_monitors_warnings_over_flower_are_the_in_process_runs(flower_task, case):
    """Convergence (``tol``) and the monitor's warnings over Flower messages (LocalGrid) are the
    in-process run's, same seeds: with ``tol`` the conjugate linear model's exact updates (CVI,
    step 1, ``Synchronous(1.0)``) settle and both runs stop after the same round, converged, for
    the same reason; two rounds of Adam without ``tol`` end far from converged; and when every
    site's delta is NaN (``fakes.PoisonedUpdate`` on 3 sites of 13 rows) every update is rejected
    as non-finite for 4 rounds, so q never moves and the run is stalled, not converged. Each time
    both runs give the same warnings (``PVIWarning``) and ``stopped_because``."""
    from fakes import PoisonedUpdate
    from models import linear_model, make_linear_data

    rows = 39 if case == "stalled" else 40
    X, y = (a[:rows] for a in make_linear_data())
    data = _sites_data(X, y, pvi.split_iid(random.PRNGKey(1), rows, 3))
    if case == "stalled":
        family, server = pvi.FullRankGaussian(), pvi.Synchronous(0.5)
        update, num_rounds, tol = PoisonedUpdate(bad_size=13), 4, None
    elif case == "converges":
        family, server = pvi.FullRankGaussian(), pvi.Synchronous(1.0)
        update, num_rounds, tol = EXACT_UPDATE, 10, 0.05
    else:
        family, server = pvi.MeanFieldGaussian(), pvi.Synchronous(0.5)
        update, num_rounds, tol = SMALL_UPDATE, 2, None
    site = Site(linear_model, family, update, lambda c: data[c.node_config["partition-id"]])
    strategy = PVIStrategy(family, 3, random.PRNGKey(2), server)
    inference = pvi.PVI(linear_model, family, pvi.ClientData(data), update, server)
    with warnings.catch_warnings(record=True) as over_flower:
        warnings.simplefilter("always", pvi.PVIWarning)
        strategy.start(LocalGrid(site, 3), num_rounds=num_rounds, timeout=60, tol=tol)
    with warnings.catch_warnings(record=True) as in_process:
        warnings.simplefilter("always", pvi.PVIWarning)
        run = inference.run(random.PRNGKey(2), num_rounds, tol=tol, progress_bar=False)
    messages = [
        sorted({str(w.message) for w in caught if issubclass(w.category, pvi.PVIWarning)})
        for caught in (over_flower, in_process)
    ]
    assert messages[0] == messages[1]
    assert (strategy.converged, strategy.stopped_because) == (run.converged, run.stopped_because)
    assert len(strategy.history.elbo) == len(run.history.elbo)
    if case == "converges":
        assert strategy.converged and len(run.history.elbo) < num_rounds
        assert messages[0] == []
    elif case == "stalled":
        assert not strategy.converged
        np.testing.assert_array_equal(strategy.history.rejection, pvi.state.Rejection.NON_FINITE)
        assert any("stalled" in m for m in messages[0])
    else:
        assert not strategy.converged and strategy.stopped_because == "not_settled"
        assert any("far from converged" in m for m in messages[0])
