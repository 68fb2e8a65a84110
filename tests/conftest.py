"""Shared fixtures of the tests: small, seeded, deterministic data built once per session.

Shared models and exact references live in ``tests/models.py``, fake local updates in
``tests/fakes.py``; tests import them from there (never from conftest or another test file).
"""

import os
import shutil
import tempfile


def _compile_quickly():
    """The suite's programs are compiled at LLVM optimisation level 0 and with XLA:CPU's older
    elemental fusion emitter (``XLA_FLAGS`` ``--xla_backend_optimization_level=0
    --xla_cpu_use_fusion_emitters=false``, set before JAX starts; xdist workers, Ray actors and
    Flower's processes inherit them). XLA's HLO passes are the same (the optimised HLO of a Gamma
    CVI round's ``group_step`` is byte for byte the same, 423 fusions, at levels 0 and 2), so every
    test checks the program users run, lowered to less optimised machine code.

    Level 0 alone: on ``tests/test_pvi.py``, ``tests/server/test_monitor.py``,
    ``tests/test_elbo.py`` and ``tests/privacy/test_dp_gradient.py`` XLA's compile time fell from
    162 s to 107 s. The elemental emitter then halves what is left: SNEP's Dirichlet round
    (``test_snep_blocks.py``) compiles in 4.5 s instead of 7.2 s, and over the whole suite (``pytest
    -n 2 --dist loadgroup``, quiet 2-core machine) XLA's compile time (``jax.monitoring``'s
    ``backend_compile_duration``) fell from 785 s to 369 s and pytest's wall time from 662 s to
    427 s. Results agree to float rounding (no tolerance changed). Do not pair the elemental
    emitter with level 2 or 1: that SNEP test had not finished after 10 minutes at either (level 1
    measured in issue 26's tenth session). Both flags exist in
    every jaxlib of the supported range (``strings`` of jaxlib 0.7.0's and 0.10.2's
    ``libjax_common.so``); XLA aborts on a flag it does not know.

    CI runs the code at users' level too: the quickstart and the docs' notebooks. An ``XLA_FLAGS``
    that sets ``--xla_backend_optimization_level`` itself is left as it is
    (``XLA_FLAGS=--xla_backend_optimization_level=2 pytest`` compiles as users do)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        flags += " --xla_backend_optimization_level=0"
        if "xla_cpu_use_fusion_emitters" not in flags:
            flags += " --xla_cpu_use_fusion_emitters=false"
        os.environ["XLA_FLAGS"] = flags.strip()


_compile_quickly()

import jax  # noqa: E402  (after XLA_FLAGS: JAX reads them when it starts its backend)
import numpyro  # noqa: E402
import pytest  # noqa: E402

from models import make_linear_data, make_logistic_data  # noqa: E402

numpyro.set_platform("cpu")


def _share_compilations():
    """One JAX persistent compilation cache for this test run: a configuration that several tests
    build (same model, family, update, server and shapes) lowers to the same XLA program, which is
    compiled once and loaded from the cache by the other tests, on either xdist worker and in the
    Ray and Flower processes (they inherit the environment). Compilation is most of a slow test's
    CPU (test_snep_blocks' sequential test: 70 s cold, 16 s with its programs cached); a cache hit
    runs the same executable, so results are unchanged. Compilation counts (test_problem.py) are
    unchanged too: JAX logs and times a cache hit as a compilation.

    The cache is fresh for each run (a temporary folder the controlling process makes and removes),
    so the suite's time from a fresh clone is what CI sees. Set ``JAX_COMPILATION_CACHE_DIR`` to
    keep one across runs instead (it is then left in place); ``JAX_ENABLE_COMPILATION_CACHE=false``
    turns it off.
    """
    # JAX decides at its first compilation whether the cache is on: this runs at conftest import,
    # before anything compiles (tests/models.py builds no JAX array at import; keep it so)
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if folder is None:  # the controlling process (or a run without xdist): a fresh folder
        folder = tempfile.mkdtemp(prefix="numpyro-pvi-tests-jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = folder  # xdist workers, Ray and Flower inherit it
        os.environ["NUMPYRO_PVI_TESTS_OWN_CACHE"] = folder
    # every compilation is worth caching: under load even a small one takes a second
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_share_compilations()


def pytest_unconfigure(config):
    """The controlling process removes the cache folder it made (workers leave it to it)."""
    folder = os.environ.get("NUMPYRO_PVI_TESTS_OWN_CACHE")
    if folder and os.environ.get("PYTEST_XDIST_WORKER") is None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def linear_data():
    return make_linear_data()


@pytest.fixture(scope="session")
def logistic_data():
    return make_logistic_data()


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Each test file runs on one xdist worker (``--dist loadgroup``): its module-scoped fixtures (a
    shared run, a reference) are built once, not once per worker. Tests that name their own
    ``xdist_group`` (the Ray and Flower cluster) keep it.

    xdist marks a group by appending ``@group`` to each test's ``item._nodeid``, which pytest 9 no
    longer reads (its node ids live in ``item._id``): without the repair below ``--dist loadgroup``
    schedules test by test, as ``--dist load`` (measured with pytest 9.2 and xdist 3.8: a
    module-marked group split over both workers).
    """
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    result = yield  # xdist's own hook runs here
    if config.getoption("loadgroup", default=False):  # an xdist worker under --dist loadgroup
        for item in items:
            names = {
                str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                for mark in item.iter_markers("xdist_group")
            }
            suffix = "@" + "_".join(sorted(names))
            if not item.nodeid.endswith(suffix):  # pytest >= 9: xdist's suffix did not take
                from _pytest.nodeid import NodeId

                item._id = NodeId.parse(item.nodeid + suffix)
    return result
