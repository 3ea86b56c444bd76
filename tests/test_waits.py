"""Every wait a test makes ends before pytest's timeout for that test.

A test whose own wait (``job.wait(400)``, ``wait_for(..., 400, ...)``, a subprocess's
``timeout=400``) is longer than its pytest timeout is killed by pytest-timeout first, with a
thread dump instead of the test's own message ("timed out after 400 s waiting for the job"),
and under load that is how it fails. The waits and timeouts are read from the sources (ast):
a literal wait in a test, or in a fixture it uses, must be shorter than the test's timeout
(``@pytest.mark.timeout``, else the module's ``pytestmark``, else pyproject.toml's).
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]


def timeout_mark(node: ast.AST) -> float | None:
    """N of a ``pytest.mark.timeout(N)`` anywhere in ``node`` (a decorator, a pytestmark)."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("mark.timeout") and call.args:
            value = call.args[0]
            if isinstance(value, ast.Constant) and isinstance(value.value, (int, float)):
                return float(value.value)
    return None


def literal_waits(function: ast.FunctionDef) -> list[tuple[int, float]]:
    """(line, seconds) of each wait with a literal duration in ``function``'s body."""
    found = []
    for call in ast.walk(function):
        if not isinstance(call, ast.Call):
            continue
        name = ast.unparse(call.func)
        candidates = [k.value for k in call.keywords if k.arg == "timeout"]
        if name.endswith(".wait") and call.args:
            candidates.append(call.args[0])
        if name.split(".")[-1] == "wait_for" and len(call.args) > 1:
            candidates.append(call.args[1])
        found += [(call.lineno, float(c.value)) for c in candidates
                  if isinstance(c, ast.Constant) and isinstance(c.value, (int, float)) and not isinstance(c.value, bool)]
    return found


def too_long(path: Path, root: Path = ROOT) -> list[str]:
    """The waits in ``path`` (its tests, fixtures and helpers) as long as their timeout."""
    tree = ast.parse(path.read_text())
    module = next((timeout_mark(n) for n in tree.body if isinstance(n, ast.Assign)
                   and any(getattr(t, "id", None) == "pytestmark" for t in n.targets) and timeout_mark(n)), None)
    limit = module or DEFAULT
    problems = []
    for function in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        own = next((timeout_mark(d) for d in function.decorator_list if timeout_mark(d)), None)
        allowed = own or limit
        for line, seconds in literal_waits(function):
            if seconds >= allowed:
                problems.append(f"{path.relative_to(root)}:{line} waits {seconds:g} s under a {allowed:g} s timeout")
    return problems


def test_no_wait_in_a_test_outlasts_its_timeout():
    problems = [p for path in sorted((ROOT / "tests").rglob("test_*.py")) for p in too_long(path)]
    assert problems == []


def test_the_check_sees_a_wait_longer_than_the_timeout(tmp_path):
    """The check itself: a wait over the default, one under a larger mark, one under the module's."""
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import pytest\n"
        "def test_a(job):\n    job.wait(400)\n"
        "@pytest.mark.timeout(600)\n"
        "def test_b(job):\n    job.wait(400)\n"
        "def test_c(job):\n    wait_for(lambda: True, 500, 'x')\n    subprocess.run([], timeout=120)\n")
    found = too_long(sample, tmp_path)
    assert [re.sub(r"^.*:(\d+)", r"\1", p) for p in found] == [
        f"3 waits 400 s under a {DEFAULT:g} s timeout", f"8 waits 500 s under a {DEFAULT:g} s timeout"]

