"""Moving part files between shard servers over plain HTTP, streamed and checksummed.

Bulk bytes go node to node, never through etcd. ``fetch`` checks the bytes it received
against the crc32 the *index* published when the origin wrote the file, not only against
what the sender claims: a replica corrupted at rest (the sender would checksum its own bad
bytes) is caught here, and the restore falls back instead of loading garbage.
"""

from __future__ import annotations

import http.client
import os
import uuid
import zlib
from pathlib import Path

from elasticft.contract.memory import CHECKSUM_HEADER, NODE_HEADER, RUN_HEADER, part_url
from elasticft.memckpt.node_dir import CHUNK, crc32_of


class TransferError(RuntimeError):
    """A file could not be moved to or from a peer (one line naming the peer and the file)."""


def _connection(address: str, timeout: float) -> http.client.HTTPConnection:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise TransferError(f"peer address {address!r}: expected HOST:PORT")
    return http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout, blocksize=CHUNK)


def fetch(address: str, run_id: str, origin: str, iteration: int, name: str, dest: Path, crc: int,
          timeout: float = 60.0, node: str = "") -> None:
    """Download ``origin``'s file ``name`` of ``iteration`` from ``address`` into ``dest``.

    ``dest`` appears only complete and verified (written to a tmp name, then renamed). ``node``
    (this node) is named to the server, which counts what it serves to each.
    """
    what = f"{name} of {origin} iteration {iteration} from {address}"
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
    conn = _connection(address, timeout)
    try:
        conn.request("GET", part_url(origin, iteration, name), headers={RUN_HEADER: run_id, NODE_HEADER: node})
        response = conn.getresponse()
        if response.status != 200:
            raise TransferError(f"{what}: HTTP {response.status} {response.read(200).decode(errors='replace')}")
        got = 0
        with open(tmp, "wb") as f:
            while chunk := response.read(CHUNK):
                got = zlib.crc32(chunk, got)
                f.write(chunk)
        if got != crc:
            raise TransferError(f"{what}: checksum mismatch (got {got:08x}, the index says {crc:08x})")
        os.replace(tmp, dest)
    except (OSError, http.client.HTTPException) as exc:
        raise TransferError(f"{what}: {exc or type(exc).__name__}") from exc
    finally:
        conn.close()
        tmp.unlink(missing_ok=True)


def push(address: str, run_id: str, origin: str, iteration: int, src: Path, crc: int | None = None,
         timeout: float = 60.0) -> None:
    """Upload ``src`` to the shard server at ``address`` as a replica of ``origin``'s part.

    The receiver verifies ``crc`` (computed here when not given) before keeping the file.
    """
    what = f"{src.name} of iteration {iteration} to {address}"
    if crc is None:
        crc = crc32_of(src)
    conn = _connection(address, timeout)
    try:
        with open(src, "rb") as body:
            headers = {RUN_HEADER: run_id, CHECKSUM_HEADER: str(crc),
                       "Content-Length": str(os.fstat(body.fileno()).st_size)}
            conn.request("PUT", part_url(origin, iteration, src.name, kind="held"), body=body, headers=headers)
            response = conn.getresponse()
            answer = response.read(200).decode(errors="replace")
        if response.status != 200:
            raise TransferError(f"{what}: HTTP {response.status} {answer}")
    except (OSError, http.client.HTTPException) as exc:
        raise TransferError(f"{what}: {exc or type(exc).__name__}") from exc
    finally:
        conn.close()
