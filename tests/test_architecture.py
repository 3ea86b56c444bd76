"""docs/architecture.md is the map, kept true by the change that moves the code: every package
under elasticft/ and every etcd key of contract/keys.py must appear in it."""

import inspect
from pathlib import Path

from elasticft.contract.keys import RunKeys

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "architecture.md"
# what a key method's parameters stand for in the map
PLACEHOLDERS = {"node_id": "<node>", "node": "<node>", "gpu": "<gpu>", "request_id": "<id>", "round_": "<r>",
                "attempt": "<attempt>", "name": "<seq>"}


def packages() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "elasticft").glob("*/__init__.py"))


def key_shapes() -> dict[str, str]:
    """Each RunKeys member -> its key under the run (placeholders for its arguments)."""
    keys, shapes = RunKeys("RUN"), {}
    for name, member in inspect.getmembers(RunKeys):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            value = getattr(keys, name)
        elif inspect.isfunction(member):
            params = list(inspect.signature(member).parameters)[1:]
            value = getattr(keys, name)(*[PLACEHOLDERS[p] for p in params])
        else:
            continue
        shape = value[len(keys.root):] if value.startswith(keys.root) else value[len(keys.prefix.rstrip("/")):]
        if shape and shape.isprintable():
            shapes[name] = shape.replace("RUN", "<run_id>").rstrip("/")
    return shapes


def missing_from(text: str) -> list[str]:
    absent = [f"package {p}/" for p in packages() if f"{p}/" not in text]
    absent += [f"key {name}: {shape}" for name, shape in key_shapes().items() if shape.strip("/") not in text]
    return absent


def test_every_package_and_every_etcd_key_is_on_the_map():
    assert not missing_from(MAP.read_text()), missing_from(MAP.read_text())


def test_the_check_fails_when_a_package_or_a_key_leaves_the_map():
    text = MAP.read_text()
    without = text.replace("memckpt/", "memory/").replace("slurm/<attempt>/end-time-asker", "slurm/asker")
    assert {"package memckpt/", "key slurm_end_time_asker: slurm/<attempt>/end-time-asker"} <= set(missing_from(without))
