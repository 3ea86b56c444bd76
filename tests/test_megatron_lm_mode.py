"""Which jobs eft enters Megatron-LM's loop for, decided at launch (elasticft/megatron_lm/mode.py),
and the mistakes stopped there in one line."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.launch import eft_run
from elasticft import megatron_seam as seam
from elasticft.config import ConfigError
from elasticft.megatron_lm.mode import BOOT_DIR, worker_environment
from tests.version_shadow import reporting

PRETRAIN = "from megatron.training import get_args, pretrain\n\nif __name__ == '__main__':\n    pretrain()\n"
OWN_LOOP = "import torch\nfrom megatron.core import parallel_state\n"


@pytest.fixture
def in_range(monkeypatch):
    """The installed megatron-core counts as tested, whichever this lane has."""
    monkeypatch.setattr(seam, "installed_version", lambda: "0.19.2")


def script(tmp_path: Path, text: str, name: str = "train.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_auto_puts_the_boot_first_on_the_workers_path_for_a_megatron_training_script(tmp_path, in_range, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/site/own")
    env = worker_environment("auto", script(tmp_path, PRETRAIN), [])
    assert env["PYTHONPATH"].split(":") == [str(BOOT_DIR), "/site/own"]
    assert (BOOT_DIR / "sitecustomize.py").is_file()


def test_auto_follows_the_scripts_own_modules_beside_it(tmp_path, in_range):
    script(tmp_path, "from megatron import training\n", name="model_provider.py")
    assert worker_environment("auto", script(tmp_path, "import model_provider\n"), [])


def test_auto_leaves_a_script_with_its_own_loop_alone(tmp_path, in_range):
    assert worker_environment("auto", script(tmp_path, OWN_LOOP), []) == {}
    assert worker_environment("off", script(tmp_path, PRETRAIN), []) == {}


def test_on_for_a_script_that_does_not_use_megatron_training_is_refused(tmp_path, in_range):
    with pytest.raises(ConfigError, match=r"--eft-megatron-lm on: .*train.py does not import megatron.training"):
        worker_environment("on", script(tmp_path, OWN_LOOP), [])


def test_enable_ft_package_is_refused_where_eft_cannot_take_nvrxs_place(tmp_path, in_range):
    """Inside Megatron's loop eft takes the rank monitor's place; outside it nothing would."""
    with pytest.raises(ConfigError, match=r"--enable-ft-package: .*\(--eft-megatron-lm off\): drop --enable-ft-package"):
        worker_environment("off", script(tmp_path, PRETRAIN), ["--enable-ft-package", "--save", "x"])
    assert worker_environment("auto", script(tmp_path, PRETRAIN), ["--enable-ft-package", "--save", "x"])


@pytest.mark.parametrize("version", ["0.16.1", pytest.param(None, marks=pytest.mark.seam, id="installed")])
def test_a_megatron_core_outside_the_tested_range_stops_eft_run_in_one_line(tmp_path, version):
    """A megatron-core older than 0.17 (0.16 has no megatron.training; here the installed one
    reports 0.16.1), or the lane's own where it is outside the range: eft-run names it and
    exits 2 before starting any worker."""
    env = reporting(tmp_path, "megatron-core", version) if version else None
    version = version or seam.installed_version()
    if seam.version_problem(version) is None:
        pytest.skip(f"this lane's megatron-core {version} is in the tested range")
    done = subprocess.run([*eft_run(), "--standalone", "--nproc-per-node", "1", script(tmp_path, PRETRAIN)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == (f"eft-run: error: --eft-megatron-lm: megatron-core {version} is outside the range eft's "
                         f"Megatron-LM mode was tested with (0.17.x, 0.18.x, 0.19.x); use --eft-megatron-lm off to run "
                         f"{tmp_path / 'train.py'} without eft in its loop")
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_a_bad_mode_is_one_line(tmp_path):
    done = subprocess.run([*eft_run(), "--standalone", "--eft-megatron-lm", "maybe", script(tmp_path, OWN_LOOP)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--eft-megatron-lm: expected auto, on or off, got 'maybe'" in done.stderr.strip().splitlines()[-1]


def test_the_boot_runs_the_sitecustomize_it_shadows(tmp_path):
    """A site's own sitecustomize still runs in a worker whose path eft's boot heads."""
    own = tmp_path / "site"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = 'yes'\n")
    done = subprocess.run([sys.executable, "-c", "import os, sys; print(os.environ.get('SITE_RAN'))"],
                          env={"PYTHONPATH": f"{BOOT_DIR}:{own}", "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "yes", done.stderr


def test_ft_launchers_section_timeouts_are_efts_in_each_spelling():
    from launcher import ft_launcher_flags
    from launcher.eft_run import build_parser
    from elasticft.config import Settings

    for spelling in ("--ft-param-rank_section_timeouts", "--ft-rank-section-timeouts", "--ft-rank_section_timeouts"):
        args = build_parser().parse_args([f"{spelling}=setup:60,step:7", "--ft-rank-out-of-section-timeout", "30",
                                          "--ft-initial-rank-heartbeat-timeout", "900", "train.py"])
        hang = ft_launcher_flags.apply(args, Settings.from_args(args)).hang
        assert hang.section_timeouts() == {"setup": 60.0, "step": 7.0, "checkpointing": 420.0, "other": 30.0}


def test_a_malformed_ft_timeout_is_one_line(tmp_path):
    done = subprocess.run([*eft_run(), "--standalone", "--ft-param-rank_section_timeouts=step180",
                           script(tmp_path, OWN_LOOP)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "eft-run: error: --ft-rank-section-timeouts: expected SECTION:SECONDS,..., got 'step180'")
