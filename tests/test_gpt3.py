"""The GPT example (examples/gpt3/train.py): real megatron-core in CPU mode, real launchers.

A reference run trains 8 iterations at TP2 x PP1 x DP2 and saves at iteration 4; runs
resumed from that checkpoint at other layouts must log the reference's losses at the
same iterations. A save killed halfway must never become latest, and a latest
checkpoint that does not load must give way to the previous one, again with the
reference's losses afterwards. With CPU initialization and PP = 1 the weights do not
depend on TP or DP, so runs started from scratch at such layouts match the reference too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
from pathlib import Path

import psutil
import pytest

from bench.launch import Launched, eft_run, read_jsonl, torchrun, wait_for
from elasticft.planner.megatron_args import model_facts_from_argv, rewrite_megatron_args
from elasticft.worker import CheckpointDir

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt3"
TRAIN = EXAMPLE / "train.py"
ITERS = 8
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "128",
         "--global-batch-size", "8", "--micro-batch-size", "1", "--train-iters", str(ITERS),
         "--lr", "5e-3", "--seed", "1234"]
TOLERANCE = 1e-4  # measured differences are about 2e-7 (fp32 sums in another order)
TIMEOUT = 180


# -- helpers -------------------------------------------------------------------------------

def layout_args(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def start(launcher: list[str], tmp: Path, name: str, nproc: int, args: list[str], env: dict | None = None) -> Launched:
    """``launcher`` running train.py on ``nproc`` local ranks; JSON log ``tmp/name.jsonl``."""
    cmd = [*launcher, "--standalone", "--nproc-per-node", str(nproc), str(TRAIN), *MODEL,
           "--log-file", str(tmp / f"{name}.jsonl"), *args]
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return Launched(cmd, tmp / f"{name}.log", env={"PYTHONPATH": pythonpath, **(env or {})})


def finish(job: Launched, timeout: float = TIMEOUT) -> None:
    try:
        rc = job.wait(timeout)
        assert rc == 0, f"{job.cmd} exited {rc}:\n{job.output()[-6000:]}"
    finally:
        job.stop()


def train(tmp: Path, name: str, nproc: int, tp: int, pp: int, *extra: str, env: dict | None = None,
          ckpt: Path | None = None) -> list[dict]:
    """A torchrun run that saves into and loads from ``ckpt`` (``tmp/name``); its log records."""
    ckpt = ckpt or tmp / name
    job = start(torchrun(), tmp, name, nproc,
                [*layout_args(tp, pp), "--save", str(ckpt), "--load", str(ckpt), *extra], env)
    finish(job)
    return read_jsonl(tmp / f"{name}.jsonl")


def losses(records: list[dict]) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in records if r["event"] == "iteration"}


def events(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["event"] == kind]


def assert_same_losses(got: dict[int, float], reference: dict[int, float], iterations) -> None:
    assert sorted(got) == list(iterations)
    diff = {i: abs(got[i] - reference[i]) for i in got}
    assert max(diff.values()) <= TOLERANCE, f"losses differ from the reference: {diff}"


def layout_of(record: dict) -> tuple[int, int, int, int]:
    return record["world_size"], record["tp"], record["pp"], record["dp"]


def copy_checkpoint(source: Path, iteration: int, dest: Path) -> None:
    """A checkpoint directory holding only ``source``'s complete ``iteration``."""
    shutil.copytree(CheckpointDir(source).dir_of(iteration), CheckpointDir(dest).dir_of(iteration))
    CheckpointDir(dest).commit(iteration)


# -- fast: the pieces that need no processes ------------------------------------------------

@pytest.fixture(scope="module")
def example():
    """train.py as a module; it imports megatron-core only when a Trainer is built."""
    spec = importlib.util.spec_from_file_location("gpt3_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_global_batch_does_not_depend_on_the_layout(example):
    args = example.parse_args(MODEL)
    for iteration in (0, 5):
        batches = {}
        for dp in (1, 2, 4, 8):
            rows = [mb["tokens"][i] for rank in range(dp)
                    for mb in example.micro_batches(args, iteration, rank, dp)
                    for i in range(args.micro_batch_size)]
            assert len(rows) == args.global_batch_size
            batches[dp] = [row.tolist() for row in rows]
        assert batches[1] == batches[2] == batches[4] == batches[8]
    first = next(example.micro_batches(args, 0, 0, 1))
    assert first["labels"][0, :-1].tolist() == first["tokens"][0, 1:].tolist()
    other = example.parse_args(MODEL[:-1] + ["99"])  # another --seed, other data
    assert next(example.micro_batches(other, 0, 0, 1))["tokens"].tolist() != first["tokens"].tolist()


def test_the_planner_reads_and_rewrites_its_arguments(example):
    facts = model_facts_from_argv(MODEL)
    assert (facts.model.num_layers, facts.batch.global_batch_size) == (4, 8)
    rewritten = rewrite_megatron_args(MODEL + layout_args(1, 1), type("Plan", (), {"tp": 2, "pp": 2})())
    args = example.parse_args(rewritten)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    # The padded vocabulary is the same at every TP (Megatron-LM multiplies by TP).
    assert args.padded_vocab_size == 128


def test_layouts_that_do_not_fit_are_named(example):
    args = example.parse_args(MODEL + layout_args(4, 4))
    assert example.layout_problems(args, 16) == []
    assert example.layout_problems(args, 8) == ["the world size 8 is not a multiple of TP x PP"]
    args = example.parse_args(MODEL + layout_args(8, 3))
    assert example.layout_problems(args, 24) == [
        "--num-layers 4 is not a multiple of PP", "--num-attention-heads 4 is not a multiple of TP"]
    args = example.parse_args(MODEL + layout_args(1, 1))
    assert example.layout_problems(args, 16) == [
        "--global-batch-size 8 is not a multiple of --micro-batch-size x DP = 16"]


# -- slow: real processes --------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """8 uninterrupted iterations at TP2 x PP1 x DP2 on 4 ranks, saving at 4 and 8."""
    tmp = tmp_path_factory.mktemp("gpt3-reference")
    records = train(tmp, "ref", 4, 2, 1, "--save-interval", "4")
    ref = losses(records)
    assert sorted(ref) == list(range(1, ITERS + 1))
    assert {layout_of(r) for r in events(records, "iteration")} == {(4, 2, 1, 2)}
    assert ref[ITERS] < ref[1] - 0.05, f"the model does not learn: {ref}"
    assert CheckpointDir(tmp / "ref").complete_iterations() == [8, 4]
    return tmp / "ref", ref


@pytest.mark.slow
@pytest.mark.parametrize("nproc,tp,pp", [(2, 1, 2), (1, 1, 1)], ids=["TP1xPP2", "TP1xPP1"])
def test_resume_at_another_layout_gives_the_reference_losses(tmp_path, reference, nproc, tp, pp):
    ref_ckpt, ref = reference
    copy_checkpoint(ref_ckpt, 4, tmp_path / "resumed")
    records = train(tmp_path, "resumed", nproc, tp, pp, "--save-interval", "4")
    (load,) = events(records, "load")
    assert load["iteration"] == 4
    assert load["saved_layout"] == {"world_size": 4, "tp": 2, "pp": 1, "dp": 2}
    dp = nproc // (tp * pp)
    assert {layout_of(r) for r in events(records, "iteration")} == {(nproc, tp, pp, dp)}
    assert_same_losses(losses(records), ref, range(5, ITERS + 1))
    assert CheckpointDir(tmp_path / "resumed").complete_iterations() == [8, 4]


@pytest.mark.slow
def test_the_comparison_sees_a_lost_optimizer_state(tmp_path, reference):
    """The control: resumed without Adam's moments, the losses leave the reference."""
    ref_ckpt, ref = reference
    copy_checkpoint(ref_ckpt, 4, tmp_path / "weights-only")
    got = losses(train(tmp_path, "weights-only", 1, 1, 1, "--no-load-optim"))
    assert abs(got[5] - ref[5]) <= TOLERANCE  # the weights were loaded
    assert max(abs(got[i] - ref[i]) for i in range(6, ITERS + 1)) > 10 * TOLERANCE


def _rank0_worker(job: Launched) -> psutil.Process:
    def find():
        for child in psutil.Process(job.proc.pid).children():
            try:
                if child.environ().get("RANK") == "0":
                    return child
            except psutil.Error:
                pass
        return None

    return wait_for(find, 60, "the rank 0 worker")


@pytest.mark.slow
def test_a_save_killed_halfway_is_never_latest_and_a_broken_latest_falls_back(tmp_path, reference):
    _, ref = reference
    ckpt = CheckpointDir(tmp_path / "killed")
    # TP2 x DP1 from scratch: the reference's weights and batches, a save every iteration.
    job = start(torchrun(), tmp_path, "killed", 2,
                [*layout_args(2, 1), "--save", str(ckpt.root), "--load", str(ckpt.root), "--save-interval", "1"])
    killed_at = None
    try:
        rank0 = _rank0_worker(job)
        for k in range(3, ITERS):
            # The save makes its directory first, then writes the shards (and, before megatron-core
            # 0.19, common.pt); rank 0 commits (marker, tracker) after every rank finished. Freeze
            # it as soon as this save has begun.
            begun = ckpt.dir_of(k)
            wait_for(lambda begun=begun: begun.exists() or job.proc.poll() is not None,
                     TIMEOUT, f"the save of iteration {k} to begin")
            assert job.proc.poll() is None, job.output()[-6000:]
            rank0.send_signal(signal.SIGSTOP)
            if not ckpt.is_complete(k):
                killed_at = k
                break
            rank0.send_signal(signal.SIGCONT)  # it had already committed: try the next save
        assert killed_at is not None, "every save completed before rank 0 could be stopped in it"
        job.kill_node()  # SIGKILL the launcher and every worker, rank 0 inside its save
    finally:
        job.stop()
    k = killed_at
    assert not ckpt.is_complete(k) and ckpt.dir_of(k).is_dir()  # begun, never committed
    assert ckpt.tracked_iteration() == k - 1
    assert ckpt.complete_iterations() == [k - 1, k - 2]
    before = losses(read_jsonl(tmp_path / "killed.jsonl"))
    assert_same_losses({i: before[i] for i in range(1, k + 1)}, ref, range(1, k + 1))

    # The latest complete checkpoint is damaged (truncated shards): the resumed run, at
    # another layout, must fall back to the one before it.
    for shard in ckpt.dir_of(k - 1).glob("*.distcp"):
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    records = train(tmp_path, "resumed", 2, 1, 2, "--save-interval", "1", ckpt=ckpt.root)
    (load,) = events(records, "load")
    assert load["iteration"] == k - 2
    assert_same_losses(losses(records), ref, range(k - 1, ITERS + 1))
    assert ckpt.tracked_iteration() == ITERS and ckpt.complete_iterations() == [ITERS, ITERS - 1]
    assert not ckpt.dir_of(k).exists()  # saved again and pruned


@pytest.mark.slow
def test_plain_torchrun_leaves_the_hook_inert(tmp_path, reference):
    """Without eft-run's EFT_RUN_DIR the switches are not looked at: training goes on."""
    _, ref = reference
    switches = {"EFT_SAVE_SWITCH": tmp_path / "save-now", "EFT_KILL_SWITCH": tmp_path / "stop-now"}
    for path in switches.values():
        path.touch()
    records = train(tmp_path, "plain", 1, 1, 1, "--exit-interval", "3",
                    env={"EFT_RUN_DIR": "", **{k: str(v) for k, v in switches.items()}})
    assert_same_losses(losses(records), ref, range(1, 4))
    assert [(s["iteration"], s["reason"]) for s in events(records, "save")] == [(3, "exit_interval")]
    assert events(records, "exit")[0]["iteration"] == 3
    assert all(path.exists() for path in switches.values())
    assert CheckpointDir(tmp_path / "plain").complete_iterations() == [3]


@pytest.mark.slow
def test_eft_run_saves_on_the_switch_and_replans_on_restart(tmp_path, reference):
    """eft-run: the save switch makes every rank save; a restart on fewer GPUs is re-planned
    (the command line still says TP2) and resumes with the reference's losses."""
    _, ref = reference
    ckpt = tmp_path / "ckpt"
    switch = tmp_path / "save-now"
    switch.touch()
    args = [*layout_args(2, 1), "--save", str(ckpt), "--load", str(ckpt)]
    # Two local GPUs: the planner picks the layout; the switch exists from the start.
    finish(start([*eft_run(), "--eft-save-switch", str(switch)], tmp_path, "two", 2,
                 ["--exit-interval", "3", *args]))
    records = read_jsonl(tmp_path / "two.jsonl")
    assert [(s["iteration"], s["reason"]) for s in events(records, "save")] == [(1, "save_switch"), (3, "exit_interval")]
    assert not switch.exists()  # rank 0 removes it after the save
    (first,) = {layout_of(r) for r in events(records, "iteration")}
    assert first[0] == 2 and first[1] * first[2] * first[3] == 2
    assert first[2] == 1, "with PP1 the initial weights are the reference's"
    assert_same_losses(losses(records), ref, range(1, 4))

    # Restarted on one GPU with the same command line (TP2): the planner makes it TP1.
    finish(start(eft_run(), tmp_path, "one", 1, args))
    records = read_jsonl(tmp_path / "one.jsonl")
    (load,) = events(records, "load")
    assert load["iteration"] == 3 and layout_of(load["saved_layout"]) == first
    assert {layout_of(r) for r in events(records, "iteration")} == {(1, 1, 1, 1)}
    assert_same_losses(losses(records), ref, range(4, ITERS + 1))
