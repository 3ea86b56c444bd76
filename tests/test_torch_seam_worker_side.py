"""The workers' side of the torch seam (elasticft/torch_seam/worker_side.py), against the installed
torch: error files torch's failure report reads, the process group observed, torch_dist files
read by byte ranges. A torch that moves one of them fails here.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
)

from elasticft import torch_seam

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.seam


# -- error files ---------------------------------------------------------------------


def test_error_file_reads_back_through_torchs_process_failure(tmp_path):
    message = "HangDetected: rank 3 has been in section 'step' for 9.0 s"
    path = torch_seam.write_error_file(tmp_path / "hang-3.json", message)
    failure = ProcessFailure(local_rank=3, pid=4242, exitcode=1, error_file=path)
    assert failure.error_file == path and failure.message["message"] == message
    assert abs(failure.timestamp - time.time()) < 60
    report = ChildFailedError("train.py", {3: failure}).format_msg()
    assert re.search(r"error_file: .*hang-3\.json", report) and message in report


# -- the worker's process group (eft report's restart phases) ----------------------------


def test_init_process_group_marks_the_end_of_imports_and_of_the_process_group(tmp_path):
    """Through elasticft.torch_seam: torch's own init_process_group, wrapped, forms a real group."""
    script = (
        "import json, time, torch.distributed as dist\n"
        "from torch.distributed import distributed_c10d\n"
        "from elasticft.worker import phases\n"
        "phases.watch_process_group(); phases.watch_process_group()  # idempotent\n"
        "before = time.time()\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "assert dist.is_initialized() and dist.get_world_size() == 1\n"
        "print(json.dumps({'before': before, 'after': time.time(), 'stamps': phases.stamps(),\n"
        "                  'wrapped': hasattr(dist.init_process_group, 'eft_observed'),\n"
        "                  'one': distributed_c10d.init_process_group is dist.init_process_group}))\n")

    def run(**env) -> dict:
        environ = {k: v for k, v in os.environ.items() if k != "EFT_RUN_DIR"}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              cwd=ROOT, env={**environ, **env})
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    seen = run(EFT_RUN_DIR=str(tmp_path))
    assert seen["wrapped"] and seen["one"]
    assert seen["before"] <= seen["stamps"]["imports"] <= seen["stamps"]["process_group"] <= seen["after"]
    plain = run()  # plain torchrun: nothing wrapped, nothing marked
    assert not plain["wrapped"] and plain["stamps"] == {}


# -- the vote's gloo group: connections on demand ---------------------------------------------


def test_a_lazy_gloo_group_connects_a_rank_only_to_the_peers_it_talks_to(tmp_path):
    """torch reads TORCH_GLOO_LAZY_INIT when it builds the group's gloo backend: eft's group opens a
    rank's connections only to the tree neighbours it votes with (a fast neighbour may connect while
    a rank still makes the group), while a plain gloo group made after it is still the full mesh,
    and the variable is as it was (16 real gloo ranks)."""
    ranks = 16
    done = subprocess.run([sys.executable, "-m", "tests.vote_group_ranks", "seam", str(ranks), str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(ranks)]
    for result in results:
        assert result["backend"] == "gloo" and result["env"] is None
        assert result["made"] <= result["voted"] <= 1 + 4  # the listener and its tree neighbours: log2(16)
        assert result["plain"] >= ranks - 1
        assert result["agreed"] == [ranks - 1, ranks]


# -- torch_dist checkpoints: where items lie, and a load that reads them by ranges -------------


def dcp_checkpoint(folder: Path) -> dict:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    state = {f"w{i}": torch.arange(100 * (i + 1), dtype=torch.float32) for i in range(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=FileSystemWriter(str(folder), thread_count=1), no_dist=True)
    return state


def test_storage_locations_name_each_items_bytes_in_the_file(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    dcp_checkpoint(tmp_path)
    items = sorted(torch_seam.storage_location(info)
                   for info in FileSystemReader(str(tmp_path)).read_metadata().storage_data.values())
    assert {name for name, _, _ in items} == {"__0_0.distcp"}
    ends = [0] + [offset + length for _, offset, length in items]
    assert [offset for _, offset, _ in items] == ends[:-1]  # back to back, to the end of the file
    assert ends[-1] == (tmp_path / "__0_0.distcp").stat().st_size


def test_a_ranged_read_opens_the_checkpoints_files_through_the_opener_with_its_plans_items(tmp_path):
    import io
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    original = FileSystemReader.read_data
    ours, other = tmp_path / "ours", tmp_path / "other"
    state = dcp_checkpoint(ours)
    dcp_checkpoint(other)
    locations = {k.fqn: torch_seam.storage_location(v)
                 for k, v in FileSystemReader(str(ours)).read_metadata().storage_data.items()}
    opened = []

    def opener(name, wanted):
        opened.append((name, sorted(wanted)))
        return io.BytesIO((ours / name).read_bytes())

    def load(folder: Path, keys: list[str]) -> dict:
        target = {k: torch.empty_like(state[k]) for k in keys}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(target, storage_reader=FileSystemReader(str(folder)), no_dist=True)
        return target

    with torch_seam.ranged_storage_reads(ours, opener):
        loaded = load(ours, ["w1", "w3"])
        load(other, ["w0"])  # another checkpoint: read as before
        assert FileSystemReader.read_data is not original
    assert FileSystemReader.read_data is original
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)
    assert opened == [("__0_0.distcp", sorted(locations[k][1:] for k in ("w1", "w3")))]
