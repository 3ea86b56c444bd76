"""elasticft.config: one import for everyone, each name loaded from its module on first use."""

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import elasticft.config as config

PACKAGE = Path(config.__file__).parent


def public_names(path: Path) -> list[str]:
    """Names a module defines at its top: not imported, not private, no TypeVar."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(getattr(node.value, "func", None), "id", "") == "TypeVar":
            continue
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not n.startswith("_")]


def test_the_package_exports_every_public_name_of_its_modules():
    expected = {name: f".{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__" for name in public_names(p)}
    assert config._EXPORTS == expected


def test_every_name_loads_and_settings_holds_every_concern():
    for name in config.__all__:
        assert getattr(config, name) is getattr(sys.modules[f"elasticft.config{config._EXPORTS[name]}"], name)
    concerns = {f.default_factory for f in dataclasses.fields(config.Settings)}
    assert {getattr(config, n) for n in config.__all__ if n.endswith("Config")} == concerns


def test_a_worker_pays_for_the_concerns_it_reads_alone():
    code = ("import sys; from elasticft.config import HangConfig, from_env; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('elasticft.config'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == ["elasticft.config", "elasticft.config.hangs", "elasticft.config.knobs"]
