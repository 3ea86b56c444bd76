"""A restore reads, per node, only what its new ranks' load plans need: megatron-core GPT on
CPU/gloo, the agents' own memory tiers (``MemoryTier`` on the session's etcd, real shard
servers on 127.0.0.1) and real worker processes, without the rest of the launcher.

Four one-GPU "nodes" train at TP2 x PP2, a memory snapshot every iteration, each node's part
replicated to one other node; the job stops after iteration STOP. Then the first two nodes start
it again at TP2 x PP1 and at TP1 x PP1 x DP2 while the other two stay up (they serve what they
hold). Each time every node's ranks must have read from other nodes no more than the bytes of
the storage items their load plans asked for in files the node holds no copy of, plus 10 %
(counted by the servers that served them), and the losses go on as an uninterrupted TP2 x PP2
run's. A byte flipped in every copy of a range a rank reads refuses that iteration (the worker
names the file and range to its agent) and the one before is loaded instead.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.launch import read_jsonl
from elasticft.contract.keys import RunKeys
from elasticft.contract.memory import CHUNKS_SUFFIX, ChunkTable, is_shard_file
from elasticft.contract.run_dir import OutboxKind
from elasticft.memckpt.index import MemIndex
from elasticft.store import StoreOptions, connect
from tests.gloo_job import take_outbox
from tests.memckpt_parts import make_node
from tests.reference_runs import LR_DECAY_ITERS, tp2_pp2_losses
from tests.test_demo import EXAMPLE, load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ITERS, STOP = 10, 6  # the first job snapshots every iteration and exits after STOP
ROOT = Path(__file__).resolve().parents[1]
MARGIN = 1.10  # what a node may read from others, against what its ranks' plans need from them


def gpt(tp: int, pp: int, micro: int, log_file: Path, *extra: str) -> list[str]:
    return [str(EXAMPLE / "train.py"), *load("demo").MODEL, "--train-iters", str(ITERS), *LR_DECAY_ITERS, "--micro-batch-size",
            str(micro), "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--log-file", str(log_file), *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(nodes, args: list[str], out: Path, interval: int) -> None:
    """One worker process per node (one GPU each), as eft-run starts them, until they all exit."""
    port, procs = free_port(), []
    for rank, node in enumerate(nodes):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(nodes)), "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "EFT_RUN_DIR": str(node.run_dir), "EFT_MEM_CKPT_WRITE_DIR": str(node.mem_dir),
               "EFT_MEM_CKPT_INTERVAL": str(interval), "EFT_NODE_ID": node.node_id, "EFT_EXIT_SIGNALS": ""}
        log = open(out / f"rank{rank}.log", "wb")  # noqa: SIM115 - the child owns it until it exits
        procs.append((subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                       cwd=ROOT), log))
    try:
        for rank, (proc, _) in enumerate(procs):
            assert proc.wait(400) == 0, (out / f"rank{rank}.log").read_text()[-4000:]
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The losses of an uninterrupted run at TP2 x PP2 (a run's first layout decides its curve),
    shared with test_mem_ckpt_e2e (tests/reference_runs.py)."""
    return tp2_pp2_losses(tmp_path_factory)


@pytest.fixture(scope="module")
def saved(etcd_server, tmp_path_factory):
    """Four nodes' tiers holding the memory snapshots of a TP2 x PP2 job that stopped after STOP."""
    root = tmp_path_factory.mktemp("cluster")
    client = connect(StoreOptions(etcd_server.endpoint))
    keys = RunKeys(f"ranges-{os.getpid()}")
    nodes = [make_node(client, keys, root, f"n{r}", r, timeout=30) for r in range(4)]
    try:
        for node in nodes:
            node.tier.set_members({m.node_id: "" for m in nodes})
            node.start_workers({m.node_id for m in nodes})
        run_ranks(nodes, gpt(2, 2, 8, root / "first.jsonl", "--exit-interval", str(STOP)), root, interval=1)
        saved = []
        for node in nodes:  # what each agent hears from its workers' outbox
            for message in take_outbox(node.run_dir):
                if message["type"] == OutboxKind.MEM_SAVED:
                    node.tier.on_saved(message["iteration"], message["path"])
                    saved.append(message["iteration"])
        for _ in range(2):  # the origins' pushes, then the receipts the holders queued
            for node in nodes:
                assert node.tier.flush(60)
        newest, before = sorted(set(saved))[-1:-3:-1]
        yield nodes, MemIndex(client, keys), newest, before
    finally:
        for node in nodes:
            node.tier.close()
        client.close()


def restore(saved, out: Path, tp: int, pp: int, micro: int) -> tuple[dict, dict, dict]:
    """n0 and n1 start the job again at TP x PP (DP from the world of two), n2 and n3 alive:
    (what each node's ranks said they read, the bytes the servers served to each node, the outbox)."""
    nodes, _, _, _ = saved
    for node in nodes[:2]:
        node.start_workers({n.node_id for n in nodes})
    before = [n.tier.served() for n in nodes]  # the agents' own fetches of the checkpoint-wide files: done
    out.mkdir()
    run_ranks(nodes[:2], gpt(tp, pp, micro, out / "train.jsonl"), out, interval=1000)
    served = {}
    for node, earlier in zip(nodes, before):
        for asker, count in node.tier.served().items():
            served[asker] = served.get(asker, 0) + count - earlier.get(asker, 0)
    told = {node.node_id: take_outbox(node.run_dir) for node in nodes[:2]}
    read = {node: next(m for m in messages if m["type"] == OutboxKind.RESTORED) for node, messages in told.items()}
    return read, served, told


def assert_same_losses(out: Path, reference: dict[int, float], resumed: int) -> None:
    steps = {r["iteration"]: r["loss"] for r in read_jsonl(out / "train.jsonl") if r["event"] == "iteration"}
    assert set(steps) == set(range(resumed + 1, ITERS + 1))
    for iteration, loss in steps.items():
        assert loss == pytest.approx(reference[iteration], abs=1e-4), iteration


def whole_share(index: MemIndex, iteration: int, node: str) -> int:
    """What a node fetched at a restart before ranges: every shard file of the iteration it held no copy of."""
    return sum(size for p in index.parts() if p.iteration == iteration and node not in p.holders
               for name, (size, _) in p.files.items() if is_shard_file(name))


@pytest.mark.parametrize("tp, pp, micro", [(2, 1, 8), (1, 1, 4)], ids=["TP2xPP1", "TP1xPP1xDP2"])
def test_each_node_reads_only_its_new_ranks_share_and_training_goes_on_as_uninterrupted(
        saved, reference, tmp_path, tp, pp, micro):
    _, index, newest, _ = saved
    read, served, _ = restore(saved, tmp_path / "run", tp, pp, micro)
    for node, message in read.items():
        counts = message["read"]
        print(f"TP{tp}xPP{pp}: {node} needed {counts['needed']} B ({counts['needed_remote']} B held elsewhere), "
              f"read {counts['local']} B here, servers sent it {served.get(node, 0)} B; before ranges it fetched "
              f"{whole_share(index, newest, node)} B")
        assert (message["source"], message["iteration"], counts["ranks"]) == ("memory", newest, 1)
        assert served.get(node, 0) == counts["fetched"]  # what the servers counted is what the rank received
        assert 0 < counts["needed_remote"] and served[node] <= MARGIN * counts["needed_remote"]
        if tp * pp == 2:  # one TP rank reads half the model: half of what the whole checkpoint's assembly moved
            assert served[node] < 0.75 * whole_share(index, newest, node)
    assert set(served) <= {"n0", "n1"}  # the spare nodes read nothing
    assert_same_losses(tmp_path / "run", reference, newest)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_flipped_byte_in_every_copy_of_a_range_a_rank_reads_refuses_that_iteration(saved, reference, tmp_path):
    nodes, index, newest, before = saved
    (part,) = [p for p in index.parts() if p.iteration == newest and p.node == "n2"]  # pipeline stage 1, TP rank 0
    (name,) = [n for n in part.files if is_shard_file(n)]
    copies = [(nodes[int(h[1:])].tier.node_dir.own_part(newest) if h == part.node else
               nodes[int(h[1:])].tier.node_dir.held_part(part.node, newest)) / name for h in part.holders]
    assert len(copies) == 2
    table = ChunkTable.from_json(copies[0].with_name(name + CHUNKS_SUFFIX).read_bytes())
    offset = table.size // 2  # inside a storage item: TP rank 0 at TP2 x PP1 reads all of stage 1's
    chunk = next(c for c in table.chunks if c[0] <= offset < c[0] + c[1])
    for copy in copies:
        flip(copy, offset)
    try:
        read, _, told = restore(saved, tmp_path / "run", 2, 1, 8)
    finally:
        for copy in copies:
            flip(copy, offset)
    assert {(m["source"], m["iteration"]) for m in read.values()} == {("memory", before)}
    (fallback,) = [m for m in told["n0"] if m["type"] == OutboxKind.MEM_FALLBACK]  # from global rank 0 only
    assert not [m for m in told["n1"] if m["type"] == OutboxKind.MEM_FALLBACK]
    assert (fallback["iteration"], fallback["file"], fallback["range"]) == (newest, name, [chunk[0], chunk[0] + chunk[1]])
    assert "checksum mismatch" in fallback["why"] and fallback["then"] == f"iteration {before} from memory"
    print(json.dumps(fallback))
    assert_same_losses(tmp_path / "run", reference, before)
