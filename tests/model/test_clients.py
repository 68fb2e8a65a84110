"""From the user's data to the clients' stacked arrays: row leaves, sizes, padding, checks by
shape."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

import numpyro_pvi as pvi
from numpyro_pvi.model.clients import append_client, buckets, split_client_data, split_pooled, stack


def test_pooled_data_is_sliced_by_leading_axis():
    X, y, shared = jnp.arange(10.0).reshape(5, 2), jnp.arange(5.0), jnp.ones(3)
    split = split_pooled((X, shared), {"y": y}, [np.array([0, 4]), np.array([1, 2, 3])], 5, "data")
    assert split.sizes == (2, 3) and split.is_row == (True, False, True)
    X1, s1, y1 = (col[1] for col in split.columns)
    np.testing.assert_array_equal(X1, X[1:4])
    np.testing.assert_array_equal(y1, y[1:4])
    assert s1 is shared


def test_stack_pads_rows_with_a_real_row_and_masks():
    clients = [
        ((jnp.ones((2, 3)),), {"y": jnp.array([1.0, 2.0]), "n": 4}),
        ((jnp.ones((4, 3)),), {"y": jnp.zeros(4), "n": 4}),
    ]
    split = split_client_data(clients, 2, "data")
    assert split.layout.static == ((1, 4),)  # kwargs leaves flatten in sorted key order: X, n, y
    stacked = stack(split)
    assert [a.shape for a in stacked.arrays] == [(2, 4, 3), (2, 4)]
    np.testing.assert_array_equal(stacked.mask, [[True, True, False, False], [True] * 4])
    # copies of a real row, not zeros
    np.testing.assert_array_equal(stacked.arrays[1][0], [1.0, 2.0, 2.0, 2.0])
    # room for clients to come: empty slots hold no real row
    wider = stack(split, rows=8, capacity=4)
    assert wider.mask.shape == (4, 8) and int(wider.mask[2:].sum()) == 0
    np.testing.assert_array_equal(wider.size, [2, 4, 0, 0])


def test_client_data_is_checked_by_shape_against_client_0():
    with pytest.raises(ValueError, match="client 1's row arguments disagree"):
        split_client_data(
            [((jnp.ones((2, 3)),), {"y": jnp.ones(2)}), ((jnp.ones((4, 3)),), {"y": jnp.ones(3)})],
            2,
            "data",
        )
    with pytest.raises(ValueError, match="client 1's array argument 1"):
        split_client_data(
            [((jnp.ones((2, 3)), jnp.ones(5)), {}), ((jnp.ones((4, 3)), jnp.ones(6)), {})],
            2,
            "data",
        )
    with pytest.raises(ValueError, match="structure"):
        split_client_data([((jnp.ones((2, 3)),), {}), ((jnp.ones((4, 3)), 1.0), {})], 2, "data")
    with pytest.raises(ValueError, match="leaf 1 differs"):
        split_client_data(
            [((jnp.ones((2, 3)),), {"n": 1}), ((jnp.ones((4, 3)),), {"n": 2})], 2, "data"
        )


def test_append_client_checks_the_new_client():
    split = split_client_data([((jnp.ones((2, 3)),), {"y": jnp.ones(2)})], 2, "data")
    grown = append_client(split, (jnp.ones((5, 3)),), {"y": jnp.ones(5)}, "data")
    assert grown.sizes == (2, 5) and split.sizes == (2,)  # a new value; the old one is unchanged
    with pytest.raises(ValueError, match="disagree"):
        append_client(split, (jnp.ones((5, 3)),), {"y": jnp.ones(4)}, "data")
    with pytest.raises(ValueError, match="structure"):
        append_client(split, (jnp.ones((5, 3)),), {}, "data")


def test_a_few_hundred_skewed_rows_make_one_bucket_and_a_lopsided_split_two():
    """A bucket compiles its own client update: the sweep's skewed split (800 rows cut 40/25/15/12/8
    %) made three buckets, three compilations of a minute each under load, to save 700 padded rows a
    round; now one. One client of 9,901 rows and 99 of one row still make two (one bucket would pad
    980,000 rows)."""

    def sizes_of(sizes):
        split = split_pooled(
            (jnp.zeros(sum(sizes)),),
            {},
            np.split(np.arange(sum(sizes)), np.cumsum(sizes)[:-1]),
            sum(sizes),
            "data",
        )
        return [b.clients.mask.shape for b in buckets(split, by_size=True)]

    assert sizes_of([320, 200, 120, 96, 64]) == [(5, 320)]
    assert sizes_of([9901] + [1] * 99) == [(99, 1), (1, 9901)]


def test_a_dirichlet_split_of_1000_clients_makes_two_buckets():
    """Each bucket compiles its own client update: a Dirichlet(0.3) label split of 10,000 rows over
    1,000 clients (sizes 1 to 56, every power of two up to 64) made 5 buckets (13,988 padded rows),
    5 compilations, and started 2.5x slower than an even split (``benchmarks/startup.py``); now 2
    (24,080 padded rows, against 56,000 in one bucket)."""
    labels = (np.random.default_rng(0).random(10_000) < 0.6).astype(np.int32)
    parts = pvi.split_by_label(random.PRNGKey(1), labels, 1_000, alpha=0.3)
    split = split_pooled((np.zeros(10_000),), {}, parts, 10_000, "data")
    shapes = [b.clients.mask.shape for b in buckets(split, by_size=True)]
    assert len(shapes) == 2, shapes
    assert sum(c * r for c, r in shapes) < 0.5 * 1_000 * max(len(p) for p in parts)
