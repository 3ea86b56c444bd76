"""``eft-run``: torchrun with an etcd v3 rendezvous and a fault-tolerant agent.

The argument parser *is* torchrun's (``torch.distributed.run.get_args_parser``), with
eft's own ``--eft-*`` flags added, so every torchrun flag, spelling and ``PET_*``
variable behaves identically. The launch itself is torchrun's too
(``torch.distributed.run.run``); eft only

* starts an embedded etcd for ``--standalone`` (or etcd-v3 without an endpoint),
* checks the etcd options up front so that mistakes cost one line, not a traceback,
* has torch's ``launch_agent`` build ``FTElasticAgent`` instead of ``LocalElasticAgent``,
* exports ``EFT_RUN_ID`` and ``EFT_ENDPOINT`` to the workers,
* exits with ``elasticft.contract.exit_codes.ExitCode``: torchrun's statuses, plus
  ``NO_PROGRESS`` when restart cycles made no progress (a one-line reason, no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import hashlib
import json
import logging
import os
import signal
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
)
from torch.distributed.run import get_args_parser, parse_min_max_nnodes
from torch.distributed.run import run as torchrun_run

from elasticft.agent.agent import FTElasticAgent
from elasticft.agent.context import EtcdTarget
from elasticft.agent.restart_budget import NoProgress
from elasticft.config import ConfigError, Settings
from elasticft.contract.exit_codes import ExitCode
from elasticft.contract.keys import RunKeys
from elasticft.contract.local_runs import LocalRuns, default_runs_dir
from elasticft.contract.outcome import JobOutcome
from elasticft.contract.records import COMMAND_ATTEMPT
from elasticft.megatron_bridge.mode import worker_environment as megatron_bridge_environment
from elasticft.megatron_lm.mode import worker_environment as megatron_lm_environment
from elasticft.planner.layout import NoLegalLayout
from elasticft.rendezvous import plugin as torchrun_plugin
from elasticft.rendezvous.backend import (
    EtcdRendezvousOptions,
    RendezvousConfigError,
    close_watches,
)
from elasticft.kubernetes.pod import JobSetPod
from elasticft.slurm.job import SlurmJob
from elasticft.rendezvous.reuse import prepare_run
from elasticft.store import EmbeddedEtcd, EtcdNotFound, StoreError, StoreUnavailable, connect
from elasticft.torch_seam import agent_class_swapped, check_in_at_exit, parse_rendezvous_config
from launcher import ft_launcher_flags
from launcher.entry_check import missing_entry
from launcher.version_report import version_lines
from launcher.finished_job import finished_before_join, finished_on, nothing_to_do, spare_status
from launcher.kubernetes_setup import apply_jobset
from launcher.segment_setup import resolve_segments
from launcher.slurm_setup import apply_slurm

log = logging.getLogger("elasticft")

USER_ERRORS = (ConfigError, RendezvousConfigError, StoreError, EtcdNotFound, RendezvousError, NoLegalLayout)


class UsageError(ValueError):
    """A flag torchrun would reject with a traceback; eft says it in one line."""


def build_parser():
    parser = get_args_parser()
    parser.prog = "eft-run"
    parser.description = (
        "eft-run: a drop-in torchrun with an etcd v3 rendezvous, node leases and "
        "fault-tolerant restarts. All torchrun flags work unchanged."
    )
    Settings.add_arguments(parser)
    ft_launcher_flags.add_arguments(parser)
    parser.add_argument("--version", action=_PrintVersions, nargs=0,
                        help="print eft's, Python's, torch's, megatron-core's and NVML's versions and exit")
    parser.epilog = ExitCode.describe()
    return parser


class _PrintVersions(argparse.Action):
    """``--version`` anywhere before the script (first, eft-run answers it before torch loads)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print("\n".join(version_lines()))
        parser.exit()


def _check_torchrun_args(args) -> dict[str, str]:
    """Validate what torchrun would assert on; returns the parsed --rdzv-conf."""
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        raise UsageError(f"--nnodes: expected N or MIN:MAX, got {args.nnodes!r}") from None
    if not 0 < min_nodes <= max_nodes:
        raise UsageError(f"--nnodes: expected 0 < MIN <= MAX, got {args.nnodes!r}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts: expected >= 0, got {args.max_restarts}")
    try:
        return parse_rendezvous_config(args.rdzv_conf)
    except ValueError:
        raise UsageError(f"--rdzv-conf: expected KEY=VALUE[,KEY=VALUE...], got {args.rdzv_conf!r}") from None


def _check_memory_tier(args, settings: Settings) -> None:
    """Replicas need other nodes: more than --nnodes allows is a mistake, on one node a warning."""
    memory = settings.memory
    if not memory.enabled:
        return
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    if max_nodes == 1 and memory.mem_ckpt_replicas:
        log.warning("--eft-mem-ckpt-replicas %d: a one-node job has no peer to hold a replica; its memory "
                    "checkpoints serve worker restarts, not the loss of the node", memory.mem_ckpt_replicas)
    elif memory.mem_ckpt_replicas > max_nodes - 1:
        raise UsageError(f"--eft-mem-ckpt-replicas {memory.mem_ckpt_replicas}: needs at least "
                         f"{memory.mem_ckpt_replicas + 1} nodes, --nnodes {args.nnodes} allows at most {max_nodes}")


def _etcd_target(args, rdzv_conf: dict[str, str]) -> tuple[EtcdTarget, float | None]:
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    params = RendezvousParameters(
        backend=args.rdzv_backend,
        endpoint=args.rdzv_endpoint,
        run_id=args.rdzv_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        **rdzv_conf,
    )
    options = EtcdRendezvousOptions.from_params(params)
    return EtcdTarget(options.store, RunKeys(args.rdzv_id, options.key_prefix), _attempt(args)), options.lease_ttl


def run_target(args) -> EtcdTarget | None:
    """The etcd run these parsed eft-run arguments name, as eft-run resolves it (SLURM's defaults
    applied first); None without one: another backend, or an embedded etcd not started yet."""
    if args.standalone or args.rdzv_backend != "etcd-v3" or not args.rdzv_endpoint:
        return None
    return _etcd_target(args, _check_torchrun_args(args))[0]


def _attempt(args) -> str:
    """This launch's identity (NodeRecord.attempt): the SLURM job attempt, the JobSet attempt; under torchrun's
    default run id 'none', a digest of the command (nodes of one job run it alike, a second
    job sharing 'none' by mistake most likely not); else none: nodes join by run id alone."""
    job = SlurmJob.from_environ(os.environ)
    if job is not None:
        return job.attempt
    try:
        pod = JobSetPod.from_environ(os.environ)
    except ValueError:  # refused before, unless --eft-kubernetes false: then no pod
        pod = None
    if pod is not None:
        return pod.attempt  # a restarted JobSet is a new attempt, even under a run id of the user's
    if args.rdzv_id != "none":
        return ""
    command = json.dumps([args.nnodes, args.nproc_per_node, args.training_script, args.training_script_args])
    return COMMAND_ATTEMPT + hashlib.sha256(command.encode()).hexdigest()[:12]


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[eft] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False


def run(args, settings: Settings) -> ExitCode:
    """Launch; the exit status of a launch that ended without an exception."""
    missing = missing_entry(args)  # before an etcd, a rendezvous and workers that would all fail
    if missing:
        raise UsageError(missing)
    settings = apply_jobset(args, settings)  # a JobSet pod's run id, size, etcd Service, address and name
    apply_slurm(args, settings, lambda: run_target(args))  # the etcd its agents share the time limit through
    rdzv_conf = _check_torchrun_args(args)
    _check_memory_tier(args, settings)
    settings = resolve_segments(args, settings)  # --eft-segment: this node's domain
    # Workers inherit the launcher's environment: eft's boot directory for a Megatron-LM or Bridge script.
    loop = megatron_bridge_environment(settings.megatron_lm.megatron_bridge, args.training_script, args.module,
                                       args.no_python)
    if not loop:
        loop = megatron_lm_environment(settings.megatron_lm.megatron_lm, args.training_script,
                                       args.training_script_args, args.module, args.no_python)
    os.environ.update(loop)
    torchrun_plugin.register()
    embedded = noted = None
    try:
        wants_embedded = args.standalone or (args.rdzv_backend == "etcd-v3" and not args.rdzv_endpoint)
        if wants_embedded:
            embedded = EmbeddedEtcd(settings.ft.etcd_binary).start()
            if args.standalone:
                args.standalone = False
                args.rdzv_id = str(uuid.uuid4())
            args.rdzv_backend = "etcd-v3"
            args.rdzv_endpoint = embedded.endpoint
            log.info("embedded etcd on %s (run id %s)", embedded.endpoint, args.rdzv_id)

        target = None
        if args.rdzv_backend == "etcd-v3":
            target, conf_ttl = _etcd_target(args, rdzv_conf)
            if conf_ttl is not None:
                settings = dataclasses.replace(settings, ft=dataclasses.replace(settings.ft, lease_ttl=conf_ttl))
            else:
                # one lease TTL for the node record and the rendezvous keys: a lost node
                # leaves both at the same moment
                args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"lease_ttl={settings.ft.lease_ttl:g}"]))
            # one knob, two spellings: --rdzv-conf NAME=... wins, else the agent's value goes to the handler
            # (the outage limit serves the rendezvous and registering again after a fence)
            for name in ("etcd_outage_limit", "peer_probe_timeout"):
                if name in rdzv_conf:  # validated with the rest of --rdzv-conf
                    ft = dataclasses.replace(settings.ft, **{name: float(rdzv_conf[name])})
                    settings = dataclasses.replace(settings, ft=ft)
                else:
                    args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"{name}={getattr(settings.ft, name):g}"]))
            os.environ["EFT_RUN_ID"] = args.rdzv_id
            os.environ["EFT_ENDPOINT"] = args.rdzv_endpoint
            noted = _note_run(target, settings)
            if embedded is None:
                if args.rdzv_id == "none":
                    log.warning("--rdzv-id not given: this job's run id is torchrun's default 'none', shared by "
                                "every job on this etcd that does not name one")
                finished = _prepare_run(target, settings)
                if finished is not None:
                    return nothing_to_do(finished, args.rdzv_id)

        with agent_class_swapped(functools.partial(_made_agent, settings=settings, etcd=target)):
            try:
                torchrun_run(args)
            except RendezvousClosedError:
                finished = finished_before_join(target, wait=settings.ft.lease_ttl + 5) if target else None
                if finished is None:
                    raise
                return nothing_to_do(finished, args.rdzv_id)
        # A node that started no workers (a spare; one that waited to join) ended with the others: the job says how.
        if _AGENTS and not any(worker.id for worker in _AGENTS[-1].get_worker_group().workers):
            return spare_status(target, wait=settings.ft.lease_ttl + 5)
        return _status_after_stop()
    finally:
        if noted is not None:
            noted.unlink(missing_ok=True)
        close_watches()
        if embedded is not None:
            embedded.stop()


def _note_run(target: EtcdTarget, settings: Settings) -> Path | None:
    """This host's note of the run, for `eft top`/`eft ckpt` without flags (contract/local_runs.py)."""
    job = SlurmJob.from_environ(os.environ)
    try:
        return LocalRuns(settings.ft.runs_dir or None).register(
            target.keys.run_id, target.store.endpoints, target.keys.prefix, job.job_id if job else "")
    except OSError as exc:  # a convenience: the job runs without it
        log.warning("--eft-runs-dir: cannot note the run in %s (%s): `eft top` here needs --endpoint and --run-id",
                    settings.ft.runs_dir or default_runs_dir(), exc)
        return None


_AGENTS: list[FTElasticAgent] = []  # the agent torch's launch made (one per eft-run)


def _made_agent(*args, **kwargs) -> FTElasticAgent:
    _AGENTS.append(FTElasticAgent(*args, **kwargs))
    return _AGENTS[-1]


def _status_after_stop() -> ExitCode:
    """0, or REQUEUE when the workers saved and stopped for a preemption or a time limit."""
    status = ExitCode.after_stop(_AGENTS[-1].stop_reason if _AGENTS else None)
    if status is ExitCode.REQUEUE:
        print(f"eft-run: the workers saved and stopped ({_AGENTS[-1].stop_reason}): exit status "
              f"{int(status)}, requeue to go on", file=sys.stderr)
    return status


def _leave_exit_barrier() -> None:
    """A signal reached this node alone (a pod deleted, a node drained): the other nodes'
    workers stopped with the same save and wait at torch's exit barrier; count this node in
    there, or they wait its 300 s for a node that is gone."""
    try:
        check_in_at_exit(_AGENTS[-1])
    except Exception as exc:  # noqa: BLE001 - the store may have gone with its host: the others' wait ends then
        log.debug("could not check in at the exit barrier: %s", exc)


def _prepare_run(target: EtcdTarget, settings: Settings) -> JobOutcome | None:
    """A run id used before: reset an ended attempt's keys, refuse a live job's (reuse.py). Where
    this very attempt's training finished already, nothing is reset: its outcome is returned
    (this node came after the end: finished_job.py)."""
    try:
        client = connect(target.store)
    except StoreUnavailable:
        return None  # etcd not up yet: the rendezvous waits for it (up to its join timeout); nothing to reuse
    try:
        finished = finished_on(client, target)
        if finished is None:
            prepare_run(client, target.keys, target.attempt, linger=2 * settings.ft.lease_ttl + 5)
        return finished
    finally:
        client.close()


def main(argv: list[str] | None = None) -> None:
    """eft-run's entry (after preflight). Workers that failed for good end the launch with
    torch's root-cause summary (rank, exit code, error file), not a traceback of eft-run's
    own frames: they are where the user looks, ours say nothing about the failure."""
    try:
        _launch(argv)
    except ChildFailedError as exc:  # torch's @record has written the error file for a parent launcher
        print(f"eft-run: error: the workers failed{exc.format_msg()}", file=sys.stderr)
        sys.exit(int(ExitCode.FAILED))


@record
def _launch(argv: list[str] | None) -> None:
    faulthandler.enable()  # an agent that crashes in native code (gRPC, gloo) says where, in its log
    try:
        parser = build_parser()
    except ConfigError as exc:  # a malformed EFT_* variable
        print(f"eft-run: error: {exc}", file=sys.stderr)
        sys.exit(int(ExitCode.USAGE))
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_args(args)
        if settings.ckpt.kill_switch_present():
            # A queued job (e.g. a SLURM array) burns through at once instead of working.
            print(f"eft-run: kill switch {settings.ckpt.kill_switch} is present; not starting", file=sys.stderr)
            return
        _setup_logging(settings.ft.log_level)
        settings = ft_launcher_flags.apply(args, settings)  # an ft_launcher command line, launcher renamed
        status = run(args, settings)
        if status:
            sys.exit(int(status))
    except ChildFailedError:
        raise
    except NoProgress as exc:  # "do not requeue", distinct from a failure (docs/restarts.md)
        print(f"eft-run: {exc}", file=sys.stderr)
        sys.exit(int(exc.exit_code))
    except SignalException as exc:
        print(f"eft-run: stopped by {signal.Signals(exc.sigval).name}", file=sys.stderr)
        # Workers that saved before they stopped: the job can go on from there.
        status = _status_after_stop()
        if status is ExitCode.REQUEUE:
            _leave_exit_barrier()
        sys.exit(int(status) or 128 + int(exc.sigval))
    except KeyboardInterrupt:
        print("eft-run: interrupted", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except (UsageError, *USER_ERRORS) as exc:
        # Some of torch's rendezvous errors carry no message: name them at least.
        log.debug("the error's traceback (for eft's developers)", exc_info=True)
        print(f"eft-run: error: {str(exc) or _describe(exc)}", file=sys.stderr)
        sys.exit(int(ExitCode.USAGE))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, RendezvousClosedError):
        return "the rendezvous was closed: another node's agent failed or the job finished"
    return type(exc).__name__


if __name__ == "__main__":
    main()
