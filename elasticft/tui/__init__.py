"""``eft top``: a read-only view of a run, fed by one etcd watch.

``mirror`` reads the run's keys through ``elasticft.store`` and follows them;
``view`` turns what it holds into plain data (pure); ``render`` and ``text`` draw
that data with rich or as plain text; ``live`` is the redraw loop.
"""

from elasticft.tui.live import Dashboard
from elasticft.tui.mirror import RunMirror, read_state
from elasticft.tui.render import frame, rows_that_fit
from elasticft.tui.state import LostNode, Record, RunState
from elasticft.tui.text import status_text
from elasticft.tui.view import SORTS, View, ViewSettings, build_view, fit

__all__ = [
    "Dashboard",
    "LostNode",
    "Record",
    "RunMirror",
    "RunState",
    "SORTS",
    "View",
    "ViewSettings",
    "build_view",
    "fit",
    "frame",
    "read_state",
    "rows_that_fit",
    "status_text",
]
