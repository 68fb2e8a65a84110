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
"""

from __future__ import annotations


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
