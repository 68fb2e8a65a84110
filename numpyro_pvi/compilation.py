"""Shorter compilations on CPU: JAX's random bits hashed by the unrolled Threefry.

Every random draw, ``split`` and ``fold_in`` hashes its counters with Threefry-2x32. On CPU, JAX
lowers each hash as a five-iteration ``while`` loop (on GPU, unrolled), and XLA compiles every such
loop into kernels of its own: in the round's compiled step of a :class:`~numpyro_pvi.GradientUpdate`
(logistic regression, mean field, 10 particles) 99 of the 204 kernels came from the hashes of
NumPyro's draws and key splits, and LLVM's code generation of the kernels is most of XLA's time.
The unrolled lowering computes the same bits (the same 20 rounds of the same hash, so every draw of
a run is unchanged, bit for bit) in one fused kernel per hash: that step then compiled in 4.8 s of
CPU instead of 11.5 s, and ran in 0.028 s instead of 0.088 s (``python benchmarks/startup.py``).

The rule is written as HLO operations directly: JAX's own unrolled rule traces a Python function
of the 20 rounds into a jaxpr at every call site. Lowering ``logistic-100``'s programs to the end of
round 1 in a fresh process (``jax.monitoring``'s ``jaxpr_to_mlir_module_duration``) took 0.35-0.38 s
with it and takes 0.15-0.17 s with this one; the optimised program is the same, line for line.

:func:`unroll_threefry_on_cpu` registers it for CPU; :func:`~numpyro_pvi.server.steps.compile_steps`
    calls
it, so it is in place before PVI compiles anything of a round.

:func:`enable_compilation_cache` (opt-in) keeps what XLA compiles on disk, so that a script's or a
notebook kernel's next run of the same configuration skips compiling it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

# compilations shorter than this are not stored (JAX's default is 1 s: a round's small programs,
# 0.05-0.5 s each, would compile again in every process)
CACHE_MIN_COMPILE_SECONDS = 0.0


def default_cache_dir() -> Path:
    """Where :func:`enable_compilation_cache` keeps programs by default: the user's cache directory
    (``$XDG_CACHE_HOME``, else ``~/.cache``; ``%LOCALAPPDATA%`` on Windows) under
    ``numpyro_pvi/jax``.

    **Example:** ``default_cache_dir()`` is ``Path.home() / ".cache/numpyro_pvi/jax"`` on Linux
    without ``XDG_CACHE_HOME``.
    """
    root = os.environ.get("XDG_CACHE_HOME") or (
        os.environ.get("LOCALAPPDATA") if os.name == "nt" else None
    )
    return Path(root or Path.home() / ".cache") / "numpyro_pvi" / "jax"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Keep JAX's compiled programs in a persistent cache on disk (opt-in), so that a fresh process
    that runs a configuration again (a script's second run, a restarted notebook kernel) loads them
    instead of compiling; idempotent.

    It sets JAX's ``jax_compilation_cache_dir`` to ``path`` (default :func:`default_cache_dir`,
    created if missing) and stores every compilation (``jax_persistent_cache_min_compile_time_secs``
    0). Calling it again with the same path changes nothing; with another path, later compilations
    are stored and looked up there. It changes where compiled programs come from, never what they
    compute. Only trusted users should be able to write to the directory (JAX loads what it finds
    there as programs).

    :param path: the cache directory, or ``None`` for :func:`default_cache_dir`.
    :return: the cache directory.

    **Example:** ``pvi.enable_compilation_cache()`` at the top of a notebook, before the first
    ``PVI(...)`` runs; it returns ``~/.cache/numpyro_pvi/jax`` (on Linux, without
    ``XDG_CACHE_HOME``).
    """
    where = Path(default_cache_dir() if path is None else path).expanduser().resolve()
    where.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != str(where):
        # a cache JAX opened elsewhere is closed, so the next compilation opens this one
        compilation_cache.reset_cache()
        compilation_cache.set_cache_dir(str(where))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)
    return where


def unroll_threefry_on_cpu() -> bool:
    """Lower Threefry-2x32 on CPU as JAX does on GPU (unrolled: the same bits, shorter compilations,
    faster kernels); idempotent.

    It changes how JAX compiles, never what it computes: ``jax.random`` gives the same numbers
    before and after. Returns whether the unrolled lowering is in place (``False`` with a JAX whose
    internals moved: compilations are then as long as JAX's defaults make them, and the results the
    same).

    **Example:**

    .. doctest::

        >>> import jax
        >>> from numpyro_pvi.compilation import unroll_threefry_on_cpu
        >>> unroll_threefry_on_cpu()
        True
        >>> "while" in jax.jit(jax.random.normal).lower(jax.random.PRNGKey(0)).as_text()
        False
    """
    try:
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir.dialects import hlo
        from jax._src.random import threefry2x32

        primitive = threefry2x32.threefry2x32_p
    except (ImportError, AttributeError):
        return False
    mlir.register_lowering(primitive, _unrolled_threefry(mlir, hlo), platform="cpu")
    return True


def several_buckets_compiler_options() -> dict:
    """XLA compiler options (``jax.jit(..., compiler_options=...)``) of a round's program that runs
    several size buckets: on CPU, XLA's memory-optimised scheduler; elsewhere none.

    XLA:CPU's default scheduler orders a program's operations so that independent ones can run at
    once: the buckets' client updates, each a loop of steps whose operations already use every
    core. A Dirichlet(0.3) split of 1,000 clients in three buckets (``benchmarks/scale.py``'s
    ``mf-dirichlet-1000``) ran a round in 42-52 ms that way against 36-44 ms as one program per
    bucket, and in 33-39 ms with the memory-optimised scheduler (processes of each alternated, 20
    rounds, medians).

    **Example:** ``jax.jit(step, compiler_options=several_buckets_compiler_options())``; on CPU it
    is ``{"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}``.
    """
    if jax.default_backend() != "cpu":
        return {}
    return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def split_keys(rng_key: jax.Array, num: int) -> jax.Array:
    """``jax.random.split(rng_key, num)``, the same keys, with ``rng_key`` computed in a kernel of
    its own.

    XLA fuses a key's derivation (the ``fold_in`` and ``split`` hashes that made it) into the split
    that consumes it, so one kernel holds several Threefry hashes in a chain, and LLVM optimises
    such a kernel superlinearly: SNEP's two per-step key splits (``snep-poisson``) took 0.84-0.93 s
    of LLVM each, against 74 ms for the largest kernel once the key is its own
    (``jax.lax.optimization_barrier``), and the round's program 5.7 s of LLVM instead of 7.3 s.

    **Example:** ``jax.lax.scan(step, carry, split_keys(rng_key, num_steps))``.
    """
    return jax.random.split(jax.lax.optimization_barrier(rng_key), num)


# Threefry-2x32's rotations, alternating by group of four rounds, and the key schedule's parity
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def _unrolled_threefry(mlir: Any, hlo: Any) -> Callable:
    """The lowering rule of ``threefry2x32_p``: the 20 rounds of JAX's unrolled lowering
    (``jax._src.random.threefry2x32._threefry2x32_lowering``), written as HLO operations directly.
    JAX's own rule traces that Python function into a jaxpr at every call site (a tenth of a
    second of a round's lowering); the operations, and so the bits, are the same."""

    def rule(ctx: Any, key1: Any, key2: Any, x1: Any, x2: Any) -> list:
        out = ctx.avals_out[0]
        k1_aval, k2_aval, x1_aval, x2_aval = ctx.avals_in

        def full(value: Any, aval: Any) -> Any:
            """``value`` broadcast to the output's shape (where it is used, as JAX's rule does)."""
            if aval.shape == out.shape:
                return value
            dims = range(len(out.shape) - len(aval.shape), len(out.shape))
            return mlir.broadcast_in_dim(ctx, value, out, broadcast_dimensions=dims)

        def const(c: int) -> Any:
            return mlir.full_like_aval(ctx, np.uint32(c), out)

        def rotate_left(v: Any, r: int) -> Any:
            return hlo.or_(hlo.shift_left(v, const(r)), hlo.shift_right_logical(v, const(32 - r)))

        if k1_aval.shape != k2_aval.shape:
            key1, key2, k1_aval, k2_aval = full(key1, k1_aval), full(key2, k2_aval), out, out
        # the key schedule at the keys' shape (one pair of words, typically)
        parity = mlir.full_like_aval(ctx, np.uint32(_PARITY), k1_aval)
        ks = [(key1, k1_aval), (key2, k2_aval), (hlo.xor(hlo.xor(key1, key2), parity), k1_aval)]
        y1 = hlo.add(full(x1, x1_aval), full(*ks[0]))
        y2 = hlo.add(full(x2, x2_aval), full(*ks[1]))
        for group in range(5):
            for r in _ROTATIONS[group % 2]:
                y1 = hlo.add(y1, y2)
                y2 = hlo.xor(y1, rotate_left(y2, r))
            y1 = hlo.add(y1, full(*ks[(group + 1) % 3]))
            y2 = hlo.add(hlo.add(y2, full(*ks[(group + 2) % 3])), const(group + 1))
        return [y1, y2]

    return rule
