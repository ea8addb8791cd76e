"""`ortspec serve`: the OpenAI-compatible server on one loaded model.

    ortspec serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--max-concurrent N]
                  [--max-queue 64] [--drafter prompt-lookup|none|...] [--threads N]
                  [--ray --replicas N [--ray-address ADDR]]

Without --model: the default model's batched export (`ortspec export --attention window`) when
it exists, else its plain export. The model is loaded, and the cost model's curve read or
measured, before the port opens, so
the first request is not slower than the rest. SIGTERM or Ctrl-C: stop accepting, let running
requests finish, exit 0. With --ray the same app runs on Ray Serve (`ray_app.py`): --replicas
copies, each loading the model, behind Ray Serve's HTTP proxy on --host/--port.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket

import uvicorn

from ..cli.args import UserErrorParser, add_model_options, check_drafter_arg, model_arg, \
    providers_arg
from ..drafters import DRAFTER_NAMES, NEEDS_DRAFT_MODEL
from ..errors import InvalidOptionError, OrtspecError
from ..paths import DEFAULT_MODEL_NAME, default_model_path
from ..batching.prefix_cache import DEFAULT_PREFIX_CACHE_MIB, prefix_cache_bytes
from ..validation import check_int
from .app import create_app
from .engine import BATCHED_MAX_CONCURRENT, DEFAULT_MAX_CONCURRENT, default_max_concurrent

DEFAULT_MAX_QUEUE = 64
BUSY_TIMEOUT_SECONDS = 60.0  # a slot is always free for an admitted request; this only bounds a bug


def build_parser() -> argparse.ArgumentParser:
    p = UserErrorParser(prog="ortspec serve",
                        description="OpenAI-compatible HTTP server (chat and completions)")
    add_model_options(p)
    p.add_argument("--draft", help="draft model directory (default: the one the manifest lists)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--max-concurrent", type=int, default=None,
                   help="requests decoding at once (each holds a KV slot); a model exported "
                        "with --attention window runs them in shared calls, up to its "
                        f"max_batch (16). Default: {BATCHED_MAX_CONCURRENT} on such a model "
                        f"(at most its max_batch), else {DEFAULT_MAX_CONCURRENT}")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests waiting for a slot; beyond that the answer is 503")
    p.add_argument("--drafter", default="auto", choices=DRAFTER_NAMES,
                   help="auto (the default): eagle3 where the model lists a draft head and "
                        "decodes each request on calls of its own, else prompt-lookup; a "
                        "batched export with a head drafts with it when asked (eagle3)")
    p.add_argument("--prefix-cache-mib", type=float, default=DEFAULT_PREFIX_CACHE_MIB,
                   help="MiB of recent prompts' keys and values kept (a model decoding each "
                        "request alone: where its graph computes a position alike in any call, "
                        "as the int4 exports do) "
                        "for requests that start the same (a shared system prompt, earlier "
                        "turns), copied instead of computed; 0 turns it off "
                        f"(default {DEFAULT_PREFIX_CACHE_MIB})")
    p.add_argument("--served-model-name", help="the model id clients use (default: the "
                                               "model directory's name)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    ray = p.add_argument_group("Ray Serve (pip install 'ortspec[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve, the model loaded once per replica")
    ray.add_argument("--replicas", type=int, default=None,
                     help="replicas with --ray (default 1); each takes --threads CPUs")
    ray.add_argument("--ray-address", default=None,
                     help="a running Ray cluster (e.g. auto); default: start Ray on this machine")
    return p


def _check(args: argparse.Namespace) -> None:
    check_int("--port", args.port, minimum=0, maximum=65535)
    if args.max_concurrent is not None:
        check_int("--max-concurrent", args.max_concurrent, minimum=1)
    check_int("--max-queue", args.max_queue, minimum=0)
    prefix_cache_bytes(args.prefix_cache_mib, name="--prefix-cache-mib")
    if args.threads is not None:
        check_int("--threads", args.threads, minimum=0, what=" (0 = onnxruntime's default)")
    if not args.ray and (args.replicas is not None or args.ray_address is not None):
        raise InvalidOptionError("--replicas and --ray-address are used only with --ray")
    if args.replicas is not None:
        check_int("--replicas", args.replicas, minimum=1)
    if args.draft is not None and args.drafter not in NEEDS_DRAFT_MODEL:
        raise InvalidOptionError(f"--draft is used only with a draft-model drafter, not "
                                 f"{args.drafter!r}")


def _check_listen(host: str, port: int) -> None:
    """OrtspecError where uvicorn could not listen on host:port (taken, not this machine's, or
    not allowed), found before the model loads rather than after. Binds as asyncio's
    create_server does: every address the host names ("" for all), IPv6 sockets IPv6 only,
    SO_REUSEADDR on POSIX, an address family the machine lacks skipped."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OrtspecError(f"--host {host!r} is not an address of this machine ({e})") from None
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    binds = list(dict.fromkeys((i[0], i[1], i[2], i[4]) for i in infos))  # (no duplicates)
    failures = []
    for family, kind, proto, address in binds:
        with socket.socket(family, kind, proto) as s:
            if os.name == "posix":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    failures.append(e)
                    continue
                hint = {errno.EADDRINUSE: "another server is there; choose another --port",
                        errno.EACCES: "not allowed for this user; choose a --port above 1023"}
                raise OrtspecError(f"cannot listen on {shown}: {e.strerror or e} "
                                   f"({hint.get(e.errno, 'see --host and --port')})") from None
    if failures and len(failures) == len(binds):
        raise OrtspecError(f"cannot listen on {shown}: {failures[0].strerror or failures[0]} "
                           f"(not an address of this machine; choose another --host)")


def main(argv: list[str] | None = None) -> int:
    from ..load import load_model

    args = build_parser().parse_args(argv)
    _check(args)
    path = model_arg(args.model, prefer_batched=True)
    check_drafter_arg(args.drafter, path)
    if args.max_concurrent is None:
        args.max_concurrent = default_max_concurrent(path)
    needs_draft = args.drafter in NEEDS_DRAFT_MODEL
    if args.ray:  # Ray Serve's proxy listens, maybe on another node, maybe already running
        return _serve_on_ray(args, path, needs_draft)
    _check_listen(args.host, args.port)
    # the cost curve read or measured now, not in a request
    model = load_model(path, providers=providers_arg(args.providers), threads=args.threads,
                       draft=(args.draft or True) if needs_draft else None,
                       max_concurrent=args.max_concurrent, when_busy="wait",
                       busy_timeout=BUSY_TIMEOUT_SECONDS, prefix_cache_mib=args.prefix_cache_mib,
                       calibrate=args.drafter != "none")
    name = args.served_model_name or os.path.basename(os.path.abspath(path))
    if not args.served_model_name and args.model is None and path == default_model_path(batched=True):
        name = DEFAULT_MODEL_NAME  # the same model as the plain export, under the same id
    # a batching model serves at most its graph's max_batch requests at once; the rest queue
    app = create_app(model, model_name=name, drafter=args.drafter,
                     max_concurrent=model.slots.max_slots, max_queue=args.max_queue)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    if model.runner is not None:
        logging.info("%s: up to %d requests share each model call", path, model.slots.max_slots)
    else:  # a warning: concurrent requests then share the cores call by call, unbatched
        logging.warning("%s: one request per model call, each request in calls of its own "
                        "(`ortspec export --attention window` makes a graph that batches them, "
                        "which `ortspec serve` takes by default)", path)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level, lifespan="on"))
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again under the handler
    # it found: a handler that returns makes that a normal exit, status 0
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    except SystemExit:  # uvicorn's own exit where it could not start after all
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not server.started:
        raise OrtspecError(f"the server did not start on {args.host}:{args.port} (see the log)")
    return 0


def _serve_on_ray(args: argparse.Namespace, path: os.PathLike, needs_draft: bool) -> int:
    try:
        from . import ray_app
    except ImportError as e:
        if (e.name or "").partition(".")[0] != "ray":
            raise
        raise OrtspecError(f"--ray needs Ray Serve: pip install 'ortspec[ray]' ({e})") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    app = ray_app.application(
        path, replicas=args.replicas or 1, model_name=args.served_model_name,
        drafter=args.drafter, threads=args.threads, providers=providers_arg(args.providers),
        draft=(args.draft or True) if needs_draft else None,
        max_concurrent=args.max_concurrent, max_queue=args.max_queue,
        prefix_cache_mib=args.prefix_cache_mib)
    return ray_app.run(app, host=args.host, port=args.port, address=args.ray_address)
