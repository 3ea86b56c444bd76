"""Checksums of a part: one crc32 per file, and for each shard file a crc32 per chunk.

A restart's ranks read only the byte ranges their load plans need (``elasticft.worker.ranged_reads``),
so a shard file is checked chunk by chunk, not whole: when the agent publishes a part it reads
each file once (it does for the whole-file crc anyway) and writes beside each shard file its
``ChunkTable`` (``<file>.chunks``), which is then listed, published and replicated like any
file of the part. So index -> the table's crc -> each chunk's crc -> the bytes: a replica
corrupted at rest is caught in the range that is read.

The chunks' edges are the storage items' edges where the workers wrote them down
(``<file>.items``, ``elasticft.worker.snapshot``): a rank reads whole items, so it then reads
exactly its items' chunks, however small they are. Items above ``MAX_CHUNK`` are split (a
failed chunk is fetched again alone, and memory stays bounded); without a layout, a fixed grid.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path

from elasticft.contract.memory import CHUNKS_SUFFIX, ITEMS_SUFFIX, ChunkTable, is_shard_file
from elasticft.contract.run_dir import write_atomically
from elasticft.memckpt.node_dir import crc32_of

log = logging.getLogger(__name__)

MAX_CHUNK = 4 << 20  # an item larger than this is checked in pieces of at most this
GRID = 1 << 20  # the chunk size of a file whose items are unknown


def _pieces(offset: int, length: int, most: int) -> list[tuple[int, int]]:
    return [(o, min(most, offset + length - o)) for o in range(offset, offset + length, most)]


def chunk_edges(size: int, items: list[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """(offset, length) of the chunks that tile a file of ``size`` bytes, at its items' edges.

    Items that overlap or run past the end are not a layout to trust: the grid then."""
    items = sorted(items or [])
    end, edges = 0, []
    for offset, length in items:
        if offset < end or length < 0 or offset + length > size:
            return _pieces(0, size, GRID)
        edges += _pieces(end, offset - end, GRID)  # bytes between items (none in torch's files)
        edges += _pieces(offset, length, MAX_CHUNK)
        end = offset + length
    step = MAX_CHUNK if items else GRID
    return edges + _pieces(end, size - end, step)


def _items_of(path: Path) -> list[tuple[int, int]] | None:
    """The storage items' byte ranges the worker wrote down for ``path``; None without a readable layout."""
    try:
        data = json.loads((path.parent / (path.name + ITEMS_SUFFIX)).read_text())
        return [(int(o), int(n)) for o, n in data["items"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("memory checkpoint: unreadable layout of %s (%s): chunks on a grid", path, exc)
        return None


def checksum_shard(path: Path) -> tuple[int, ChunkTable]:
    """One read of ``path``: its whole crc32 and its chunk table."""
    size = os.stat(path).st_size
    whole, chunks = 0, []
    with open(path, "rb") as f:
        for offset, length in chunk_edges(size, _items_of(path)):
            data = f.read(length)
            if len(data) != length:
                raise OSError(f"{path} is shorter than {size} bytes")
            crc = zlib.crc32(data)
            whole = zlib.crc32(data, whole)
            chunks.append([offset, length, crc])
    return whole, ChunkTable(path.name, size, chunks)


def checksum_part(path: Path) -> dict[str, list[int]]:
    """``{name: [size, crc32]}`` of a part's files, chunk tables included (written here beside each
    shard file); the workers' layouts and temporary files are not part of it."""
    out: dict[str, list[int]] = {}
    names = sorted(e.name for e in os.scandir(path) if e.is_file(follow_symlinks=False))
    for name in names:
        if name.endswith((".tmp", ITEMS_SUFFIX, CHUNKS_SUFFIX)):
            continue
        if is_shard_file(name):
            whole, table = checksum_shard(path / name)
            out[name] = [table.size, whole]
            text = table.to_json()
            write_atomically(path / (name + CHUNKS_SUFFIX), text)
            out[name + CHUNKS_SUFFIX] = [len(text.encode()), zlib.crc32(text.encode())]
        else:
            out[name] = [os.stat(path / name).st_size, crc32_of(path / name)]
    return out
