"""``compilation``: JAX's Threefry unrolled on CPU, the same bits in fewer kernels; the opt-in
persistent cache."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compilation_cache import compilation_cache
from jax.extend.random import threefry_2x32

import numpyro_pvi as pvi
from numpyro_pvi.compilation import split_keys, unroll_threefry_on_cpu


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


def _threefry_reference(key, count):
    """Threefry-2x32 with 20 rounds in NumPy (Salmon et al. 2011), the hash JAX computes."""
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    k1, k2 = (np.uint64(k) for k in key)
    ks = [k1, k2, k1 ^ k2 ^ np.uint64(0x1BD11BDA)]
    mask = np.uint64(0xFFFFFFFF)
    x = [(np.asarray(c, np.uint64) + ks[i]) & mask for i, c in enumerate(count)]
    for group in range(5):
        for r in rotations[group % 2]:
            x[0] = (x[0] + x[1]) & mask
            x[1] = x[0] ^ (((x[1] << np.uint64(r)) | (x[1] >> np.uint64(32 - r))) & mask)
        x[0] = (x[0] + ks[(group + 1) % 3]) & mask
        x[1] = (x[1] + ks[(group + 2) % 3] + np.uint64(group + 1)) & mask
    return np.stack(x).astype(np.uint32)


def test_the_unrolled_hash_is_threefry_for_every_shape_and_batch():
    """The CPU lowering written as HLO operations (JAX's rule traced a Python function at every
    call site) hashes like a NumPy Threefry-2x32 for counts of several shapes, under ``jit`` and
    with the keys batched by ``vmap`` (each key broadcast against its counts)."""
    assert unroll_threefry_on_cpu()
    rng = np.random.default_rng(0)
    words = lambda *shape: rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)  # noqa: E731
    hashed = jax.jit(threefry_2x32)
    for shape in [(2,), (6,), (3, 4)]:
        key, count = words(2), words(*shape)
        flat = count.reshape(-1)
        expected = _threefry_reference(key, np.split(flat, 2)).reshape(-1)
        np.testing.assert_array_equal(np.asarray(hashed(key, count)).reshape(-1), expected)
    keys, counts = words(5, 2), words(5, 8)
    batched = np.asarray(jax.jit(jax.vmap(threefry_2x32))(keys, counts))
    for key, count, out in zip(keys, counts, batched):
        np.testing.assert_array_equal(out, _threefry_reference(key, np.split(count, 2)).reshape(-1))


def test_split_keys_are_jaxs_keys_of_a_key_computed_on_its_own():
    """``split_keys`` gives ``jax.random.split``'s keys, bit for bit, and keeps the key's own
    derivation (here a ``fold_in``) out of the split's kernel: the compiled program holds the
    barrier that stops XLA fusing the two hashes into one."""

    def derived(key):
        return split_keys(jax.random.fold_in(key, 3), 5)

    key = jax.random.PRNGKey(7)
    np.testing.assert_array_equal(
        jax.jit(derived)(key), jax.random.split(jax.random.fold_in(key, 3), 5)
    )
    assert "optimization_barrier" in jax.jit(derived).lower(key).as_text()


def test_enable_compilation_cache_sets_jaxs_cache_idempotently_and_stores_programs(
    tmp_path, monkeypatch
):
    """The opt-in cache: JAX's cache directory and threshold set (the default under the user's cache
    directory), the same state after a second call, and a compiled program written there."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    before = (
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_min_compile_time_secs,
    )
    try:
        where = pvi.enable_compilation_cache()
        assert where == tmp_path / "xdg" / "numpyro_pvi" / "jax" and where.is_dir()
        assert jax.config.jax_compilation_cache_dir == str(where)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
        assert pvi.enable_compilation_cache(where) == where
        assert jax.config.jax_compilation_cache_dir == str(where)
        other = pvi.enable_compilation_cache(tmp_path / "other")
        assert jax.config.jax_compilation_cache_dir == str(other)
        # a program of a shape nothing else compiles, stored in the new directory
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.zeros(7, jnp.float32)).block_until_ready()
        assert any(other.iterdir())
    finally:
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
