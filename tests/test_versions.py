"""Which torch eft runs with, as a user meets it: the launch line for a torch too old, the
untested line for a newer one, a moved name refused in one line, and ``eft-run --version``.

A torch of another version is shown to the launcher the way pip shows it: a distribution's
metadata first on the path (``importlib.metadata`` reads the first it finds), beside the real
torch that stays importable. Every minor from 2.9 up also runs for real in CI's compatibility
lanes (``.ci/run``), and an NGC-style build there too (``tests/test_install.py``).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elasticft import versions
from elasticft.versions import Support
from tests.version_shadow import reporting

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.seam


@pytest.mark.parametrize("version,release", [
    ("2.11.0a0+eb65b36914", (2, 11, 0)),  # NGC 26.02
    ("2.9.0a0+50eac811a6", (2, 9, 0)),  # NGC 25.09
    ("2.16.0.dev20260101+cu130", (2, 16, 0)),  # a nightly
    ("2.13.0+cpu", (2, 13, 0)),
    ("v1.2", (1, 2)),
    ("main", None),
])
def test_a_version_is_judged_by_its_release_part(version, release):
    assert versions.release(version) == release


@pytest.mark.parametrize("version,support", [
    ("2.9.0a0+50eac811a6", Support.TESTED),  # sorts below 2.9.0 to pip, and is 2.9 to eft
    ("2.11.0a0+eb65b36914", Support.TESTED),
    ("2.15.0", Support.TESTED),
    ("2.16.0", Support.UNTESTED),
    ("2.8.0", Support.UNSUPPORTED),
    ("1.13.1", Support.UNSUPPORTED),
    (None, Support.UNSUPPORTED),
])
def test_torch_versions_against_the_tested_range(version, support):
    assert versions.judge(versions.TORCH, version).support is support


def test_megatron_core_is_optional_and_judged_by_its_minor():
    assert versions.judge(versions.MEGATRON_CORE, None, optional=True).support is Support.ABSENT
    assert versions.judge(versions.MEGATRON_CORE, "0.16.1").support is Support.UNSUPPORTED
    assert versions.judge(versions.MEGATRON_CORE, "0.17.0rc0").support is Support.TESTED
    assert versions.judge(versions.MEGATRON_CORE, "0.20.0").support is Support.UNTESTED


def shown_as(tmp_path: Path, version: str) -> dict:
    """An environment whose torch reports ``version`` to pip and to eft's check."""
    return reporting(tmp_path, "torch", version)


def eft_run(env: dict, *args: str, code: str = "from launcher.preflight import eft_run; eft_run()") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=180)


@pytest.mark.parametrize("old", ["2.8.0", "2.8.0a0+5228986c39", "2.4.1"])
def test_a_torch_older_than_the_range_costs_one_line_and_exit_2(tmp_path, old):
    done = eft_run(shown_as(tmp_path, old), "--standalone", "--nproc-per-node", "1", "train.py")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"eft-run: error: torch {old} is not supported: eft supports torch 2.9 to 2.15 (release part of the version)"]


def test_a_newer_torch_runs_with_one_line_saying_it_is_untested(tmp_path):
    script = tmp_path / "train.py"
    # one write per worker: unbuffered prints of two workers sharing the output interleave
    script.write_text("import os; os.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\".encode())\n")
    done = eft_run(shown_as(tmp_path, "2.16.0"), "--standalone", "--nproc-per-node", "2", str(script))
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if "untested" in line]
    assert warnings == ["eft-run: warning: torch 2.16.0 is newer than eft was tested with (torch 2.9 to 2.15): "
                        "running it untested"]
    assert "rank 1 of 2" in done.stdout + done.stderr


def test_a_newer_torch_that_moved_a_name_eft_relies_on_is_refused_by_name(tmp_path):
    """The seam's checks at import stand between an untested torch and a silent misbehaviour:
    here torch's rendezvous lost the step eft uses to leave a round without closing it."""
    moved = ("from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler as H\n"
             "del H._stop_heartbeats\n"
             "from launcher.preflight import eft_run; eft_run()")
    done = eft_run(shown_as(tmp_path, "2.16.0"), "--standalone", "--nproc-per-node", "1", "train.py", code=moved)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and "untested" in lines[0]
    assert lines[1].startswith(f"eft-run: error: torch {torch.__version__}: DynamicRendezvousHandler has no "
                               "_stop_heartbeats()")
    assert "Traceback" not in done.stderr


def test_eft_run_version_names_each_part_and_where_it_stands(tmp_path):
    done = eft_run(shown_as(tmp_path, "2.11.0a0+eb65b36914"), "--version")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()}
    assert set(rows) == {"eft", "Python", "torch", "megatron-core", "NVML"}
    assert "2.11.0a0+eb65b36914  tested (torch 2.9 to 2.15)" in rows["torch"]
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in rows["Python"]
    assert "not available" in rows["NVML"] or "driver" in rows["NVML"]
