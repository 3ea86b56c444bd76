"""The documentation site (mkdocs.yml, docs/) builds in MkDocs' strict mode: a broken link, a link
to a heading that is not there, or a page left out of the nav fails here with mkdocs' own
words. README.md is not part of the site (GitHub renders it), so its links into docs/ are
checked here against the built pages. The reference pages that list what the code defines
(events, exit codes) are checked against the code; docs/flags.md is tests/test_flags_reference.py's.
"""

import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from elasticft.contract.events import EventKind
from elasticft.contract.exit_codes import ExitCode

ROOT = Path(__file__).resolve().parent.parent


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    return out


def test_the_site_builds_strictly(site):
    assert (site / "index.html").exists() and (site / "flags" / "index.html").exists()


def test_a_broken_link_fails_the_build(tmp_path):
    """The strict build has teeth: one link to a page that does not exist fails it."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "hangs.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.ids |= {value for name, value in attrs if name == "id" and value}


def test_every_readme_link_into_docs_reaches_a_page_and_its_heading(site):
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]*)(?:#([^)\s]+))?\)", readme)
    assert links
    bad = []
    for target, anchor in links:
        path = ROOT / target
        if not path.exists():
            bad.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md":
            page = site / path.relative_to(ROOT / "docs").with_suffix("")
            html = page / "index.html" if page.name != "index" else page.with_suffix(".html")
            ids = _Ids()
            ids.feed(html.read_text())
            if anchor not in ids.ids:
                bad.append(f"{target}#{anchor}: no such heading")
    assert not bad, "README.md links that lead nowhere:\n" + "\n".join(bad)


def test_the_events_page_lists_every_event_kind():
    page = (ROOT / "docs" / "events.md").read_text()
    assert not [k.value for k in EventKind if f"| `{k.value}` |" not in page], \
        "docs/events.md lacks event kinds (elasticft/contract/events.py)"


def test_the_exit_codes_page_lists_every_exit_status():
    page = (ROOT / "docs" / "exit-codes.md").read_text()
    assert not [c for c in ExitCode if f"\n| {int(c)} |" not in page], \
        "docs/exit-codes.md lacks exit statuses (elasticft/contract/exit_codes.py)"
