"""Factors kept at the sites (``PVIStrategy(..., factors="sites")``): the server holds ``q`` only,
and ``q`` equals the run with the factors at the server.

Without Ray: :class:`~fakes.LocalGrid` passes real Flower messages to the sites in this process.
"""

import warnings
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import random

import numpyro_pvi as pvi

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402

from numpyro_pvi.flower import PVIStrategy, Site, tree_to_record  # noqa: E402
from numpyro_pvi.flower.round import FlowerRound, FlowerRunner, reply_result, result_like  # noqa: E402
from numpyro_pvi.flower.site_factors import (  # noqa: E402
    CHECK,
    SiteFactorsRound,
    SiteFactorsRunner,
    load_factor,
)
from numpyro_pvi.local_updates.base import ClientResult  # noqa: E402
from numpyro_pvi.server.steps import Steps, make_apply  # noqa: E402

from fakes import LOCAL_RUNS, SMALL_DP_UPDATE, LocalGrid  # noqa: E402
from models import (  # noqa: E402
    FLOWER_SITES,
    linear_model,
    make_linear_data,
    make_three_linear_sites,
)

UPDATE = pvi.GradientUpdate(optax.adam(0.05), num_steps=10, num_particles=2)


@pytest.fixture
def flower_task(monkeypatch):
    """Flower's messages need a run and a task: set (and restored) for a test without Flower's
    engine."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


@pytest.fixture(scope="module")
def linear_sites():
    """``(site, run_id)``: a :class:`Site` of 40 rows of the linear model over 4 sites, and the
    Flower run id its grids share (the sites cache their problem and compiled update per run and
    node: every run of this module compiles them once)."""
    X, y = (a[:40] for a in make_linear_data())
    parts = pvi.split_iid(random.PRNGKey(1), 40, FLOWER_SITES)
    data = [((np.asarray(X[p]),), {"y": np.asarray(y[p])}) for p in parts]
    site = Site(
        linear_model, pvi.MeanFieldGaussian(), UPDATE, lambda c: data[c.node_config["partition-id"]]
    )
    return site, next(LOCAL_RUNS)


def _sites_factors(grid, like):
    """The factor each site of ``grid`` holds, stacked in client order."""
    factors = [load_factor(grid.contexts[node], like) for node in sorted(grid.contexts)]
    return jax.tree.map(lambda *f: np.stack(f), *factors)


def _run(site, server, factors, seed=2, **grid):
    grid = LocalGrid(site, FLOWER_SITES, **grid)
    strategy = PVIStrategy(
        pvi.MeanFieldGaussian(), FLOWER_SITES, random.PRNGKey(seed), server, factors=factors
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pvi.PVIWarning)  # 3 rounds: far from converged
        strategy.start(grid, num_rounds=3, timeout=60)
    return strategy, grid


@pytest.mark.parametrize(
    "server",
    [pvi.Synchronous(0.5), pvi.Synchronous(pvi.AdaptiveDamping(), clients_per_round=2)],
    ids=["synchronous", "sampled_adaptive"],
)
def test_factors_at_the_sites_give_the_server_runs_q(flower_task, linear_sites, tmp_path, server):
    """4 sites, 3 rounds, the same seeds: with ``factors="sites"`` each site keeps its ``t_m``
    (Flower's context state, and the file its node config names), the strategy holds none, and
    ``q``, every site's factor, the dampings and the ELBO equal the ``factors="server"`` run's.

    Measured (this machine, jax CPU): bitwise equal for both servers (also for ``Sequential()`` and
    ``Synchronous(1.0)``, run by hand); the tolerance is the other Flower tests' (1e-4 relative) and
    another seed moves q by more than 1e-2 (checked below).
    """
    site, run_id = linear_sites
    reference, _ = _run(site, server, "server", run_id=run_id)
    paths = lambda m: {"factor-path": str(tmp_path / f"site{m}.npz")}  # noqa: E731
    strategy, grid = _run(site, server, "sites", run_id=run_id, node_config=paths)
    other, _ = _run(site, server, "sites", seed=3, run_id=run_id)
    assert strategy.state.factors is None and reference.state.factors is not None
    for got, want, off in zip(
        jax.tree.leaves(strategy.state.q),
        jax.tree.leaves(reference.state.q),
        jax.tree.leaves(other.state.q),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert np.max(np.abs(np.asarray(off) - np.asarray(want))) > 1e-2  # the seed matters
    np.testing.assert_array_equal(strategy.history.attempts, reference.history.attempts)
    np.testing.assert_allclose(strategy.history.damping, reference.history.damping)
    np.testing.assert_allclose(strategy.history.elbo, reference.history.elbo, rtol=1e-5)
    like = pvi.MeanFieldGaussian().zeros(np.shape(strategy.state.q.eta1)[0])
    for node, context in grid.contexts.items():
        # a restarted site (an empty context state, the same run) reads its factor from its file
        restarted = Context(run_id, node, context.node_config, RecordDict(), {})
        for factor in (load_factor(context, like), load_factor(restarted, like)):
            for got, want in zip(jax.tree.leaves(factor), jax.tree.leaves(reference.state.factors)):
                np.testing.assert_allclose(got, np.asarray(want)[node - 100], rtol=1e-4, atol=1e-5)
        # another run's site starts flat
        fresh = Context(run_id + 1, node, context.node_config, RecordDict(), {})
        assert all(np.all(x == 0) for x in jax.tree.leaves(load_factor(fresh, like)))


def test_a_site_that_joins_late_keeps_its_factor_at_the_site(flower_task, linear_sites):
    """``Continual()`` with the factors at the sites: the fourth site connects after the first round
    and joins with a flat factor that it keeps; ``q`` and every site's factor equal the
    ``factors="server"`` run's (measured: bitwise equal; tolerance as above), and the server holds
    none."""
    (site, run_id), runs = linear_sites, {}
    for factors in ("server", "sites"):
        grid = LocalGrid(site, 4, hidden={103}, reveal_after=3, run_id=run_id)
        strategy = PVIStrategy(
            pvi.MeanFieldGaussian(), 3, random.PRNGKey(2), pvi.Continual(), factors=factors
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pvi.PVIWarning)
            strategy.start(grid, num_rounds=2, timeout=60)
        runs[factors] = strategy, grid
    (reference, _), (strategy, grid) = runs["server"], runs["sites"]
    assert strategy.state.factors is None
    # round 1 visits the first three sites, round 2 only the one that joined
    np.testing.assert_array_equal(strategy.history.attempts, [[1, 1, 1, 0], [0, 0, 0, 1]])
    np.testing.assert_array_equal(strategy.history.accepted, reference.history.accepted)
    held = _sites_factors(grid, pvi.MeanFieldGaussian().zeros(np.shape(strategy.state.q.eta1)[0]))
    pairs = zip(
        jax.tree.leaves((strategy.state.q, held)),
        jax.tree.leaves((reference.state.q, reference.state.factors)),
    )
    for got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert np.all(np.abs(held.eta2[3]) > 0)  # the late site's update is in its factor


class HandMade:
    """Two sites whose deltas are given: site 0 adds precision 3, site 1 takes 1.5 away (prior
    precision 1). Undamped, ``q`` (precision 2.5) is valid but site 0's new cavity (1 - 1.5) is not;
    at half the step it is (0.25). ``precision(p)``: the family's precision ``p`` (2 dimensions)."""

    def __init__(self, family, precision):
        self.family = family
        self.prior = family.from_mean_precision(jnp.zeros(2), precision(1.0))
        self.deltas = [
            family.from_mean_precision(jnp.ones(2), precision(4.0)) - self.prior,
            family.from_mean_precision(jnp.zeros(2), precision(-0.5)) - self.prior,
        ]

    def prepare(self, context):
        problem = SimpleNamespace(family=self.family, sites=SimpleNamespace(dim=2))
        return SimpleNamespace(problem=problem, hyper=())

    def train(self, message, context):
        delta = self.deltas[context.node_config["partition-id"]]
        result = reply_result(ClientResult(delta, jnp.asarray(1.0), ()))
        return Message(RecordDict({"result": tree_to_record(result)}), reply_to=message)


@pytest.mark.parametrize(
    "family, precision",
    [
        (pvi.MeanFieldGaussian(), lambda p: jnp.full(2, p)),
        (pvi.FullRankGaussian(), lambda p: p * jnp.eye(2)),
    ],
    ids=["mean_field", "full_rank"],
)
def test_the_sites_check_of_their_cavities_backtracks_the_merge_as_the_server_would(
    flower_task, family, precision
):
    """A merge that leaves ``q`` valid but a site's new cavity invalid: the server alone (holding
    ``q`` only) would take the full step; the sites' check halves it, as the server holding every
    factor does (damping 0.5, the same ``q`` and factors), for diagonal precisions (every site
    checks) and dense ones (the merging sites check)."""
    sites, server = HandMade(family, precision), pvi.Synchronous(1.0)
    prior = sites.prior
    factors = jax.tree.map(lambda x: jnp.zeros((2,) + x.shape), prior)
    outcome = {}
    for at_sites in (False, True):
        state = pvi.PVIState(
            prior, None if at_sites else factors, family.zeros(2), (), None, random.PRNGKey(0),
            (), (), (), server.damping.init(prior, factors, family),
        )  # fmt: skip
        grid = LocalGrid(sites, 2)
        runner = (SiteFactorsRunner if at_sites else FlowerRunner)(
            grid, {0: 100, 1: 101}, result_like(prior, ()), 5, ConfigRecord()
        )
        steps = Steps(None, jax.jit(make_apply(family, server, None)), runner, *[None] * 4)
        args = (random.PRNGKey(1), 2, 2)
        round = (
            SiteFactorsRound(steps, family, server, *args)
            if at_sites
            else FlowerRound(steps, family, *args)
        )
        state = server.run_round(state, round, 2)
        outcome[at_sites] = state, round, grid
    (reference, by_server, _), (state, by_sites, grid) = outcome[False], outcome[True]
    np.testing.assert_allclose(by_server.log["damping"], [0.5, 0.5])
    np.testing.assert_allclose(by_sites.log["damping"], by_server.log["damping"])
    # q alone would pass the full step
    assert family.is_valid(prior + sites.deltas[0] + sites.deltas[1])
    for got, want in zip(jax.tree.leaves(state.q), jax.tree.leaves(reference.q)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    for m, node in enumerate((100, 101)):
        factor = load_factor(grid.contexts[node], family.zeros(2))
        for got, want in zip(jax.tree.leaves(factor), jax.tree.leaves(reference.factors)):
            np.testing.assert_allclose(got, np.asarray(want)[m], rtol=1e-6)
        assert np.any(np.asarray(factor.eta2) != 0)  # the site committed its damped delta


def test_a_site_silent_in_the_check_blocks_the_merge(flower_task):
    """The server cannot vouch for the cavity of a site that does not answer the check: the merge is
    rejected (``INVALID``), ``q`` stays, and no site commits its delta (every factor stays flat)."""
    family = pvi.MeanFieldGaussian()
    sites, server = HandMade(family, lambda p: jnp.full(2, p)), pvi.Synchronous(0.5)
    state = pvi.PVIState(
        sites.prior, None, family.zeros(2), (), None, random.PRNGKey(0), (), (), (),
        server.damping.init(sites.prior, None, family),
    )  # fmt: skip
    grid = LocalGrid(sites, 2, silent={(101, CHECK)})
    runner = SiteFactorsRunner(
        grid, {0: 100, 1: 101}, result_like(sites.prior, ()), 0.2, ConfigRecord()
    )
    steps = Steps(None, None, runner, *[None] * 4)
    round = SiteFactorsRound(steps, family, server, random.PRNGKey(1), 2, 2)
    after = server.run_round(state, round, 2)
    rejections = [pvi.state.Rejection(int(r)).name for r in round.log["rejection"]]
    assert rejections == ["INVALID", "INVALID"]
    np.testing.assert_array_equal(round.log["accepted"], [0, 0])
    for got, want in zip(jax.tree.leaves(after.q), jax.tree.leaves(sites.prior)):
        np.testing.assert_array_equal(got, want)
    for context in grid.contexts.values():
        assert all(np.all(x == 0) for x in jax.tree.leaves(load_factor(context, family.zeros(2))))


def test_factors_at_the_sites_refuse_what_needs_them_at_the_server():
    """A bad ``factors`` and the servers that need every factor at the server are refused by name,
    before anything runs."""
    family, key = pvi.MeanFieldGaussian(), random.PRNGKey(0)
    for bad in ("device", None, 1):
        with pytest.raises(ValueError, match="factors must be"):
            PVIStrategy(family, 4, key, pvi.Synchronous(0.5), factors=bad)
    for server in (None, pvi.Synchronous(), pvi.Synchronous(pvi.HeavyBall())):
        with pytest.raises(ValueError, match="HeavyBall"):
            PVIStrategy(family, 4, key, server, factors="sites")
    with pytest.raises(NotImplementedError, match="Asynchronous"):
        PVIStrategy(family, 4, key, pvi.Asynchronous(0.5), factors="sites")
    # a fitted prior's step moves q and every cavity, which only the factors' holder can check
    with pytest.raises(ValueError, match="non-Gaussian prior"):
        PVIStrategy(family, 4, key, pvi.Synchronous(0.5), factors="sites", model=lambda: None)
    for server in (
        pvi.Synchronous(0.5),
        pvi.Sequential(),
        pvi.Synchronous(pvi.AdaptiveDamping()),
        pvi.Continual(),
    ):
        assert PVIStrategy(family, 4, key, server, factors="sites").factors == "sites"


def test_dp_sites_that_keep_their_factors_give_the_server_runs_q_and_epsilon(flower_task):
    """``DPGradientUpdate`` sites with ``factors="sites"`` (issue 27's DP composition): 3 sites of
    10 rows, 2 rounds, the same seeds. ``q``, the attempts and the ELBO equal the
    ``factors="server"`` run's, the strategy holds no factor, each site holds the factor the server
    run held for it, and ``strategy.privacy_spent`` (from the releases the sites report) gives the
    same epsilons, positive, with either client sampling rule.

    Measured (this machine, jax CPU): q bitwise equal; the tolerance is the other Flower tests'
    (1e-4 relative), the epsilons' 1e-9 (the same counts into the same accountant).
    """
    data = make_three_linear_sites()
    site = Site(
        linear_model,
        pvi.MeanFieldGaussian(),
        SMALL_DP_UPDATE,
        lambda c: data[c.node_config["partition-id"]],
    )
    run_id, runs = next(LOCAL_RUNS), {}
    for factors in ("server", "sites"):
        grid = LocalGrid(site, 3, run_id=run_id)
        strategy = PVIStrategy(
            pvi.MeanFieldGaussian(), 3, random.PRNGKey(2), pvi.Synchronous(0.5), factors=factors
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pvi.PVIWarning)  # 2 rounds: far from converged
            strategy.start(grid, num_rounds=2, timeout=60)
        runs[factors] = strategy, grid
    (reference, _), (strategy, grid) = runs["server"], runs["sites"]
    assert strategy.state.factors is None
    for got, want in zip(jax.tree.leaves(strategy.state.q), jax.tree.leaves(reference.state.q)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(strategy.history.attempts, reference.history.attempts)
    np.testing.assert_allclose(strategy.history.elbo, reference.history.elbo, rtol=1e-5)
    like = pvi.MeanFieldGaussian().zeros(2)
    for node, context in grid.contexts.items():
        for got, want in zip(
            jax.tree.leaves(load_factor(context, like)), jax.tree.leaves(reference.state.factors)
        ):
            np.testing.assert_allclose(got, np.asarray(want)[node - 100], rtol=1e-4, atol=1e-5)
    assert strategy.releases == reference.releases == {m: (2, 10) for m in range(3)}
    for rule in ("known", "secret"):
        spent = strategy.privacy_spent(SMALL_DP_UPDATE, 1e-5, client_sampling=rule)
        np.testing.assert_allclose(
            spent, reference.privacy_spent(SMALL_DP_UPDATE, 1e-5, client_sampling=rule), rtol=1e-9
        )
        assert np.all(spent > 0)
