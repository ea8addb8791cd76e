"""The server scaled out on Ray Serve: N replicas, each a Ray actor with one loaded model and the
same FastAPI app (`create_app`) as `ortspec serve`, behind Ray Serve's HTTP proxy.

    ortspec serve --ray --replicas 2 --threads 1         # a local Ray, or --ray-address auto
    serve run ortspec.runtime.serve.ray_app:build model=/abs/model/dir replicas=4 threads=2

Each replica loads the model and reads or measures the cost curve in its constructor, so it
takes traffic only once it is ready; Ray Serve's FastAPI ingress then serves the app that
`__serve_build_asgi_app__` builds on that model. A replica holds up to `max_concurrent` decodes
and `max_queue` waiting requests, as one `ortspec serve` does (its own 503 beyond that); Ray
Serve's router sends each request to the less loaded of two replicas it picks.

The model directory must exist at the same absolute path on every node that runs a replica.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from ray import serve

from ..errors import InvalidOptionError
from ..batching.prefix_cache import DEFAULT_PREFIX_CACHE_MIB
from .app import create_app
from .engine import default_max_concurrent

APP_NAME = "ortspec"


@serve.ingress()
class OrtspecServer:
    """One replica: one loaded model, its own slots, queue and metrics."""

    def __init__(self, model_dir: str, *, model_name: str, drafter: str = "auto",
                 threads: int | None = None, providers: list[str] | None = None,
                 draft: str | bool | None = None, max_concurrent: int = 4,
                 max_queue: int = 64, busy_timeout: float = 60.0,
                 prefix_cache_mib: float = DEFAULT_PREFIX_CACHE_MIB) -> None:
        from ..load import load_model

        # the cost curve read or measured before traffic
        self.model = load_model(model_dir, providers=providers, threads=threads, draft=draft,
                                max_concurrent=max_concurrent, when_busy="wait",
                                busy_timeout=busy_timeout, prefix_cache_mib=prefix_cache_mib,
                                calibrate=drafter != "none")
        self._app_options = dict(model_name=model_name, drafter=drafter,
                                 max_concurrent=max_concurrent, max_queue=max_queue)

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.model, **self._app_options)


def application(model_dir: str | os.PathLike, *, replicas: int, model_name: str | None = None,
                drafter: str = "auto", threads: int | None = None,
                providers: list[str] | None = None, draft: str | bool | None = None,
                max_concurrent: int | None = None, max_queue: int = 64,
                prefix_cache_mib: float = DEFAULT_PREFIX_CACHE_MIB) -> Any:
    """The Ray Serve application: `replicas` copies of `OrtspecServer`, each reserving
    `threads` CPUs (1 when onnxruntime picks its own thread count); `max_concurrent` None:
    `default_max_concurrent` of the model, as `ortspec serve` picks it."""
    path = str(Path(model_dir).resolve())  # replicas do not run in this directory
    if max_concurrent is None:
        max_concurrent = default_max_concurrent(path)
    deployment = serve.deployment(
        OrtspecServer, name="OrtspecServer", num_replicas=replicas,
        ray_actor_options={"num_cpus": threads or 1},
        # what one replica admits itself (running + waiting): beyond that its own 503
        max_ongoing_requests=max_concurrent + max_queue)
    return deployment.bind(path, model_name=model_name or os.path.basename(path),
                           drafter=drafter, threads=threads, providers=providers, draft=draft,
                           max_concurrent=max_concurrent, max_queue=max_queue,
                           prefix_cache_mib=prefix_cache_mib)


BUILD_ARGS = {"model": str, "replicas": int, "served_model_name": str, "drafter": str,
              "threads": int, "providers": str, "draft": str, "max_concurrent": int,
              "max_queue": int, "prefix_cache_mib": float}


def build(args: dict[str, Any]) -> Any:
    """An application builder for `serve run` / `serve deploy`: `args` are the CLI's
    `key=value` pairs or a config file's `args:` (model is required; the others as
    `ortspec serve` names them, with underscores)."""
    unknown = sorted(set(args) - set(BUILD_ARGS))
    if unknown:
        raise InvalidOptionError(f"unknown argument(s) {', '.join(unknown)}; the builder takes "
                                 f"{', '.join(BUILD_ARGS)}")
    if "model" not in args:
        raise InvalidOptionError("model=DIR is required (an absolute path on every node)")
    a = {}
    for key, value in args.items():
        try:
            a[key] = BUILD_ARGS[key](value)
        except ValueError:
            raise InvalidOptionError(f"{key} must be {BUILD_ARGS[key].__name__}, got {value!r}") from None
    providers = [p.strip() for p in a["providers"].split(",")] if a.get("providers") else None
    return application(a["model"], replicas=a.get("replicas", 1),
                       model_name=a.get("served_model_name"),
                       drafter=a.get("drafter", "auto"), threads=a.get("threads"),
                       providers=providers, draft=a.get("draft"),
                       max_concurrent=a.get("max_concurrent"),
                       max_queue=a.get("max_queue", 64),
                       prefix_cache_mib=a.get("prefix_cache_mib", DEFAULT_PREFIX_CACHE_MIB))


def run(app: Any, *, host: str, port: int, address: str | None) -> int:
    """Deploy `app` and serve until SIGTERM or Ctrl-C, then take it down gracefully (running
    requests finish within Ray Serve's graceful-shutdown timeout). `address` None starts a
    Ray instance on this machine, stopped again at the end; with a cluster's address only this
    application is deleted."""
    import ray

    stop = threading.Event()
    ray.init(address=address, include_dashboard=False)
    # after ray.init, which installs handlers of its own that end the process at once
    previous = {s: signal.signal(s, lambda signum, frame: stop.set())
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/")  # returns once every replica is up
        print(f"ortspec: serving on http://{host}:{port} through Ray Serve", flush=True)
        while not stop.wait(0.5):
            pass
        serve.delete(APP_NAME)  # new requests are refused; replicas finish the running ones
        if address is None:
            serve.shutdown()
    finally:
        ray.shutdown()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
