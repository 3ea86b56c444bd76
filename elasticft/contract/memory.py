"""The memory checkpoint tier as every side sees it: node directories, the etcd index, files.

One memory checkpoint is a megatron-core ``torch_dist`` checkpoint whose files are spread
over the nodes that wrote it: every rank writes its ``__<rank>_0.distcp`` into its own
node's directory, and global rank 0 also writes the checkpoint-wide files (``.metadata``,
``common.pt``, ``metadata.json``). A node's share of one iteration is a **part**. The node
agent owns the node directory (tmpfs: it outlives the workers), checksums each part,
publishes it to etcd and pushes copies (**replicas**) to other nodes' agents. At a restart
every agent prepares the newest iterations the survivors can complete, one directory each,
and the workers load one with ``dist_checkpointing.load`` at the new layout: each rank reads
only the byte ranges its load plan asks for, from this node's copy or from a holder's shard
server, every chunk checked against the chunk table the origin's agent wrote.

    <node dir>/own/g<generation>/iter_0000012/   this node's part, written by its workers
    <node dir>/held/<origin node>/iter_0000012/  replicas of other nodes' parts
    <node dir>/restore/iter_0000012/             a restart's candidate: the checkpoint-wide files,
                                                 and hard links of the shard files this node holds

``<node dir>`` is ``<--eft-mem-ckpt-dir>/<run id>/<node id>``. A worker generation (each
start of the workers) writes into a fresh ``g<n>``: a snapshot never lands on files of an
abandoned timeline.

etcd holds only the index: one key per node, ``mem/parts/<node>`` (``NodeParts``: the node's
own parts it keeps, each a ``MemPart`` naming the nodes that hold a verified copy), written once
per snapshot, and ``mem/restorable`` (``Restorable``): the iterations that survive a node's loss,
computed by one agent for all, so that no agent has to read every node's key.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from urllib.parse import quote

# Files of a torch_dist checkpoint that global rank 0 writes once for the whole checkpoint.
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of every shard
# Megatron-Bridge's rank 0 writes two more beside them, which its load reads whole.
BRIDGE_TRAIN_STATE = "train_state.pt"  # the loop's counters (TrainState.state_dict())
BRIDGE_RUN_CONFIG = "run_config.yaml"  # the run's ConfigContainer (the load checks TP and PP against it)
GLOBAL_FILES = (DCP_METADATA, "common.pt", "metadata.json", BRIDGE_TRAIN_STATE, BRIDGE_RUN_CONFIG)

OWN_DIR = "own"
HELD_DIR = "held"
RESTORE_DIR = "restore"

# In each node directory: the agent that owns it ({"pid", "started"}), so that an agent
# starting later on the same host can tell a dead agent's leftovers from a live one's.
OWNER_FILE = "owner.json"

# Run-directory files (beside elasticft.contract.run_dir's).
RESTORE_FILE = "mem-restore.json"  # agent -> workers: the restore candidates of this start
PAUSE_MARKER = "mem-paused"  # agent -> workers: over budget, take no memory snapshots
# agent -> workers: take no memory snapshot for now: this node's newest is still being replicated with
# another queued behind it, or it has taken more than --eft-mem-ckpt-max-lag snapshots since the newest
# restorable iteration (``elasticft.memckpt.lag``)
LAG_MARKER = "mem-replicating"

# Beside each shard file of a part: ``<file>.items`` (worker -> agent: the byte ranges of its storage
# items, never published) and ``<file>.chunks`` (the agent's ``ChunkTable``, published and replicated
# with the part, so the index's crc of the table checks the table and the table checks each chunk).
ITEMS_SUFFIX = ".items"
CHUNKS_SUFFIX = ".chunks"

CHECKSUM_HEADER = "X-EFT-CRC32"
RUN_HEADER = "X-EFT-Run"  # a request naming another run is refused
NODE_HEADER = "X-EFT-Node"  # the requesting node: shard servers count the bytes they serve to each


def part_url(origin: str, iteration: int, name: str, kind: str = "part") -> str:
    """A shard server's path for ``origin``'s file ``name`` of ``iteration``: ``GET /part/...``
    (optionally with ``Range: bytes=A-B``), ``PUT /held/...``."""
    return f"/{kind}/{quote(origin, safe='')}/{iteration}/{quote(name, safe='')}"


def is_shard_file(name: str) -> bool:
    """A file a rank's load reads by byte ranges: not a checkpoint-wide file, not a table or layout."""
    return name not in GLOBAL_FILES and not name.endswith((ITEMS_SUFFIX, CHUNKS_SUFFIX, ".tmp"))


def generation_dir(generation: int) -> str:
    return f"g{generation}"


def node_parts_key(prefix: str, node_id: str) -> str:
    """``prefix`` is ``RunKeys.mem_parts``: one key per node, whatever number of parts it keeps."""
    return f"{prefix}{node_id}"


def node_of_key(prefix: str, key: str) -> str | None:
    """The node of a ``node_parts_key``, or None for a key that is not one (a deeper path)."""
    if not key.startswith(prefix):
        return None
    node = key[len(prefix):]
    return node if node and "/" not in node else None


_SHARD = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def pack_names(names: list[str]) -> list:
    """``needs`` as etcd keeps it: each run of shard files ``__<r>_<k>.distcp`` (r consecutive, one k)
    as ``[k, first r, last r]``, other names as they are. At 16,384 ranks the list of every file is
    ~330 KB; packed, a few bytes, so a node's record stays far below etcd's request limit."""
    out: list = []
    for name in sorted(names, key=lambda n: (0, int(m.group(2)), int(m.group(1))) if (m := _SHARD.match(n))
                       else (1, 0, 0)):
        m = _SHARD.match(name)
        if m is None:
            out.append(name)
            continue
        rank, k = int(m.group(1)), int(m.group(2))
        if out and isinstance(out[-1], list) and out[-1][0] == k and out[-1][2] == rank - 1:
            out[-1][2] = rank
        else:
            out.append([k, rank, rank])
    return out


def unpack_names(packed: list) -> list[str]:
    """The inverse of ``pack_names`` (a plain list of names, from older records, passes through)."""
    out: list[str] = []
    for item in packed:
        if isinstance(item, list):
            k, first, last = item
            out.extend(f"__{r}_{k}.distcp" for r in range(first, last + 1))
        else:
            out.append(item)
    return sorted(out)


@dataclass
class MemPart:
    """One node's share of one memory checkpoint, as published in etcd.

    ``files`` maps a file name to ``[size, crc32]``; ``holders`` are the nodes that keep a
    verified copy (the origin first, then its replicas), ``addresses`` where to read from each of
    them; ``replicas`` how many other nodes the origin pushes it to (its replicas are in place
    when that many more holders are listed); ``needs`` is set on the part that
    holds ``.metadata``: every file the checkpoint consists of.
    """

    node: str
    iteration: int
    address: str  # host:port of the origin's shard server
    files: dict[str, list[int]]
    holders: list[str] = field(default_factory=list)
    addresses: dict[str, str] = field(default_factory=dict)  # holder -> host:port of its shard server
    world_size: int = 0
    replicas: int = 0  # other nodes the origin pushes this part to (0 in records of older versions)
    needs: list[str] | None = None
    path: str = ""  # the part's directory on the origin, relative to its node dir
    time: float = 0.0

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.needs:
            out["needs"] = pack_names(self.needs)
        return out

    @classmethod
    def from_json(cls, raw: str | bytes) -> MemPart:
        return cls.from_dict(json.loads(raw))

    @classmethod
    def from_dict(cls, data: dict) -> MemPart:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if known.get("needs"):
            known["needs"] = unpack_names(known["needs"])
        return cls(**known)

    @property
    def size(self) -> int:
        return sum(size for size, _ in self.files.values())


@dataclass
class NodeParts:
    """The value of ``mem/parts/<node>``: the parts of ``node`` that it keeps, oldest first.

    Written by the node's agent alone, once per snapshot (after the part's replicas were pushed, so
    its holders are known) and never for a snapshot in which this node wrote nothing. Not under a
    lease: when the node is lost its parts live on in the nodes that hold replicas, and this record
    is what says where.
    """

    node: str
    parts: list[MemPart] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"node": self.node, "parts": [p.to_dict() for p in self.parts]}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> NodeParts:
        data = json.loads(raw)
        return cls(node=data["node"], parts=[MemPart.from_dict(p) for p in data.get("parts", [])])


@dataclass
class Restorable:
    """The value of ``mem/restorable``: the newest iterations complete with every replica in place
    (``memckpt.index.restorable_iterations``), newest first, as ``by`` saw them with ``alive``
    nodes; every agent prunes and measures its lag from it."""

    iterations: list[int]
    by: str
    alive: int = 0
    time: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Restorable:
        data = json.loads(raw)
        return cls(iterations=[int(k) for k in data.get("iterations", [])], by=str(data.get("by", "")),
                   alive=int(data.get("alive", 0)), time=float(data.get("time", 0.0)))


@dataclass
class ChunkTable:
    """``<file>.chunks``: a shard file's size and the crc32 of each of its chunks, in file order.

    The chunks tile the file; their edges are the file's storage items' edges where the worker
    named them (``<file>.items``), items larger than a few MiB split further, so a rank that reads
    an item reads exactly its chunks; else a fixed grid.
    """

    file: str
    size: int
    chunks: list[list[int]]  # [offset, length, crc32]

    def to_json(self) -> str:
        return json.dumps({"file": self.file, "size": self.size, "chunks": self.chunks}, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ChunkTable:
        data = json.loads(raw)
        table = cls(str(data["file"]), int(data["size"]), [[int(v) for v in c] for c in data["chunks"]])
        end = 0
        for offset, length, _ in table.chunks:
            if offset != end or length <= 0:
                raise ValueError(f"chunk table of {table.file}: the chunks do not tile the file at byte {end}")
            end += length
        if end != table.size:
            raise ValueError(f"chunk table of {table.file}: the chunks end at {end}, the file at {table.size}")
        return table


@dataclass
class RangedFile:
    """Where a rank reads one shard file of a restore candidate, by byte ranges.

    ``local``: this node holds a copy, linked into the candidate's directory under the same name
    (read first); ``holders``: [node, host:port] of the other alive nodes that hold one, in the
    order to try; ``chunks``: [size, crc32] of its chunk table (``<name>.chunks``, beside the file
    wherever it is held), None when the origin published none: the file is then one chunk, checked
    against ``crc``.
    """

    name: str
    origin: str
    size: int
    crc: int
    holders: list[list[str]] = field(default_factory=list)
    local: bool = False
    chunks: list[int] | None = None


@dataclass
class RestoreCandidate:
    """One iteration the agent prepared (or tried to) for the workers' next start."""

    iteration: int
    path: str  # the candidate's directory ("" when it could not be prepared)
    ready: bool
    why: str = ""  # why it is not ready
    # The shard files, read by byte ranges (empty: every file is in ``path``, read as it is).
    files: dict[str, RangedFile] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict) -> RestoreCandidate:
        known = RangedFile.__dataclass_fields__  # a newer agent's fields are not this worker's business
        files = {name: RangedFile(**{k: v for k, v in f.items() if k in known})
                 for name, f in (data.get("files") or {}).items()}
        return cls(int(data["iteration"]), data["path"], bool(data["ready"]), data.get("why", ""), files)


@dataclass
class RestorePlan:
    """``mem-restore.json``: the memory iterations ready for this start, newest first.

    The workers agree (one all-reduce) on the newest candidate ready on every node and
    load it when it is at least as new as the newest complete disk checkpoint.
    """

    candidates: list[RestoreCandidate]
    generation: int
    reached: int | None = None  # the highest iteration the previous generation reported
    run_id: str = ""  # the run header of the ranks' range requests
    node: str = ""  # this node: the ranks name it to the shard servers they read from

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> RestorePlan:
        data = json.loads(raw)
        return cls(candidates=[RestoreCandidate.from_dict(c) for c in data.get("candidates", [])],
                   generation=int(data.get("generation", 0)), reached=data.get("reached"),
                   run_id=str(data.get("run_id", "")), node=str(data.get("node", "")))

