"""A server in a subprocess on 127.0.0.1, for the benchmarks and tests that talk to a real one.

`ServerProcess` starts a command (`ortspec serve ...`, from `ortspec_serve`, or any other
OpenAI-compatible server such as llama.cpp's `llama-server --port N ...`), waits until a GET of
its `ready_path` (`/health`, or `/v1/models`) answers 200, and stops it with SIGTERM, then
SIGKILL after `stop_s`. Only the standard library: the readiness check is a plain urllib GET
that goes to 127.0.0.1 directly, whatever proxy the environment names.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import OrtspecError

HOST = "127.0.0.1"
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for a local server


class ServerError(OrtspecError):
    """The server exited, or did not answer in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ortspec_serve(model_dir: Path | str, port: int, *args: str) -> list[str]:
    """The command line of `ortspec serve` on `port`, in this interpreter."""
    return [sys.executable, "-m", "ortspec.runtime.cli.main", "serve", "--model", str(model_dir),
            "--port", str(port), *args]


def http_get(url: str, *, timeout: float) -> str:
    """The body of a GET of `url` that answers 200 (else urllib's error), sent directly."""
    with _DIRECT.open(url, timeout=timeout) as r:
        if r.status != 200:
            raise urllib.error.HTTPError(url, r.status, r.reason, r.headers, None)
        return r.read().decode("utf-8")


class ServerProcess:
    """`command` (which serves on `port`) in a subprocess, ready once `ready_path` answers 200.

    `log`: a file for the server's stdout and stderr (else they are this process's), whose end
    the errors quote; it is closed by `stop`."""

    def __init__(self, command: list[str], port: int, *, ready_path: str = "/health",
                 ready_s: float = 120, stop_s: float = 30, log: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.stop_s = stop_s
        self.log = None if log is None else open(log, "w+")
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=None if self.log is None else subprocess.STDOUT,
            env={**os.environ, **(env or {})})
        try:
            self._wait_ready(ready_path, ready_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, path: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"the server exited with status {self.proc.returncode}"
                                  + self._quote())
            try:
                http_get(self.url + path, timeout=1)
                return
            except OSError:  # urllib's errors (an answer other than 200 too) are OSErrors
                pass
            time.sleep(0.2)
        raise ServerError(f"the server did not answer {path} in {seconds:g} s" + self._quote())

    def output(self) -> str:
        """The end of the server's log ("" without one)."""
        if self.log is None or self.log.closed:
            return ""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def _quote(self) -> str:
        out = self.output()
        return f": {out}" if out else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
