"""What eft needs on a GPU machine that has Python 3.12 and torch but no network: its
dependencies' wheels, found by following each wheel's Requires-Dist, downloaded into one folder.

    python bench/gpu_wheels_deps.py .whl REQUIREMENT...

Each requirement (pyproject's, as written) is downloaded for CPython 3.12 on manylinux x86_64
with ``--no-deps``, and its own requirements (markers evaluated for that target, no extras) are
followed in turn. Not downloaded: torch and what torch itself brings (its Requires-Dist, read
from the torch installed here, and CUDA's nvidia-*/cuda-* packages): the GPU machine's torch must
stay as it is, and a second copy of its dependencies would be 6 GB of CUDA. Writes
``requirements.txt`` in the folder: what to install there, one requirement a line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

# The GPU machine's interpreter: the markers of every Requires-Dist are evaluated for it.
TARGET = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.0",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
# torch's own stack: on the GPU machine already, and never to be replaced there. nvidia-ml-py is
# not torch's: it is eft's NVML binding (pynvml), pure Python, and travels.
CUDA_PREFIXES = ("nvidia-", "cuda-")
NOT_CUDA = {"nvidia-ml-py"}


def applies(requirement: Requirement) -> bool:
    """Whether a Requires-Dist line applies to the target without extras."""
    return requirement.marker is None or requirement.marker.evaluate({**TARGET, "extra": ""})


def torch_brings() -> set[str]:
    """torch and every distribution its installed metadata requires, transitively: present
    wherever torch is (the versions may differ; what is there is used)."""
    found, todo = set(), ["torch"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        found.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # a dependency of torch that is not installed here: still torch's
        todo += [Requirement(line).name for line in requires if applies(Requirement(line))]
    return found


def skipped(name: str, provided: set[str]) -> bool:
    name = canonicalize_name(name)
    return name in provided or (name.startswith(CUDA_PREFIXES) and name not in NOT_CUDA) or name == "triton"


def requires_dist(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        headers = Parser().parsestr(archive.read(metadata).decode())
    return [Requirement(line) for line in headers.get_all("Requires-Dist") or []]


def wheels_by_name(folder: Path) -> dict[str, Path]:
    return {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in folder.glob("*.whl")}


def download(folder: Path, requirement: Requirement) -> None:
    # the specifier without markers: pip is asked for this target explicitly
    spec = f"{requirement.name}{requirement.specifier}"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM,
                    "--dest", str(folder), spec], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("requirements", nargs="+")
    args = parser.parse_args()
    provided = torch_brings()
    todo = [Requirement(r) for r in args.requirements]
    wanted: dict[str, set[str]] = {}  # name -> the specifiers its requirers ask for
    while todo:
        requirement = todo.pop(0)
        name = canonicalize_name(requirement.name)
        if skipped(name, provided) or not applies(requirement):
            continue
        if name in wanted:
            wanted[name].update(str(s) for s in requirement.specifier)
            continue
        if name not in wheels_by_name(args.folder):
            download(args.folder, requirement)
        wanted[name] = {str(s) for s in requirement.specifier}
        wheel = wheels_by_name(args.folder)[name]
        print(f"  {wheel.name}")
        todo += requires_dist(wheel)
    # What to install there, with every requirer's specifiers: a version the machine already has
    # is kept where it satisfies them all, else replaced from the folder.
    (args.folder / "requirements.txt").write_text(
        "".join(f"{name}{','.join(sorted(specs))}\n" for name, specs in wanted.items()))
    print(f"not carried (torch's, present with it): {', '.join(sorted(provided))}, nvidia-*, cuda-*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
