"""Shorter compilations on CPU: JAX's random bits hashed by the unrolled Threefry.

Every random draw, ``split`` and ``fold_in`` hashes its counters with Threefry-2x32. On CPU, JAX
lowers each hash as a five-iteration ``while`` loop (on GPU, unrolled), and XLA compiles every such
loop into kernels of its own: in the round's compiled step of a :class:`~numpyro_pvi.GradientUpdate`
(logistic regression, mean field, 10 particles) 99 of the 204 kernels came from the hashes of
NumPyro's draws and key splits, and LLVM's code generation of the kernels is most of XLA's time.
The unrolled lowering computes the same bits (the same 20 rounds of the same hash, so every draw of
a run is unchanged, bit for bit) in one fused kernel per hash: that step then compiled in 4.8 s of
CPU instead of 11.5 s, and ran in 0.028 s instead of 0.088 s (``python benchmarks/startup.py``).

:func:`unroll_threefry_on_cpu` registers it for CPU; :func:`~numpyro_pvi.server.steps.compile_steps`
    calls
it, so it is in place before PVI compiles anything of a round.

:func:`enable_compilation_cache` (opt-in) keeps what XLA compiles on disk, so that a script's or a
notebook kernel's next run of the same configuration skips compiling it.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
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
        from jax._src.random import threefry2x32

        # the rule JAX registers for GPU and TPU: the 20 rounds written out
        primitive, unrolled = threefry2x32.threefry2x32_p, threefry2x32._threefry2x32_lowering_rule
    except (ImportError, AttributeError):
        return False
    mlir.register_lowering(primitive, unrolled, platform="cpu")
    return True
