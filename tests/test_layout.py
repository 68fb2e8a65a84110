"""The test suite's own layout: shared models and fakes come from ``tests/models.py`` and
``tests/fakes.py``, never from conftest (its fixtures reach the tests by name) or from another test
module (importing one runs its module-level set-up and collects its tests twice)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
    return modules


def test_no_test_imports_conftest_or_another_test_module():
    offenders = {
        path.name: sorted(
            name
            for name in imported_modules(path)
            if name == "conftest" or name.startswith("test_")
        )
        for path in sorted(TESTS.rglob("*.py"))
    }
    assert not {name: bad for name, bad in offenders.items() if bad}
