"""docs/architecture.md's worked examples (a backend, a server, a local update) run as written.

The page's Python blocks run in order in one namespace; each example asserts what it shows (the new
backend gives the loop backend's result, the new server visits every client once a round, the new
local update's factor is half the inner update's). Runs 2 clients, 40 rows, 1-2 rounds.
"""

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


# a 1-2 round run warns that it is far from converged: not what the examples show
@pytest.mark.filterwarnings("ignore::numpyro_pvi.server.monitor.PVIWarning")
def test_architecture_examples_run_and_hold():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 4, "the shared set-up, a backend, a server, a local update"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), namespace)  # noqa: S102 - the page's own code
    assert namespace["counting"].groups == 4
