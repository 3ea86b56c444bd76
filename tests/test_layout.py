"""The package's floors, read from the source: what may import what, and file sizes.

README.md's "Layout" section states these rules; this test keeps them true as the code
changes (a new import that runs up a floor, or a circle, fails here, not in review). No
Python file of the repository may be longer than 400 lines: none should need a map to read.
"""

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("elasticft", "launcher")
MAX_LINES = 400

# Module prefix -> prefixes it must never import.
FORBIDDEN = {
    "elasticft.contract": ("elasticft.",),  # except the few below
    "elasticft.store": ("elasticft.agent", "elasticft.tui", "elasticft.rendezvous", "elasticft.planner",
                        "elasticft.health", "elasticft.worker", "launcher"),
    "elasticft.planner": ("elasticft.agent", "elasticft.tui", "elasticft.rendezvous", "elasticft.health",
                          "elasticft.worker", "elasticft.store", "launcher"),
    "elasticft.health": ("elasticft.agent", "elasticft.tui", "elasticft.rendezvous", "elasticft.planner",
                         "elasticft.worker", "launcher"),
    "elasticft.worker": ("elasticft.agent", "elasticft.tui", "elasticft.rendezvous", "elasticft.planner",
                         "elasticft.health", "elasticft.store", "elasticft.config.settings", "launcher"),
    "elasticft.rendezvous": ("elasticft.agent", "elasticft.tui", "launcher"),
    "elasticft.tui": ("elasticft.agent", "launcher"),
    "elasticft.torch_seam": ("elasticft.", "launcher"),
    "elasticft.megatron_seam": ("elasticft.", "launcher"),
    "elasticft.bridge_seam": ("elasticft.", "launcher"),
    # the versions eft runs with, read before torch is imported: the standard library only
    "elasticft.versions": ("elasticft.", "launcher"),
    # how both Megatron seams name, check and replace a call site: the standard library only
    "elasticft.seam_sites": ("elasticft.", "launcher"),
    # inside a Megatron-LM worker: the worker's side of eft, Megatron's seam, the contract
    "elasticft.megatron_lm": ("elasticft.agent", "elasticft.tui", "elasticft.rendezvous", "elasticft.planner",
                              "elasticft.health", "elasticft.store", "elasticft.memckpt",
                              "elasticft.config.settings", "launcher"),
    # inside a Megatron-Bridge worker: Megatron-LM's mode (its boot, finder, shared loop parts), the seams
    "elasticft.megatron_bridge": ("elasticft.agent", "elasticft.tui", "elasticft.rendezvous", "elasticft.planner",
                                  "elasticft.health", "elasticft.store", "elasticft.memckpt",
                                  "elasticft.config.settings", "launcher"),
    "elasticft.config.knobs": ("elasticft.", "launcher"),
    # configuration: the knob machinery, one module per concern, Settings; over the contract alone
    "elasticft.config": ("elasticft.agent", "elasticft.tui", "elasticft.rendezvous", "elasticft.planner",
                         "elasticft.health", "elasticft.worker", "elasticft.store", "elasticft.memckpt",
                         "elasticft.goodput", "elasticft.slurm", "elasticft.megatron_lm", "elasticft.periodic",
                         "elasticft.torch_seam", "elasticft.megatron_seam", "elasticft.megatron_bridge",
                         "elasticft.bridge_seam", "launcher"),
    "elasticft.periodic": ("elasticft.", "launcher"),
    "elasticft.pdeathsig_exec": ("elasticft.", "launcher"),  # run by path: the standard library only
    "elasticft.goodput": ("elasticft.agent", "elasticft.tui", "elasticft.rendezvous", "elasticft.planner",
                          "elasticft.health", "elasticft.worker", "elasticft.store", "elasticft.memckpt",
                          "launcher"),
    # SLURM facts are pure: the job's variables and the controller's answers; no etcd, no agent
    "elasticft.slurm": ("elasticft.agent", "elasticft.tui", "elasticft.rendezvous", "elasticft.planner",
                        "elasticft.health", "elasticft.worker", "elasticft.store", "elasticft.memckpt", "launcher"),
    # what an agent exports: the contract and prometheus_client; the agent feeds it plain readings
    "elasticft.metrics": ("elasticft.agent", "elasticft.tui", "elasticft.rendezvous", "elasticft.planner",
                          "elasticft.health", "elasticft.worker", "elasticft.store", "elasticft.memckpt",
                          "elasticft.goodput", "launcher"),
    # the pod's variables, the manifests and their schemas: what eft-run and `eft kubernetes` read
    "elasticft.kubernetes": ("elasticft.agent", "elasticft.tui", "launcher"),
    "elasticft.memckpt": ("elasticft.agent", "elasticft.tui", "elasticft.rendezvous", "elasticft.planner",
                          "elasticft.health", "elasticft.worker", "launcher"),
}
# What the contract may import: itself, and the package's face for the version. It is the ground
# floor: everything stands on it, so it stands on nothing of eft's.
CONTRACT_ALLOWED = ("elasticft.contract",)
# Beneath every floor but the contract: the versions eft runs with (elasticft/versions.py, the
# standard library only), which the seams judge the installed libraries by, and the seams'
# shared mechanism (elasticft/seam_sites.py, the standard library only).
GROUND = ("elasticft.versions", "elasticft.seam_sites")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


@functools.cache
def lazy_names() -> dict[str, dict[str, str]]:
    """Package -> {name: module} of a package that loads its names on first use (its ``_EXPORTS``):
    ``from elasticft.config import Settings`` imports ``elasticft.config.settings``."""
    out = {}
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):
            for node in ast.parse(init.read_text()).body:
                if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["_EXPORTS"]:
                    name = module_name(init)
                    out[name] = {k: name + v if v.startswith(".") else v
                                 for k, v in ast.literal_eval(node.value).items()}
    return out


def imports_of(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (lazy imports count too)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import module`
            lazy = lazy_names().get(base, {})
            found |= {lazy[alias.name] for alias in node.names if alias.name in lazy}
    if path.name == "__init__.py":  # what a lazy package loads on first use
        found |= set(lazy_names().get(module, {}).values())
    return {name for name in found if name.split(".")[0] in PACKAGES}


def graph() -> dict[str, set[str]]:
    mods = sources()
    return {m: {i for i in imports_of(p, m) if i in mods and i != m} for m, p in mods.items()}


@pytest.mark.parametrize("floor", sorted(FORBIDDEN))
def test_no_import_runs_up_from_a_floor(floor):
    bad = []
    for module, targets in graph().items():
        if module != floor and not module.startswith(floor + "."):
            continue
        for target in targets:
            if floor == "elasticft.contract":
                if target != "elasticft" and not any(target == allowed or target.startswith(allowed + ".")
                                                     for allowed in CONTRACT_ALLOWED):
                    bad.append(f"{module} -> {target}")
            elif target in GROUND or target == floor or target.startswith(floor + "."):
                continue  # the ground, or the floor's own modules
            elif any(target == f.rstrip(".") or target.startswith(f if f.endswith(".") else f + ".")
                     or target == f for f in FORBIDDEN[floor]):
                bad.append(f"{module} -> {target}")
    assert not bad, "imports that run up a floor:\n" + "\n".join(sorted(bad))


def test_no_import_circles():
    edges = graph()
    # A package's __init__ importing its own modules is its face, not a circle.
    edges = {m: {t for t in ts if not (m.startswith(t + ".") and t in edges)} for m, ts in edges.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join(trail[trail.index(target):] + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_file_over_the_limit():
    files = [p for folder in (*PACKAGES, "bench", "examples", "tests") for p in (ROOT / folder).rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
