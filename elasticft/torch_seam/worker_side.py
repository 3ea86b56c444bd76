"""The worker's side of the torch seam: error files torch's failure report reads, the
process group's formation observed, the vote's gloo group that connects on demand, and
torch_dist checkpoints read by byte ranges.

Part of ``elasticft.torch_seam`` (which re-exports every name here): the private torch names
that the agent's diagnoses and the workers' restores rely on, each behind a function that
says why eft needs it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from elasticft.torch_seam import TorchSeamError, _attribute, _replace_attribute

# -- error files -----------------------------------------------------------------------


def write_error_file(path: str | Path, message: str) -> str:
    """Write ``message`` as a worker's error file in torch's format; returns the path.

    torch's ``ProcessFailure`` reads it back, and its failure report (the one torchrun
    prints when restarts run out) shows ``message``. torch's own writer, ``ErrorHandler``,
    writes only the current exception to ``$TORCHELASTIC_ERROR_FILE``, which does not
    fit a failure the agent diagnoses itself. No ``py_callstack``: torch's report shows
    it *instead of* the message when present.
    """
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    Path(path).write_text(json.dumps(data))
    return str(path)


# -- the worker's process group ---------------------------------------------------------


def observe_init_process_group(called: Callable[[], None], returned: Callable[[], None]) -> None:
    """Have ``called()`` run when this process calls ``torch.distributed.init_process_group``
    and ``returned()`` when the call returns (``eft report``'s restart phases: the script's
    imports end at the call, the process group is formed at the return).

    torch offers no callback for it, so eft replaces the public function by a wrapper that
    calls the original, in the two places a script finds it: ``torch.distributed`` and its
    ``distributed_c10d`` (one function; a torch that made them two fails here). A script that
    bound the function before this ran calls the original, unobserved. Idempotent.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = _attribute(distributed_c10d, "init_process_group")
    if getattr(original, "eft_observed", False):
        return
    if _attribute(dist, "init_process_group") is not original:
        raise TorchSeamError("torch.distributed.init_process_group is not distributed_c10d.init_process_group")

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        called()
        result = original(*args, **kwargs)
        returned()
        return result

    init_process_group.eft_observed = True
    _replace_attribute(distributed_c10d, "init_process_group", init_process_group)
    _replace_attribute(dist, "init_process_group", init_process_group)


# -- a gloo group that connects on demand (the vote's) -------------------------------------

# torch's switch for gloo's connections on demand (documented under "Improving initialization time").
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


def lazy_gloo_group() -> Any:
    """A new gloo group over every rank of the job (a collective, like ``new_group``) that opens a
    rank's TCP connection to a peer at their first message, not a full mesh when it is made.

    torch documents the switch only as a process-wide variable; what eft relies on is where torch
    reads it: when the group's ProcessGroupGloo is built (its default device), on every torch of
    the range. So it is set around this one ``new_group`` and put back as it was, and the user's
    own gloo groups, made before or after, connect as the user chose.
    """
    import torch.distributed as dist

    before = os.environ.get(GLOO_LAZY_INIT)
    os.environ[GLOO_LAZY_INIT] = "1"
    try:
        return dist.new_group(backend="gloo")
    finally:
        if before is None:
            del os.environ[GLOO_LAZY_INIT]
        else:
            os.environ[GLOO_LAZY_INIT] = before


# -- torch_dist checkpoints: where each storage item lies, and a ranged read of them ------------


def storage_location(info: Any) -> tuple[str, int, int]:
    """(file, offset, length) of one storage item, from torch's ``_StorageInfo`` (the values of a
    checkpoint's ``Metadata.storage_data``, and a write result's ``storage_data``)."""
    return (str(_attribute(info, "relative_path")), int(_attribute(info, "offset")),
            int(_attribute(info, "length")))


@contextlib.contextmanager
def ranged_storage_reads(directory: str | Path,
                         open_stream: Callable[[str, list[tuple[int, int]]], Any]) -> Iterator[None]:
    """Inside, torch's ``FileSystemReader`` loading the checkpoint ``directory`` opens each data file
    through ``open_stream(name, [(offset, length) of the plan's items in it])``, which returns a
    seekable binary stream or None (the file as it is); other checkpoints are read as before.

    torch's ``read_data`` (the public StorageReader step) opens each file of its plan once through
    ``self.fs.create_stream(path, "rb")`` and reads each item from it (seek, read): the one place
    that knows which bytes a rank needs. Megatron-core's readers subclass it.
    """
    from torch.distributed.checkpoint import FileSystemReader

    original = _attribute(FileSystemReader, "read_data")
    target = os.path.realpath(directory)

    @functools.wraps(original)
    def read_data(self, plan, planner):
        if os.path.realpath(_attribute(self, "path")) != target:
            return original(self, plan, planner)
        wanted: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            name, offset, length = storage_location(_attribute(self, "storage_data")[item.storage_index])
            wanted.setdefault(name, []).append((offset, length))
        fs = _attribute(self, "fs")
        self.fs = _RoutedFileSystem(fs, target, wanted, open_stream)
        try:
            return original(self, plan, planner)
        finally:
            self.fs = fs

    FileSystemReader.read_data = read_data
    try:
        yield
    finally:
        FileSystemReader.read_data = original


class _RoutedFileSystem:
    """A FileSystemReader's ``fs`` for one ``read_data``: the opens ``open_stream`` takes, the rest as before."""
    def __init__(self, fs: Any, directory: str, wanted: dict[str, list[tuple[int, int]]],
                 open_stream: Callable[[str, list[tuple[int, int]]], Any]):
        self._fs, self._directory, self._wanted, self._open = fs, directory, wanted, open_stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def create_stream(self, path: str | os.PathLike, mode: str) -> Any:
        name, stream = os.path.basename(path), None
        if mode == "rb" and os.path.realpath(os.path.dirname(path)) == self._directory:
            stream = self._open(name, self._wanted.get(name, []))
        return self._fs.create_stream(path, mode) if stream is None else stream  # a stream is its own context
