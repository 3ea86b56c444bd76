"""Which of .whl/requirements.txt this Python can install: bench/gpu_check.sh's setup.

    python bench/gpu_check_install.py .whl > requirements-here.txt

.whl/ holds wheels for CPython 3.12 (the GPU machine's). A requirement whose wheel is built for
another CPython (a dry run on 3.11) and whose package this Python already has is left out, with
a line on stderr: the installed one is used. Everything else is kept, for pip to install or to
find satisfied. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

HERE = sys.version_info[:2]


def name_of(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def fits(wheel: Path) -> bool:
    """Whether the wheel's Python and ABI tags accept this interpreter (the platform is the
    GPU machine's: manylinux x86_64, as here)."""
    python, abi = wheel.stem.split("-")[-3:-1]
    if abi == "abi3":  # the stable ABI: this CPython or any later one
        return any(HERE >= (3, int(tag[3:])) for tag in python.split(".") if tag.startswith("cp3"))
    if abi == "none":  # pure Python: py3, py2.py3
        return True
    return f"cp{HERE[0]}{HERE[1]}" in python.split(".")


def main() -> int:
    folder = Path(sys.argv[1])
    wheels = {canonical(w.name.split("-")[0]): w for w in folder.glob("*.whl")}
    for line in (folder / "requirements.txt").read_text().splitlines():
        name = canonical(name_of(line))
        wheel = wheels.get(name)
        if wheel is not None and not fits(wheel):
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                version = None
            if version is not None:
                print(f"gpu_check: {wheel.name} is for another Python; using the installed {name} {version}",
                      file=sys.stderr)
                continue
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
