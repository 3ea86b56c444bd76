"""A worker that starts a helper process, as a torch_dist save does, and leaves it behind.

Attempt 0 starts a helper (a plain child: same session, no death signal), writes its pid
to OUT/helper-0 and fails. Attempt 1 writes OUT/seen-1: whether attempt 0's helper was
still alive when it started; then starts its own helper (OUT/helper-1) and finishes.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

out = Path(sys.argv[1])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt:
    earlier = int((out / "helper-0").read_text())
    try:
        alive = psutil.Process(earlier).status() != psutil.STATUS_ZOMBIE  # a zombie holds nothing
    except psutil.NoSuchProcess:
        alive = False
    (out / f"seen-{attempt}").write_text(json.dumps({"helper_0_alive": alive}))
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
(out / f"helper-{attempt}").write_text(str(helper.pid))
sys.exit(0 if attempt else 1)
