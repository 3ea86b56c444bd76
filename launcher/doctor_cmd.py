"""``eft doctor``: the versions eft runs with here, and where each stands against what eft is
tested with (eft, Python, torch, megatron-core, NVML's driver and GPUs).

The first thing to run in a new container: it reads the versions without importing torch, so
it answers where torch itself is broken, and exits 2 where ``eft-run`` would refuse to start.
"""

from __future__ import annotations

import typer

from elasticft import versions
from launcher.version_report import version_lines


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    def doctor() -> None:
        """Print eft's, Python's, torch's, megatron-core's and NVML's versions and whether each is tested."""
        typer.echo("\n".join(version_lines()))
        torch = versions.judge(versions.TORCH, versions.installed(versions.TORCH))
        if versions.python_problem() or torch.support is versions.Support.UNSUPPORTED:
            raise typer.Exit(2)
