"""Time for N agents to rendezvous: torchrun's c10d backend vs eft-run's etcd-v3.

Every agent runs one worker (``--nproc-per-node 1``) that only writes the time it
started, so the figure is launch -> all N workers started: agent start-up (the same
for both), rendezvous, rank assignment and worker spawn. Both run here, now, on the
same machine; the ratio is what matters.

  python bench/rendezvous.py [--sizes 2,8,32] [--repeats 1]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

from common import table
from launch import Launched, eft_run, rdzv_command, torchrun, wait_for

from elasticft.store import EmbeddedEtcd, free_port

WORKER = "import sys, time; open(sys.argv[1], 'a').write(f'{time.time()}\\n')"


def launch(n: int, launcher: list[str], backend: str, endpoint: str, work: Path) -> float:
    marks = work / "marks"
    cmd = rdzv_command(launcher, "python", "-c", WORKER, str(marks), nnodes=str(n), nproc=1, backend=backend,
                       endpoint=endpoint, run_id=uuid.uuid4().hex, flags=["--no-python"])
    started = time.time()
    nodes = [Launched(cmd, work / f"agent{i}.log") for i in range(n)]
    try:
        wait_for(lambda: marks.exists() and len(marks.read_text().split()) >= n, 600, f"{n} workers")
        last = max(float(t) for t in marks.read_text().split())
        for node in nodes:
            if node.wait(300) != 0:
                raise RuntimeError(f"agent failed, see {node.log_path}:\n{node.output()[-2000:]}")
        return last - started
    finally:
        for node in nodes:
            node.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,8,32")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rows = []
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="eft-bench-") as tmp:
        for n in [int(s) for s in args.sizes.split(",")]:
            c10d, eft = [], []
            for r in range(args.repeats):
                work = Path(tmp) / f"c10d-{n}-{r}"
                work.mkdir()
                c10d.append(launch(n, torchrun(), "c10d", f"127.0.0.1:{free_port()}", work))
                work = Path(tmp) / f"eft-{n}-{r}"
                work.mkdir()
                eft.append(launch(n, eft_run(), "etcd-v3", etcd.endpoint, work))
            best_c10d, best_eft = min(c10d), min(eft)
            rows.append([n, best_c10d, best_eft, best_eft / best_c10d])
            print(f"N={n}: torchrun c10d {best_c10d:.2f} s, eft-run etcd-v3 {best_eft:.2f} s", flush=True)
    print()
    print("launch -> all workers started, seconds (best of %d)" % args.repeats)
    print(table(["agents", "torchrun c10d", "eft-run etcd-v3", "eft/torchrun"], rows))


if __name__ == "__main__":
    main()
