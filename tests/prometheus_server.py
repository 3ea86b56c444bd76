"""A real Prometheus (Debian's package) for the tests: started on loopback, asked through its HTTP API.

It scrapes every target in ``targets/*.json`` (what ``eft metrics targets --watch`` keeps) every
half second, with eft's alert rules loaded, as an operator's Prometheus would (every few seconds).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from bench.launch import wait_for
from elasticft.store.server import free_port

RULES = Path(__file__).resolve().parents[1] / "examples" / "prometheus" / "eft-rules.yml"


class PrometheusServer:
    def __init__(self, workdir: Path, interval: str = "500ms"):
        binary = shutil.which("prometheus")
        assert binary, "prometheus is missing: install Debian's prometheus package (.ci/setup does)"
        self.targets = workdir / "targets"
        self.targets.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "eft", "honor_labels": True,
                                "file_sd_configs": [{"files": [str(self.targets / "*.json")],
                                                     "refresh_interval": "1s"}]}],
        }
        (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.address = f"127.0.0.1:{free_port()}"
        self._log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.address}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._ready, 60, "Prometheus to be ready")

    def _ready(self) -> bool:
        assert self._proc.poll() is None, "Prometheus exited at its start: see prometheus.log"
        try:
            return urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict | list:
        url = f"http://{self.address}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        answer = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        return self.api("query", query=expr, time=at or time.time())["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 0.5) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def firing(self) -> set[str]:
        return {a["labels"]["alertname"] for a in self.api("alerts")["alerts"] if a["state"] == "firing"}

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()

    def __enter__(self) -> "PrometheusServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
