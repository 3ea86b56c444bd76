"""``eft outcome``: a batch job's exit status is the training's outcome, not srun's.

    srun eft-run --rdzv-backend etcd-v3 --rdzv-endpoint "$ENDPOINT" "$@"; status=$?
    eft outcome --srun-status $status -- --rdzv-backend etcd-v3 --rdzv-endpoint "$ENDPOINT" "$@"
    status=$?   # 0 finished, 4 requeue, 3 stop (a person must look), 2 bad input, 1 failed

srun exits with its tasks' highest status, so a node lost on the way (its task killed: 137)
makes a job whose survivors trained to the end read "failed". The agent that decides how the
training ended records it in etcd (``contract.outcome``); this command, run by the batch
script after srun returns and before it stops the job's etcd, exits with that record's
status, or with srun's where there is none (etcd gone, every agent killed, a mistake before
any agent joined). It takes eft-run's own arguments after ``--`` and resolves the run from
them exactly as eft-run does (``--rdzv-id``, or SLURM's default; ``--rdzv-conf``'s key
prefix and TLS), so it reads the run that eft-run wrote.
"""

from __future__ import annotations

import os
from typing import NoReturn, Optional

import typer

from elasticft.config import ConfigError
from elasticft.contract.outcome import JobOutcome, job_status
from elasticft.slurm.defaults import derive
from elasticft.slurm.job import SlurmJob
from elasticft.store import StoreError, connect


def _fail(message: str) -> NoReturn:
    typer.echo(f"eft outcome: error: {message}", err=True)
    raise typer.Exit(2)


def _eft_run_args(argv: list[str]):
    """eft-run's arguments as eft-run parses them, SLURM's defaults applied; a mistake costs one line."""
    from launcher.eft_run import build_parser  # torch and the agent: not for every `eft` command

    try:
        parser = build_parser()
    except ConfigError as exc:  # a malformed EFT_* variable
        _fail(str(exc))
    parser.error = lambda message: _fail(f"eft-run's arguments: {message}")
    # --help: not a launch, and never a 0 for the job (argparse would print the help and exit 0)
    parser.print_help = lambda *_: None
    parser.exit = lambda *_: _fail("eft-run's arguments: expected those of a launch, got --help")
    args = parser.parse_args(argv)
    job = SlurmJob.from_environ(os.environ)
    if job is not None and args.eft_slurm:
        derive(args, job)
    return args, job


def _record(target) -> tuple[JobOutcome | None, str]:
    """The run's ``outcome`` (None if absent or unreadable) and, if etcd failed, why."""
    try:
        client = connect(target.store)
    except StoreError as exc:
        return None, f"could not read the outcome ({exc})"
    try:
        current = client.get(target.keys.outcome)
    except StoreError as exc:
        return None, f"could not read the outcome ({exc})"
    finally:
        client.close()
    if current is None:
        return None, ""
    try:
        return JobOutcome.from_json(current.value), ""
    except (ValueError, TypeError, KeyError) as exc:
        return None, f"a malformed {target.keys.outcome} ({exc})"


def outcome_command(
    ctx: typer.Context,
    srun_status: Optional[int] = typer.Option(None, "--srun-status", help="srun's exit status, the shell's $? "
                                              "(what the job exits with where etcd has no outcome of this attempt)"),
) -> None:
    """Exit with the training's outcome recorded in etcd (else --srun-status); eft-run's arguments follow --."""
    if srun_status is None:
        _fail("--srun-status: required: srun's exit status (the shell's $? after srun)")
    if not 0 <= srun_status <= 255:
        _fail(f"--srun-status: expected an exit status 0..255 (the shell's $?), got {srun_status}")
    if not ctx.args:
        _fail("expected eft-run's arguments after --, as given to eft-run (the run, its etcd)")
    args, job = _eft_run_args(ctx.args)
    from launcher.eft_run import USER_ERRORS, UsageError, run_target

    try:
        target = run_target(args)
    except (UsageError, *USER_ERRORS) as exc:
        _fail(f"eft-run's arguments: {exc}")
    if target is None:
        line = f"no etcd outlives eft-run's arguments (not etcd-v3 with --rdzv-endpoint): exit status " \
               f"{srun_status}, srun's"
        status = srun_status
    else:
        record, failure = _record(target) if job is not None else (None, "")
        status, line = job_status(record, job.attempt if job is not None else "", srun_status)
        if failure:
            line = f"{failure}: exit status {srun_status}, srun's"
    typer.echo(f"eft outcome: {line}", err=True)
    raise typer.Exit(status)


def register(app: typer.Typer) -> None:
    app.command("outcome", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
        outcome_command)
