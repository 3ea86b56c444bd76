"""eft installs into the environment a user already has and changes nothing of its torch.

Run in every lane, against that lane's torch: CI's NGC-style lane has a torch that reports
``2.11.0a0+eb65b36914`` (a pre-release to pip, below 2.11.0), as NVIDIA's containers do. pip is
asked what it would do with the installed eft's requirements (the GPT example's extra too), as a
user's ``pip install`` would: it must find every torch, CUDA and Triton package already there.
The lane's setup (``.ci/setup_torch``) installs eft's built wheel for real, and compares the
listings before and after.
"""

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from elasticft import versions

pytestmark = pytest.mark.seam
KEPT = ("torch", "triton", "nvidia-")  # what a container's torch brings (not nvidia-ml-py: eft's own)


def eft_requirements(extra: str) -> list[str]:
    """What pip installs for ``elasticft[extra]``: the installed distribution's own metadata."""
    wanted = []
    for line in importlib.metadata.requires("elasticft") or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
            requirement.marker = None
            wanted.append(str(requirement))
    return wanted


def test_pip_keeps_the_installed_torch_when_it_installs_eft():
    wanted = eft_requirements("gpt")
    assert any(r.startswith("torch") for r in wanted) and any(r.startswith("megatron-core") for r in wanted)
    # Without a constraints file: a user's registry caps no torch; this machine's pip config caps it
    # at 2.14.1 (its comment says so), which would make pip "replace" a newer torch for that reason.
    asked = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", *wanted],
                           capture_output=True, text=True, timeout=200, env={**os.environ, "PIP_CONSTRAINT": os.devnull})
    assert asked.returncode == 0, asked.stderr[-2000:]
    would = [item["metadata"]["name"].lower() for item in json.loads(asked.stdout)["install"]]
    assert not [name for name in would if name.startswith(KEPT) and name != "nvidia-ml-py"], \
        f"pip would install {would} over torch {versions.installed(versions.TORCH)}"
