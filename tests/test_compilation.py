"""``compilation``: JAX's Threefry unrolled on CPU, the same bits in fewer kernels."""

import jax
import numpy as np
from jax.extend.random import threefry_2x32

from numpyro_pvi.compilation import unroll_threefry_on_cpu


def test_threefry_is_unrolled_on_cpu_and_hashes_the_same_bits():
    """A draw lowers without a loop once unrolled (JAX's CPU default is a ``while`` loop per hash),
    and the hash still gives Random123's known answers for Threefry-2x32 with 20 rounds (the vectors
    of JAX's own tests), so every draw of a run is unchanged."""
    assert unroll_threefry_on_cpu()
    draw = jax.jit(lambda key: jax.random.normal(key, (3,)))
    assert "while" not in draw.lower(jax.random.PRNGKey(0)).as_text()
    known = [
        ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ]
    hashed = jax.jit(threefry_2x32)
    for key, count, expected in known:
        out = hashed(np.asarray(key, np.uint32), np.asarray(count, np.uint32))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expected, np.uint32))
