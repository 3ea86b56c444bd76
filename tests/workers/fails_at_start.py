"""A training script that fails before its first step, every time: it looks for a data file
that is not there (the commonest endless loop: an import error, a missing file, a bad flag).
Its main is torch's ``@record``, so the error reaches torch's error file, as in Megatron-LM's
scripts that use it."""

import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    index = Path(sys.argv[1])
    if not index.exists():
        raise FileNotFoundError(f"no dataset index at {index}")


if __name__ == "__main__":
    main()
