"""Range-reading restores, piece by piece: chunk tables, and a real DCP load reading its shard
file by verified ranges from real shard servers on 127.0.0.1 (no copy of it on this node)."""

from __future__ import annotations

import json
import os
import shutil
import warnings
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from elasticft import torch_seam
from elasticft.contract.memory import CHUNKS_SUFFIX, ITEMS_SUFFIX, ChunkTable, RangedFile, RestoreCandidate
from elasticft.memckpt.chunks import GRID, MAX_CHUNK, checksum_part, chunk_edges
from elasticft.memckpt.node_dir import NodeDir
from elasticft.memckpt.server import ShardServer
from elasticft.worker.ranged_reads import CorruptRange, corrupt_ranges, ranged_reads
from elasticft.worker.snapshot import write_item_layouts

RUN, ITERATION, SHARD = "run-r", 7, "__0_0.distcp"
STATE = {f"w{i}": torch.arange(300 * (i + 1), dtype=torch.float32) * (i + 1) for i in range(6)}


def test_chunks_tile_the_file_at_its_items_edges_and_split_large_items():
    assert chunk_edges(100, [(0, 40), (40, 60)]) == [(0, 40), (40, 60)]
    big = MAX_CHUNK + 10
    assert chunk_edges(big + 5, [(5, big)]) == [(0, 5), (5, MAX_CHUNK), (5 + MAX_CHUNK, 10)]
    assert chunk_edges(2 * GRID + 1, None) == [(0, GRID), (GRID, GRID), (2 * GRID, 1)]
    # A layout that cannot be this file's (items overlap, or run past its end): the grid.
    for items in ([(0, 50), (40, 20)], [(0, 101)]):
        assert chunk_edges(100, items) == [(0, 100)]
    assert chunk_edges(0, []) == []


def test_a_part_is_listed_with_a_chunk_table_per_shard_file_and_without_the_layouts(tmp_path):
    (tmp_path / SHARD).write_bytes(os.urandom(1000))
    (tmp_path / (SHARD + ITEMS_SUFFIX)).write_text(json.dumps({"items": [[0, 300], [300, 700]]}))
    (tmp_path / "common.pt").write_bytes(b"common")
    files = checksum_part(tmp_path)
    assert sorted(files) == [SHARD, SHARD + CHUNKS_SUFFIX, "common.pt"]
    data = (tmp_path / SHARD).read_bytes()
    assert files[SHARD] == [1000, zlib.crc32(data)]
    raw = (tmp_path / (SHARD + CHUNKS_SUFFIX)).read_bytes()
    assert files[SHARD + CHUNKS_SUFFIX] == [len(raw), zlib.crc32(raw)]
    assert ChunkTable.from_json(raw).chunks == [[0, 300, zlib.crc32(data[:300])], [300, 700, zlib.crc32(data[300:])]]


@pytest.fixture
def holders(tmp_path):
    """A DCP checkpoint of STATE whose shard file two nodes' servers hold (origin "a" and its replica
    on "b"); the candidate's directory on this node ("c") has only its ``.metadata``."""
    scratch = tmp_path / "scratch"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(STATE, storage_writer=FileSystemWriter(str(scratch), thread_count=1), no_dist=True)
    metadata = FileSystemReader(str(scratch)).read_metadata()
    # What a worker writes down beside its file as it writes it (the write results name the items).
    write_item_layouts(scratch, [SimpleNamespace(storage_data=v) for v in metadata.storage_data.values()])
    servers, parts = [], []
    for node in ("a", "b"):
        node_dir = NodeDir(tmp_path / "shm" / node)
        node_dir.create()
        part = node_dir.own / "g1" / "iter_0000007" if node == "a" else node_dir.held_part("a", ITERATION)
        part.mkdir(parents=True)
        parts.append(part)
        for name in (SHARD, SHARD + ITEMS_SUFFIX):
            shutil.copy(scratch / name, part / name)
        files = checksum_part(part)
        servers.append(ShardServer(node_dir, node, RUN, "127.0.0.1").start())
    here = tmp_path / "c" / "iter_0000007"
    here.mkdir(parents=True)
    shutil.copy(scratch / ".metadata", here / ".metadata")
    entry = RangedFile(SHARD, "a", *files[SHARD], holders=[[s.node_id, s.address] for s in servers],
                       chunks=files[SHARD + CHUNKS_SUFFIX])
    yield SimpleNamespace(candidate=RestoreCandidate(ITERATION, str(here), True, files={SHARD: entry}),
                          servers=servers, parts=parts,
                          items={k.fqn: torch_seam.storage_location(v) for k, v in metadata.storage_data.items()})
    for server in servers:
        server.close()


def load(candidate, keys):
    target = {k: torch.empty_like(STATE[k]) for k in keys}
    with warnings.catch_warnings(), ranged_reads(candidate, RUN, "c") as reader:
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, storage_reader=FileSystemReader(candidate.path), no_dist=True)
    return target, reader.counts


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_load_reads_only_its_items_bytes_from_the_first_holder(holders):
    keys = ["w1", "w4"]
    loaded, counts = load(holders.candidate, keys)
    assert all(torch.equal(loaded[k], STATE[k]) for k in keys)
    needed = sum(holders.items[k][2] for k in keys)
    table = holders.candidate.files[SHARD].chunks[0]
    assert (counts.needed, counts.needed_remote, counts.fetched) == (needed, needed, needed + table)
    assert [s.served() for s in holders.servers] == [{"c": needed + table}, {}]


def test_a_corrupt_chunk_is_read_from_the_next_holder_and_one_corrupt_everywhere_refuses_the_load(holders):
    _, offset, length = holders.items["w2"]
    flip(holders.parts[0] / SHARD, offset + length // 2)  # the origin's copy of w2
    loaded, counts = load(holders.candidate, ["w2", "w3"])
    assert torch.equal(loaded["w2"], STATE["w2"]) and torch.equal(loaded["w3"], STATE["w3"])
    assert holders.servers[1].served() == {"c": length}  # only the bad chunk, from the replica
    flip(holders.parts[1] / SHARD, offset + 1)  # and the replica's
    with pytest.raises(BaseException) as raised:  # torch_dist's CheckpointException, from every rank
        load(holders.candidate, ["w2", "w3"])
    (bad,) = corrupt_ranges(raised.value)
    assert isinstance(bad, CorruptRange) and (bad.file, bad.start, bad.end) == (SHARD, offset, offset + length)
    assert "checksum mismatch" in bad.why and "a: crc" in bad.why and "b: crc" in bad.why
    load(holders.candidate, ["w1", "w3"])  # the other items stay readable


def test_a_holder_that_is_gone_is_skipped(holders):
    holders.servers[0].close()
    loaded, _ = load(holders.candidate, ["w5"])
    assert torch.equal(loaded["w5"], STATE["w5"])
    holders.servers[1].close()
    with pytest.raises(BaseException) as raised:
        load(holders.candidate, ["w0"])
    (bad,) = corrupt_ranges(raised.value)  # the file's chunk table is the first thing it cannot read
    assert bad.file == SHARD + CHUNKS_SUFFIX and "a: " in bad.why and "b: " in bad.why


def test_a_holder_that_refuses_one_file_still_serves_the_next_request(holders):
    (holders.parts[0] / (SHARD + CHUNKS_SUFFIX)).unlink()  # "a" lost the table (404): it comes from "b"
    loaded, counts = load(holders.candidate, ["w2"])
    assert torch.equal(loaded["w2"], STATE["w2"])
    table = holders.candidate.files[SHARD].chunks[0]
    assert [s.served() for s in holders.servers] == [{"c": holders.items["w2"][2]}, {"c": table}]
