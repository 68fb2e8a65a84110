"""Shared fixtures of the tests: small, seeded, deterministic data built once per session.

Shared models and exact references live in ``tests/models.py``, fake local updates in
``tests/fakes.py``; tests import them from there (never from conftest or another test file).
"""

import numpyro
import pytest

from models import make_linear_data, make_logistic_data

numpyro.set_platform("cpu")


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
