"""``eft``: the operator's command (plan, health, ckpt, top, status, simulate, report, etcd, outcome, flags,
doctor, metrics, kubernetes).

Each sub-command lives in its own module with a ``register(app)`` function; this
file only assembles them.
"""

from __future__ import annotations

import typer

from launcher import (
    ckpt_cmd,
    doctor_cmd,
    etcd_cmd,
    flags_cmd,
    health_cmd,
    kubernetes_cmd,
    metrics_cmd,
    outcome_cmd,
    plan_cmd,
    report_cmd,
    simulate_cmd,
    top_cmd,
)

app = typer.Typer(
    help="eft: tools for elastic, fault-tolerant Megatron training launched with eft-run.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """eft: tools for elastic, fault-tolerant Megatron training launched with eft-run."""


plan_cmd.register(app)
health_cmd.register(app)
ckpt_cmd.register(app)
top_cmd.register(app)
simulate_cmd.register(app)
report_cmd.register(app)
etcd_cmd.register(app)
outcome_cmd.register(app)
flags_cmd.register(app)
doctor_cmd.register(app)
metrics_cmd.register(app)
kubernetes_cmd.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
