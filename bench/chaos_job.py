"""One real elastic job for a chaos row: simulated nodes (eft-run agents) on one etcd
endpoint, training examples/minimal_train.py with checkpoints, every output line stamped
with the time it was read.

Rank 0 of the loop prints ``world size W, starting at step S`` at each start of the
workers, ``iteration N loss X`` after every step and ``step N loss X (saved...)`` after
each committed save; the rows' figures are read from those lines (bench/chaos_measure.py)
and from the checkpoint directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import psutil
import torch

from bench.launch import ROOT, Launched, eft_run, rdzv_command
from elasticft.contract.checkpoints import (
    COMPLETE_MARKER,
    TRACKER,
    iter_dir_name,
    iteration_of,
)

LOOP = ROOT / "examples" / "minimal_train.py"
STEP_SECONDS = 0.05  # the loop's compute per step: about 15 steps a second on a busy 2-core machine
SAVE_INTERVAL = 5  # steps between two saves: what a crash between saves re-does at most
MAX_RESTARTS = 3

START = re.compile(r"world size (\d+), starting at step (\d+)")
STEP = re.compile(r"iteration (\d+) loss")
SAVE = re.compile(r"step (\d+) loss \S+ \(saved")


@dataclass(frozen=True)
class Line:
    time: float  # when it was read (time.time())
    node: int  # index of the node whose output it is
    text: str


class TimedNode(Launched):
    """A simulated node whose output lines go, stamped, to ``sink`` as they are read (and to
    its log file, as Launched's do)."""

    def __init__(self, cmd: list[str], log_path: Path, sink: Callable[[str], None], env: dict):
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env={**os.environ, **env})
        self._reader = threading.Thread(target=self._read, args=(sink,), daemon=True)
        self._reader.start()

    def _read(self, sink: Callable[[str], None]) -> None:
        for raw in self.proc.stdout:
            self._log.write(raw)
            sink(raw.decode(errors="replace").rstrip("\n"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill_node()
        # The pipe ends once every process holding it has exited; one that outlived its
        # agent would hold it open, so the reader is not waited for long.
        self._reader.join(timeout=5)
        self._log.flush()

    def close(self) -> None:
        self.stop()
        self._log.close()


class ChaosJob:
    """``nodes`` agents of one run (``--nnodes 1:nodes``) on ``endpoint``, in ``workdir``."""

    def __init__(self, workdir: Path, endpoint: str, nodes: int, network=None, flags: tuple[str, ...] = ()):
        self.network = network  # a bench.netns.NetnsCluster: node i runs in its namespace (None: on loopback)
        self.flags = flags  # the row's own eft-run flags
        self.workdir = workdir
        self.save_dir = workdir / "ckpt"
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self.endpoint = endpoint
        self.nnodes = nodes
        self.run_id = f"chaos-{uuid.uuid4().hex[:8]}"
        self.lines: list[Line] = []
        self._lock = threading.Lock()
        self.nodes: list[TimedNode] = []
        self._launches = 0

    def command(self, index: int) -> list[str]:
        flags = ["--monitor-interval", "0.1", "--max-restarts", str(MAX_RESTARTS), *self.flags]
        if self.network is not None:  # the rendezvous names the node by its namespace's address
            flags += ["--local-addr", self.network.node_ip(index)]
        command = rdzv_command(eft_run(), str(LOOP), "--steps", "100000000", "--step-seconds", str(STEP_SECONDS),
                            "--save", str(self.save_dir), "--save-interval", str(SAVE_INTERVAL), "--log-interval", "1",
                            nnodes=f"1:{self.nnodes}", nproc=1, backend="etcd-v3", endpoint=self.endpoint,
                            run_id=self.run_id, flags=flags)
        return command if self.network is None else self.network.wrap(index, command)

    def launch(self, index: int | None = None) -> TimedNode:
        """Start node ``index`` (again, after it ended), or a new node; returns it."""
        index = len(self.nodes) if index is None else index
        self._launches += 1

        def sink(text: str, node: int = index) -> None:
            with self._lock:
                self.lines.append(Line(time.time(), node, text))

        # This checkout's eft, whatever the installed eft-run points at.
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        if self.network is not None:
            env.update(self.network.node_env())
        node = TimedNode(self.command(index), self.workdir / f"node{index}.{self._launches}.log", sink, env)
        if index == len(self.nodes):
            self.nodes.append(node)
        else:
            self.nodes[index].close()
            self.nodes[index] = node
        return node

    def start(self) -> None:
        for _ in range(self.nnodes):
            self.launch()

    # -- what the job said -------------------------------------------------------------

    def matching(self, pattern: re.Pattern, after: float = 0.0) -> list[tuple[Line, int, ...]]:
        """(line, its numbers...) of every line that ``pattern`` matches at its start, oldest first."""
        with self._lock:
            lines = list(self.lines)
        return [(line, *map(int, m.groups())) for line in lines
                if line.time >= after and (m := pattern.match(line.text))]

    def starts(self, after: float = 0.0) -> list[tuple[Line, int, int]]:
        """(line, world size, step resumed from) of each start of the workers."""
        return self.matching(START, after)

    def steps(self, after: float = 0.0) -> list[tuple[Line, int]]:
        return self.matching(STEP, after)

    def saves(self, after: float = 0.0) -> list[tuple[Line, int]]:
        return self.matching(SAVE, after)

    def rank0_node(self) -> int:
        """The node whose worker is rank 0 now (the one that printed the newest start)."""
        return self.starts()[-1][0].node

    def other_node(self) -> int:
        """A node that is not rank 0's."""
        return next(i for i in range(len(self.nodes)) if i != self.rank0_node())

    def output(self) -> str:
        with self._lock:
            return "\n".join(f"{line.time:.3f} node{line.node}: {line.text}" for line in self.lines)

    def running(self) -> list[int]:
        return [i for i, node in enumerate(self.nodes) if node.proc.poll() is None]

    # -- its processes and files -------------------------------------------------------

    def worker_pids(self, index: int) -> list[int]:
        """The training processes node ``index`` started."""
        try:
            children = psutil.Process(self.nodes[index].proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        pids = []
        for child in children:
            try:
                if str(LOOP) in child.cmdline():
                    pids.append(child.pid)
            except psutil.NoSuchProcess:
                pass
        return pids

    def tracked_iteration(self) -> int | None:
        """The iteration the checkpoint tracker names (what a resume tries first)."""
        try:
            return int((self.save_dir / TRACKER).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def complete_iterations(self) -> list[int]:
        found = (iteration_of(p.name) for p in self.save_dir.iterdir() if (p / COMPLETE_MARKER).is_file())
        return sorted((i for i in found if i is not None), reverse=True)

    def model_file(self, iteration: int) -> Path:
        return self.save_dir / iter_dir_name(iteration) / "model.pt"

    def loads(self, iteration: int) -> bool:
        """Whether checkpoint ``iteration`` is complete and its model file loads."""
        if iteration not in self.complete_iterations():
            return False
        try:
            torch.load(self.model_file(iteration), weights_only=True)
            return True
        except Exception:  # noqa: BLE001 - any failure to load is the answer
            return False

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
