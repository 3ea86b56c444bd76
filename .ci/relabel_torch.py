"""Make the installed torch report LABEL, as an NGC container's build does (``2.11.0a0+eb65b36914``):
its distribution's metadata (what pip reads) and ``torch/version.py`` (``torch.__version__``).

CI's NGC-style lane runs eft against such a torch: pip must keep it, and eft must judge it by its
release part. Usage: python .ci/relabel_torch.py LABEL
"""

import importlib.metadata
import re
import sys
from pathlib import Path

label = sys.argv[1]
dist = importlib.metadata.distribution("torch")
site = Path(dist.locate_file(""))
info, = site.glob("torch-*.dist-info")
old = dist.version
text = (info / "METADATA").read_text()
(info / "METADATA").write_text(re.sub(r"^Version: .*$", f"Version: {label}", text, count=1, flags=re.M))
record = (info / "RECORD").read_text().replace(f"{info.name}/", f"torch-{label}.dist-info/")
(info / "RECORD").write_text(record)
info.rename(site / f"torch-{label}.dist-info")
version_py = site / "torch" / "version.py"
version_py.write_text(re.sub(r"^__version__\s*=.*$", f"__version__ = '{label}'", version_py.read_text(),
                             count=1, flags=re.M))
print(f"torch {old} now reports {label}")
