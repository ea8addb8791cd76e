"""`ortspec serve` in a subprocess on 127.0.0.1, for the tests that talk to a real server."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ortspec.runtime.bench.server import ServerProcess, free_port, ortspec_serve


class Server(ServerProcess):
    """`ortspec serve` in a subprocess on 127.0.0.1, ready once /health answers; its output goes
    to serve-PORT.log in $ORTSPEC_CACHE_DIR."""

    def __init__(self, model_dir: Path, *args: str, env: dict[str, str] | None = None,
                 ready_s: float = 120, stop_s: float = 30) -> None:
        port = free_port()
        super().__init__(ortspec_serve(model_dir, port, "--log-level", "warning", *args), port,
                         ready_s=ready_s, stop_s=stop_s, env=env,
                         log=Path(os.environ.get("ORTSPEC_CACHE_DIR", "/tmp")) / f"serve-{port}.log")

    def metric(self, name: str, default: float | None = None) -> float:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        if m is None and default is not None:
            return default
        assert m, f"{name} not in /metrics"
        return float(m.group(1))
