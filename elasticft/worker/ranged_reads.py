"""A restarting rank reads only the byte ranges its load plan needs, from whichever node holds them.

``mem-restore.json`` names, for each shard file of a restore candidate, where it can be read:
this node's copy (hard-linked into the candidate's directory) and the other alive holders'
shard servers, with the file's chunk table (``contract.memory.ChunkTable``: a crc32 per chunk,
the chunks' edges at the storage items' edges). While torch's ``FileSystemReader`` loads the
candidate (``torch_seam.ranged_storage_reads``), each shard file it opens is a ``VerifiedFile``:
a read fetches the chunks that cover it (this node's copy first, then each holder with an HTTP
Range request), checks each against the table, and keeps it for the item's next reads. A chunk
no source delivers intact raises ``CorruptRange`` naming the file and the range; torch_dist
gathers every rank's failure, so all ranks fail that load alike and ``MemoryCheckpoints.restore``
tries the next candidate. docs/memory-checkpoints.md has the design.
"""

from __future__ import annotations

import bisect
import contextlib
import http.client
import io
import logging
import os
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from elasticft import torch_seam
from elasticft.contract.memory import (
    CHUNKS_SUFFIX,
    NODE_HEADER,
    RUN_HEADER,
    ChunkTable,
    RangedFile,
    RestoreCandidate,
    part_url,
)

log = logging.getLogger(__name__)

RUN_BYTES = 16 << 20  # one request asks for at most this many bytes of wanted chunks in a row
CACHE_BYTES = 64 << 20  # verified chunks an open file keeps (torch reads an item in a few seeks)
TIMEOUT = 60.0  # seconds a holder may take to answer


class CorruptRange(RuntimeError):
    """No source delivered ``file``'s bytes [start, end) of ``iteration`` intact (picklable: torch_dist
    carries it to every rank)."""

    def __init__(self, file: str, start: int, end: int, iteration: int, why: str):
        super().__init__(f"{file} bytes {start}-{end - 1} of memory checkpoint {iteration}: {why}")
        self.file, self.start, self.end, self.iteration, self.why = file, start, end, iteration, why

    def __reduce__(self):
        return type(self), (self.file, self.start, self.end, self.iteration, self.why)


@dataclass
class ReadCounts:
    """What one rank's load of a candidate read."""

    needed: int = 0  # bytes of the storage items its load plan asked for
    needed_remote: int = 0  # of them, in files this node holds no copy of
    fetched: int = 0  # bytes received from other nodes (chunk tables included)
    local: int = 0  # bytes read from this node's copies


class _Peers:
    """One kept-alive HTTP connection per holder."""

    def __init__(self, run_id: str, node: str, timeout: float):
        self._headers = {RUN_HEADER: run_id, NODE_HEADER: node}
        self._timeout = timeout
        self._connections: dict[str, http.client.HTTPConnection] = {}

    def get(self, address: str, url: str, start: int | None = None, end: int | None = None) -> bytes:
        """The file at ``url`` on ``address``, or its bytes [start, end); OSError when it cannot."""
        headers = dict(self._headers)
        if start is not None:
            headers["Range"] = f"bytes={start}-{end - 1}"
        conn = self._connections.get(address)
        if conn is None:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise OSError(f"holder address {address!r}: expected HOST:PORT")
            conn = self._connections[address] = http.client.HTTPConnection(host.strip("[]"), int(port),
                                                                            timeout=self._timeout)
        try:
            conn.request("GET", url, headers=headers)
            response = conn.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            self._connections.pop(address, None)
            raise OSError(f"{exc or type(exc).__name__}") from exc
        if response.status not in (200, 206):  # a refusal closes the server's end: so ours
            conn.close()
            self._connections.pop(address, None)
            raise OSError(f"HTTP {response.status} {body[:200].decode(errors='replace')}")
        if start is not None and (response.status != 206 or len(body) != end - start):
            raise OSError(f"asked for {end - start} bytes, got {len(body)} (HTTP {response.status})")
        return body

    def close(self) -> None:
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()


class CandidateReader:
    """The shard files of one restore candidate, as this rank's load opens them."""

    def __init__(self, candidate: RestoreCandidate, run_id: str, node: str, timeout: float = TIMEOUT):
        self.candidate = candidate
        self.dir = Path(candidate.path)
        self.counts = ReadCounts()
        self._peers = _Peers(run_id, node, timeout)

    def open(self, name: str, wanted: list[tuple[int, int]]) -> VerifiedFile | None:
        """torch opens ``name`` to read the items at ``wanted``; None: not a ranged file, read it as it is."""
        entry = self.candidate.files.get(name)
        if entry is None:
            return None
        nbytes = sum(length for _, length in wanted)
        self.counts.needed += nbytes
        self.counts.needed_remote += 0 if entry.local else nbytes
        return VerifiedFile(self, entry, self._table(entry), wanted)

    def close(self) -> None:
        self._peers.close()

    def sources(self, entry: RangedFile) -> list[tuple[str, str]]:
        """(label, address) to read ``entry`` from, in order; address "" is this node's copy."""
        return ([("this node's copy", "")] if entry.local else []) + [(h, a) for h, a in entry.holders]

    def read(self, entry: RangedFile, name: str, address: str, start: int, end: int, whole: bool = False) -> bytes:
        """Bytes [start, end) of ``name`` (``entry``'s file or its table) from one source."""
        if not address:
            with open(self.dir / name, "rb") as f:
                data = os.pread(f.fileno(), end - start, start)
            self.counts.local += len(data)
            return data
        url = part_url(entry.origin, self.candidate.iteration, name)
        data = self._peers.get(address, url) if whole else self._peers.get(address, url, start, end)
        self.counts.fetched += len(data)
        return data

    def _table(self, entry: RangedFile) -> ChunkTable:
        """The file's chunk table, checked whole against the index's crc; without one, the file is one chunk."""
        if entry.chunks is None:
            return ChunkTable(entry.name, entry.size, [[0, entry.size, entry.crc]] if entry.size else [])
        size, crc = entry.chunks
        name, tried = entry.name + CHUNKS_SUFFIX, []
        for label, address in self.sources(entry):
            try:
                raw = self.read(entry, name, address, 0, size, whole=True)
                if zlib.crc32(raw) != crc or len(raw) != size:
                    raise OSError(f"checksum mismatch (got {zlib.crc32(raw):08x}, the index says {crc:08x})")
                table = ChunkTable.from_json(raw)
                if table.size != entry.size:
                    raise OSError(f"a table of {table.size} bytes, the file has {entry.size}")
                return table
            except (OSError, ValueError, KeyError) as exc:
                tried.append(f"{label}: {exc}")
        raise CorruptRange(name, 0, size, self.candidate.iteration, "; ".join(tried) or "no holder")

    def fill(self, entry: RangedFile, table: ChunkTable, run: list[int]) -> dict[int, memoryview]:
        """The chunks ``run`` (consecutive indexes) of ``entry``, each checked; CorruptRange if one cannot be."""
        got: dict[int, memoryview] = {}
        tried: list[str] = []
        mismatch = False
        for label, address in self.sources(entry):
            missing = [k for k in run if k not in got]
            if not missing:
                break
            for part in _consecutive(missing):
                start = table.chunks[part[0]][0]
                end = table.chunks[part[-1]][0] + table.chunks[part[-1]][1]
                try:
                    data = memoryview(self.read(entry, entry.name, address, start, end))  # slices copy nothing
                except OSError as exc:
                    tried.append(f"{label}: {exc}")
                    continue
                for k in part:
                    offset, length, crc = table.chunks[k]
                    piece = data[offset - start:offset - start + length]
                    if zlib.crc32(piece) == crc:
                        got[k] = piece
                    else:
                        mismatch = True
                        tried.append(f"{label}: crc {zlib.crc32(piece):08x}, the table says {crc:08x}")
        bad = [k for k in run if k not in got]
        if mismatch and not bad:
            log.warning("memory checkpoint %d: a copy of %s bytes %d-%d is corrupt (%s); read intact from the next",
                        self.candidate.iteration, entry.name, table.chunks[run[0]][0],
                        table.chunks[run[-1]][0] + table.chunks[run[-1]][1] - 1, "; ".join(tried))
        if bad:
            offset, length, _ = table.chunks[bad[0]]
            what = "checksum mismatch" if mismatch else "no holder could deliver it"
            raise CorruptRange(entry.name, offset, offset + length, self.candidate.iteration,
                               f"{what} ({'; '.join(tried) or 'no holder'})")
        return got


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) ranges as disjoint [start, end) intervals, in order."""
    out: list[tuple[int, int]] = []
    for start, end in sorted((o, o + n) for o, n in ranges if n > 0):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _consecutive(indexes: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for k in indexes:
        if runs and runs[-1][-1] == k - 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


class VerifiedFile(io.RawIOBase):
    """A seekable read-only view of one shard file whose bytes come checked, chunk by chunk."""

    def __init__(self, reader: CandidateReader, entry: RangedFile, table: ChunkTable, wanted: list[tuple[int, int]]):
        super().__init__()
        self._reader, self._entry, self._table = reader, entry, table
        self._starts = [c[0] for c in table.chunks]
        self._wanted = _merged(wanted)  # disjoint [start, end), in order
        self._cache: OrderedDict[int, memoryview] = OrderedDict()
        self._cached = 0
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._table.size}[whence]
        if base + offset < 0:
            raise OSError(f"seek to {base + offset} in {self._entry.name}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self._pos < self._table.size:
            k = bisect.bisect_right(self._starts, self._pos) - 1
            chunk = self._chunk(k)
            at = self._pos - self._starts[k]
            piece = chunk[at:at + len(view) - done]
            view[done:done + len(piece)] = piece
            done += len(piece)
            self._pos += len(piece)
        return done

    def _wants(self, k: int) -> bool:
        """Whether the load plan reads any byte of chunk ``k``."""
        offset, length, _ = self._table.chunks[k]
        i = bisect.bisect_left(self._wanted, (offset + length,)) - 1  # the last range starting before its end
        return i >= 0 and self._wanted[i][1] > offset

    def _chunk(self, k: int) -> memoryview:
        if k in self._cache:
            self._cache.move_to_end(k)
            return self._cache[k]
        run, size = [k], self._table.chunks[k][1]
        while (j := run[-1] + 1) < len(self._starts) and j not in self._cache and self._wants(j) \
                and size + self._table.chunks[j][1] <= RUN_BYTES:
            run.append(j)
            size += self._table.chunks[j][1]
        for index, data in sorted(self._reader.fill(self._entry, self._table, run).items()):
            self._cache[index] = data
            self._cached += len(data)
        while self._cached > CACHE_BYTES and len(self._cache) > len(run):
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)
        return self._cache[k]


@contextlib.contextmanager
def ranged_reads(candidate: RestoreCandidate, run_id: str, node: str) -> Iterator[CandidateReader | None]:
    """While inside, a torch_dist load of ``candidate.path`` reads its shard files by verified ranges.
    A candidate that names no ranged files (a whole checkpoint in its directory) is read as it is."""
    if not candidate.files:
        yield None
        return
    reader = CandidateReader(candidate, run_id, node)
    try:
        with torch_seam.ranged_storage_reads(candidate.path, reader.open):
            yield reader
    finally:
        reader.close()


def corrupt_ranges(exc: BaseException) -> list[CorruptRange]:
    """The CorruptRanges behind a failed load, on any rank (torch_dist's CheckpointException carries
    every rank's failure), each file and range once."""
    found: dict[tuple[str, int, int], CorruptRange] = {}
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CorruptRange):
            found.setdefault((e.file, e.start, e.end), e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return [found[key] for key in sorted(found)]
