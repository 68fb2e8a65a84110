"""The merge's safety rules: backtracking until q and every cavity are valid, rejection, dropped
deltas."""

import jax.numpy as jnp
import numpy as np

import numpyro_pvi as pvi
from numpyro_pvi.families import NatParams
from numpyro_pvi.server.merge import is_valid_state, merge


def _mf(eta2):
    eta2 = jnp.asarray(eta2, jnp.float32)
    return NatParams(jnp.zeros_like(eta2), eta2)


def test_merge_backtracks_until_every_cavity_is_valid():
    family = pvi.MeanFieldGaussian()
    q, factors = _mf([-1.0]), _mf([[-0.5], [-0.5]])
    deltas = _mf([[0.9]])
    out = merge(
        family, q, factors, jnp.array([0]), deltas, jnp.array([True]), damping=1.0, max_backtracks=5
    )
    # rho = 1 leaves client 1's cavity at -0.1 + 0.5 > 0 (improper); rho = 0.5 is the first valid
    # one
    assert bool(out.valid) and float(out.damping) == 0.5
    np.testing.assert_allclose(out.q.eta2, [-0.55], rtol=1e-6)
    np.testing.assert_allclose(out.factors.eta2, [[-0.05], [-0.5]], rtol=1e-6)


def test_merge_rejects_what_no_damping_can_save_and_keeps_the_state():
    family = pvi.MeanFieldGaussian()
    q, factors = _mf([-1.0]), _mf([[-0.5], [-0.5]])
    out = merge(
        family,
        q,
        factors,
        jnp.array([1]),
        _mf([[10.0]]),
        jnp.array([True]),
        damping=1.0,
        max_backtracks=2,
    )
    assert not bool(out.valid) and float(out.damping) == 0.0
    np.testing.assert_array_equal(out.q.eta2, q.eta2)
    np.testing.assert_array_equal(out.factors.eta2, factors.eta2)


def test_merge_drops_non_finite_deltas():
    family = pvi.MeanFieldGaussian()
    q, factors = _mf([-1.0]), _mf([[-0.5], [-0.5]])
    deltas = _mf([[-0.2], [jnp.nan]])
    out = merge(family, q, factors, jnp.array([0, 1]), deltas, jnp.array([True, False]), 1.0, 5)
    np.testing.assert_allclose(out.q.eta2, [-1.2], rtol=1e-6)
    np.testing.assert_allclose(out.factors.eta2, [[-0.7], [-0.5]], rtol=1e-6)


def test_is_valid_state_checks_q_and_every_cavity():
    family = pvi.MeanFieldGaussian()
    assert bool(is_valid_state(family, _mf([-1.0]), _mf([[-0.5], [-0.4]])))
    assert not bool(is_valid_state(family, _mf([-1.0]), _mf([[-0.5], [-1.2]])))  # cavity 2 improper
    assert not bool(is_valid_state(family, _mf([0.5]), _mf([[0.0], [0.0]])))  # q improper


def _fr(eta2):
    eta2 = jnp.asarray(eta2, jnp.float32)
    return NatParams(jnp.zeros(eta2.shape[:-1]), eta2)


def test_a_dense_merge_checks_q_and_the_merging_clients_cavities_only():
    # the same numbers as the mean-field test above, as 1x1 full-rank precisions: the merge of
    # client 0 at rho = 1 leaves client 1's cavity improper, which a dense merge does not check (one
    # Cholesky per cavity); that cavity is checked when client 1 is next visited (test_servers:
    # rejected as INVALID)
    family = pvi.FullRankGaussian()
    q, factors = _fr([[-1.0]]), _fr([[[-0.5]], [[-0.5]]])
    out = merge(
        family,
        q,
        factors,
        jnp.array([0]),
        _fr([[[0.9]]]),
        jnp.array([True]),
        damping=1.0,
        max_backtracks=5,
    )
    assert bool(out.valid) and float(out.damping) == 1.0
    assert bool(is_valid_state(family, out.q, out.factors, jnp.array([0])))
    assert not bool(is_valid_state(family, out.q, out.factors))  # client 1's cavity
    # the merging client's own cavity and q are still checked: a delta that breaks them is
    # backtracked
    out = merge(
        family,
        q,
        factors,
        jnp.array([0]),
        _fr([[[1.8]]]),
        jnp.array([True]),
        damping=1.0,
        max_backtracks=5,
    )
    np.testing.assert_allclose(float(out.damping), 0.5)
