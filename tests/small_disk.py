"""eft-run in this very process, with ``os.statvfs`` faked for one directory: a small disk.

    python tests/small_disk.py CAPACITY_BYTES DIR [eft-run arguments ...]

For the disk watchdog's end-to-end test on machines that cannot mount a small tmpfs.
``os.statvfs`` of DIR (or of anything under it) describes a filesystem of CAPACITY_BYTES
whose only content is DIR's: free = capacity - the blocks DIR's files and directories
occupy. torch's elastic agent runs inside eft-run's process, so the agent's watchdog
reads the fake; the workers save to the real disk underneath, which does not fill.
No product code knows about this: the patch is applied here, before eft-run starts.
"""

import os
import sys
from pathlib import Path

_real_statvfs = os.statvfs


def _occupied(path: str) -> int:
    """Bytes in allocated blocks, as a real filesystem counts them."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            try:
                total += os.lstat(name).st_blocks * 512
            except OSError:
                pass  # removed while we walked: a pruned checkpoint
    return total


def small_disk(capacity: int, root: str):
    """An ``os.statvfs`` for which ``root`` is a disk of ``capacity`` bytes."""
    root = os.path.realpath(root)

    def statvfs(path):
        return _statvfs(path, capacity, root)

    return statvfs


def _statvfs(path, capacity: int, root: str):
    st = _real_statvfs(path)  # a missing path fails as it would on the small disk
    real = os.path.realpath(path)
    if real != root and not real.startswith(root + os.sep):
        return st
    free_blocks = max(0, capacity - _occupied(root)) // st.f_frsize
    return os.statvfs_result((st.f_bsize, st.f_frsize, capacity // st.f_frsize, free_blocks, free_blocks,
                              st.f_files, st.f_ffree, st.f_favail, st.f_flag, st.f_namemax))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's eft, not an installed one
    os.statvfs = small_disk(int(sys.argv[1]), sys.argv[2])
    from launcher.eft_run import main

    sys.argv = ["eft-run", *sys.argv[3:]]
    sys.exit(main())
