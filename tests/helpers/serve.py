"""`ortspec serve` in a subprocess on 127.0.0.1, for the tests that talk to a real server."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`ortspec serve` in a subprocess on 127.0.0.1, ready once /health answers."""

    def __init__(self, model_dir: Path, *args: str, env: dict[str, str] | None = None,
                 ready_s: float = 120, stop_s: float = 30) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stop_s = stop_s
        self.log = open(Path(os.environ.get("ORTSPEC_CACHE_DIR", "/tmp")) / f"serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ortspec.runtime.cli.main", "serve", "--model", str(model_dir),
             "--port", str(self.port), "--log-level", "warning", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited: {self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError(f"the server did not answer /health in time: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def metric(self, name: str, default: float | None = None) -> float:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        if m is None and default is not None:
            return default
        assert m, f"{name} not in /metrics"
        return float(m.group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
