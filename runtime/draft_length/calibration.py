"""The measured cost of a target call by block length, and its cache.

`CostCurve.measure` times calls of 1..max_len tokens on a decoder; `calibrated_cost_curve`
reads it from `cache_root()/calibration/` or measures and stores it, keyed by what changes it:
the model's graph, the provider, the machine's CPU and the intra-op thread count
(`CalibrationKey`). The draft-length policy (`policy.py`) only consumes the curve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

try:
    import fcntl
except ImportError:  # not POSIX: measurements are not serialised across processes
    fcntl = None  # type: ignore[assignment]

import numpy as np

from ..ort.graph_io import call_width
from ..ort.machine import cpu_model
from ..paths import cache_root
from ..decoding.protocols import Decoder

T = TypeVar("T")

log = logging.getLogger("ortspec.calibration")

# 2: cost surfaces have a one-token column (curves re-measured too); 3: a surface's call has one
# row of `tokens` tokens and the others one each; 4: surfaces measured at two contexts
CALIBRATION_VERSION = 4
CALIBRATION_CONTEXT = 256  # tokens in the cache while a curve is measured
LONG_CONTEXT = 1024  # a cost surface's second context (where the rows' capacity allows it)
LEAST_CONTEXT_SHARE = 0.25  # a surface's cost below its first context falls to this share at most


@dataclasses.dataclass(frozen=True)
class CostCurve:
    """seconds[n - 1]: the cost of one target call with n new tokens (n = 1: the step graph)."""

    seconds: tuple[float, ...]

    def cost(self, n: int) -> float:
        if n <= len(self.seconds):
            return self.seconds[n - 1]
        # beyond the measured range: extend linearly from the last two points
        s = self.seconds
        slope = s[-1] - s[-2] if len(s) > 1 else s[-1]
        return s[-1] + slope * (n - len(s))

    def relative(self) -> list[float]:
        return [x / self.seconds[0] for x in self.seconds]

    def padded_to(self, min_rows: int) -> "CostCurve":
        """The curve of a decoder whose calls run at least `min_rows` rows
        (Manifest.min_call_rows): a call of fewer tokens is the same call as one of min_rows,
        so it costs the same (a step and a one-token verify are then equally priced)."""
        m = min(min_rows, len(self.seconds))
        if m <= 1:
            return self
        return CostCurve((self.seconds[m - 1],) * m + self.seconds[m:])

    @classmethod
    def measure(cls, decoder: Decoder, *, max_len: int, context: int = CALIBRATION_CONTEXT,
                repeats: int = 7, seed: int = 0) -> "CostCurve":
        """Time calls of 1..max_len tokens at a context of `context` tokens, interleaved so the
        machine's drift hits every length alike; median per length, made non-decreasing."""
        rng = np.random.default_rng(seed)
        context = max(1, min(context, decoder.capacity - max_len))
        prompt = rng.integers(0, decoder.vocab_size, size=context).tolist()
        decoder.reset()
        decoder.prefill(prompt)
        times: list[list[float]] = [[] for _ in range(max_len)]
        block = rng.integers(0, decoder.vocab_size, size=max_len).tolist()
        for rep in range(repeats + 1):
            order = range(1, max_len + 1) if rep % 2 else range(max_len, 0, -1)
            for n in order:
                decoder.truncate(context)
                t0 = time.perf_counter()
                if n == 1:
                    decoder.forward_token(block[0])
                else:
                    decoder.forward_batch(block[:n])
                if rep:  # the first round warms up
                    times[n - 1].append(time.perf_counter() - t0)
        decoder.reset()
        med = np.maximum.accumulate([float(np.median(t)) for t in times])
        return cls(tuple(float(x) for x in med))


def step_cost_ratio(a: Decoder, b: Decoder, *, context: int = 128, repeats: int = 12,
                    seed: int = 0) -> float:
    """Median over interleaved pairs of (one step of decoder a) / (one step of decoder b), at a
    context of `context` tokens (fewer where a cache holds fewer). The two may share KV
    buffers (a draft on its target's): each step is timed right after the other's, from the
    same cache length, and writes only past it."""
    rng = np.random.default_rng(seed)
    context = max(1, min(context, a.capacity - 1, b.capacity - 1))
    prompt = rng.integers(0, min(a.vocab_size, b.vocab_size), size=context).tolist()
    a.reset()
    b.reset()
    for d in (a, b):  # a first: a draft on b's buffers writes nowhere below b's length
        d.prefill(prompt)
    ratios = []
    for rep in range(repeats + 1):
        t = []
        for d in (a, b) if rep % 2 else (b, a):
            a.truncate(context)  # both: a draft on b's buffers may not write below b's length
            b.truncate(context)
            t0 = time.perf_counter()
            d.forward_token(prompt[rep % context])
            t.append(time.perf_counter() - t0)
        if rep:  # the first pair warms up
            ratios.append(t[0] / t[1] if rep % 2 else t[1] / t[0])
    a.reset()
    b.reset()
    return float(np.median(ratios))


@dataclasses.dataclass(frozen=True)
class CalibrationKey:
    """What a cost curve depends on, besides the code: the model's graph (its directory name
    and checksum), the provider, the machine, the intra-op threads (0: onnxruntime's default)
    and the build of ortspec's kernels that runs the graph's custom ops (`kernels`: its
    digest, "" where there is none), so that new kernels are measured anew."""

    model_dir: str
    graph_digest: str = ""
    providers: tuple[str, ...] = ()
    threads: int = 0
    min_rows: int = 1  # Manifest.min_call_rows
    kernels: str = ""

    def file_name(self) -> str:
        name = Path(self.model_dir).resolve().name
        model = f"{name}-{self.graph_digest[:16]}" if self.graph_digest else name
        suffix = f"-{self.threads}threads" if self.threads else ""
        if self.kernels:
            suffix += f"-kernels{self.kernels[:12]}"
        return f"{model}-{machine_key(self.providers)}{suffix}.json"


def machine_key(providers: Sequence[str]) -> str:
    return _file_safe(f"{providers[0] if providers else 'unknown'}-{cpu_model()}-"
                      f"{os.cpu_count()}cpu")


def _file_safe(text: str) -> str:
    """text with every character but letters, digits and -_. replaced by _ (for file names)."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def calibrated_cost_curve(decoder: Decoder, key: CalibrationKey | str | os.PathLike, *,
                          refresh: bool = False) -> CostCurve:
    """The decoder's cost curve over 1..decoder.max_verify_len tokens (16 if it states none),
    cached under `paths.cache_root()/calibration/` by `key` (a model directory alone is a key too);
    measured (a few seconds) when missing or on `refresh`."""
    if not isinstance(key, CalibrationKey):
        key = CalibrationKey(str(key))
    max_len = decoder.max_verify_len or 16
    path = cache_root() / "calibration" / key.file_name()

    def read(data: dict) -> CostCurve | None:
        secs = data["seconds"]
        if len(secs) == max_len and all(isinstance(x, float) and x > 0 for x in secs):
            return CostCurve(tuple(secs)).padded_to(key.min_rows)
        return None

    return _cached(path, read, lambda: CostCurve.measure(decoder, max_len=max_len).padded_to(
        key.min_rows), lambda curve: {"providers": list(key.providers), "model": key.model_dir,
                                      "seconds": list(curve.seconds),
                                      "relative": curve.relative()}, refresh=refresh)


def calibrated_step_ratio(draft: Decoder, target: Decoder, key: CalibrationKey, *,
                          draft_id: str, refresh: bool = False) -> float:
    """`step_cost_ratio(draft, target)`, cached beside the target's cost curve (`key`) under
    `draft_id` (what identifies the draft: its name and graph digest); measured when missing or
    on `refresh`. A draft's price then stays the same from one load of the model to the next,
    and so do the block sizes of a seeded request and hence its output."""
    path = cache_root() / "calibration" / key.file_name().replace(
        ".json", f"-step-{_file_safe(draft_id)}.json")

    def read(data: dict) -> float | None:
        ratio = data["ratio"]
        return ratio if isinstance(ratio, float) and ratio > 0 else None

    return _cached(path, read, lambda: step_cost_ratio(draft, target),
                   lambda ratio: {"model": key.model_dir, "draft": draft_id, "ratio": ratio},
                   refresh=refresh)


def _cached(path: Path, read: Callable[[dict], T | None], measure: Callable[[], T],
            record: Callable[[T], dict], *, refresh: bool) -> T:
    """The measurement cached at `path` (`_read_cached`), else (or on `refresh`) measure()
    stored as record(value). The lookup and the measuring hold `_measuring(path)`, so that
    processes sharing the cache (two servers, Ray Serve's replicas of one model, a target and a
    draft in processes of their own) measure one at a time, and those after the first read
    what it measured where they wanted the same: each timing its calls while another process
    times its own would measure the other's load, and keep it."""
    with _measuring(path):
        cached = None if refresh else _read_cached(path, read)
        if cached is not None:
            return cached
        value = measure()
        _store(path, {"version": CALIBRATION_VERSION, **record(value)})
        return value


@contextlib.contextmanager
def _measuring(path: Path) -> Iterator[None]:
    """An exclusive lock across the processes (and threads) sharing `path`'s directory, one
    for every measurement kept there (`measuring.lock`), since any timing is disturbed by any
    other on the machine; nothing where the file cannot be made (a read-only cache) or there is
    no `fcntl`. A process that has to wait says so. Not re-entrant: nothing measured under it
    asks for another measurement."""
    if fcntl is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.parent / "measuring.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another measurement to end before %s", path.name)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing it releases the lock)


def _read_cached(path: Path, read: Callable[[dict], T | None]) -> T | None:
    """read(data) of the measurement cached at `path`, when the file holds one of this
    CALIBRATION_VERSION that `read` accepts (it returns None for data it refuses, and may
    raise KeyError or TypeError on a malformed file); else None: measure again."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return read(data) if data.get("version") == CALIBRATION_VERSION else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _store(path: Path, data: dict) -> None:
    """Write a measurement to the cache atomically; a read-only cache only costs a
    re-measurement next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass


SURFACE_ROWS = (1, 2, 4, 8, 16)  # batch sizes a cost surface is measured at (up to the pool's)
SURFACE_TOKENS = (1, 2, 4, 8, 16)  # tokens a row (a one-row call of one token runs two)


Grid = tuple[tuple[float, ...], ...]  # seconds [len(rows)][len(tokens)]


@dataclasses.dataclass(frozen=True)
class CostSurface:
    """c(rows, tokens, context): the measured seconds of one batched call of `rows` rows, one
    of which appends `tokens` tokens (a pending token and tokens - 1 drafts) and the others one
    each, every row holding `context` tokens, on a grid (linear in between, and beyond the grid
    from its last two points). The call is the runner's: every row's block padded to `tokens`,
    the graph computing the real tokens only where it packs them (`token_rows`), all of them
    otherwise. A row's draft-length policy prices its block with `cost`, the cost of the shared
    call it will ride in, so speculation stops paying where the measurements say so.

    `seconds` is the grid at `context` tokens; `long_seconds`, where measured, the same grid at
    `long_context`. Between and beyond the two the cost is linear in the context (each token's
    attention reads every earlier one: at 8 rows of the default model's window export an extra
    token costs about 1 ms at 256 tokens and 1.6-2 ms at 1024), falling below `context` to
    LEAST_CONTEXT_SHARE of the cost there at most."""

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    seconds: Grid
    context: int = CALIBRATION_CONTEXT
    long_seconds: Grid | None = None
    long_context: int = 0

    def __post_init__(self) -> None:
        if self.long_seconds is not None and self.long_context <= self.context:
            raise ValueError(f"long_context ({self.long_context}) must exceed context "
                             f"({self.context})")

    def cost(self, rows: int, tokens: int, context: int | None = None) -> float:
        """Seconds of the call; `context` None: at the surface's first context."""
        near = _at(self.tokens, self._line(self.seconds, rows), tokens)
        if context is None or self.long_seconds is None:
            return near
        far = _at(self.tokens, self._line(self.long_seconds, rows), tokens)
        share = (max(0, context) - self.context) / (self.long_context - self.context)
        return max(near + share * (far - near), LEAST_CONTEXT_SHARE * near)

    def curve(self, rows: int, max_len: int) -> CostCurve:
        """The cost of a call at `rows` rows in which one row appends 1..max_len tokens and the
        others one each, at the first context (below the grid's first token count, that
        count's: `_at` holds the first point to the left)."""
        line = self._line(self.seconds, rows)
        return CostCurve(tuple(_at(self.tokens, line, n) for n in range(1, max_len + 1)))

    def _line(self, grid: Grid, rows: int) -> list[float]:
        """The seconds at each grid token count, at `rows` rows."""
        columns = np.asarray(grid).T  # [tokens][rows]
        return [_at(self.rows, column, rows) for column in columns]

    @classmethod
    def measure(cls, backend, *, max_len: int, floors: np.ndarray | None = None,
                context: int = CALIBRATION_CONTEXT, long_context: int = LONG_CONTEXT,
                repeats: int = 3, seed: int = 0) -> "CostSurface":
        """Time batched calls on `backend` (no other call running) with the rows at `context`
        tokens and, where the capacity allows more than that, at `long_context` (at most the
        capacity less the widest call), the grid interleaved so the machine's drift hits it
        alike; median per point, made non-decreasing along both axes and from the first
        context to the second. `floors` [max_rows]: lengths of caches in use, which the timed
        calls write past, never into (a row at its floor + max_len fits); the surface's
        contexts are the mean lengths the calls ran at, and a second one no longer than the
        first is left out."""
        rows = tuple(r for r in SURFACE_ROWS if r < backend.max_rows) + (backend.max_rows,)
        tokens = tuple(t for t in SURFACE_TOKENS if t < max_len) + (max_len,)
        rows, tokens = tuple(sorted(set(rows))), tuple(sorted(set(tokens)))
        widest = max(max_len, backend.min_rows)  # a one-row one-token point runs min_rows
        context = max(1, min(context, backend.capacity - widest))
        long_context = min(long_context, backend.capacity - widest)
        contexts = (context, long_context) if long_context > context else (context,)
        lengths = {c: np.full(backend.max_rows, c, np.int64) for c in contexts}
        if floors is not None:
            lengths = {c: np.where(np.maximum(at, floors) + widest <= backend.capacity,
                                   np.maximum(at, floors), floors) for c, at in lengths.items()}
        # each grid is labelled with the mean length its calls run at (rows whose floors lie
        # above a context run at their floors); a second context no longer than the first is
        # not timed
        ran = [int(round(float(lengths[c].mean()))) for c in contexts]
        if len(contexts) == 2 and ran[1] <= ran[0]:
            contexts, ran = contexts[:1], ran[:1]
        rng = np.random.default_rng(seed)
        times: dict[tuple[int, int, int], list[float]] = {
            (c, r, t): [] for c in contexts for r in rows for t in tokens}
        grid = list(times)
        for rep in range(repeats + 1):
            for c, r, t in grid if rep % 2 else grid[::-1]:
                # the call the runner makes (a one-row call of one token runs two)
                s = call_width(r, t, backend.min_rows)
                ids = rng.integers(0, backend.vocab_size, size=(r, s))
                real = np.concatenate([np.arange(t), s * np.arange(1, r)]).astype(np.int64)
                t0 = time.perf_counter()
                backend.run(0, r, ids, lengths[c][:r], take=real, real=real)
                if rep:  # the first round warms up
                    times[(c, r, t)].append(time.perf_counter() - t0)
        med = np.array([[[float(np.median(times[(c, r, t)])) for t in tokens] for r in rows]
                        for c in contexts])
        med = np.maximum.accumulate(np.maximum.accumulate(np.maximum.accumulate(
            med, axis=0), axis=1), axis=2)
        grids = [tuple(tuple(float(x) for x in line) for line in at) for at in med]
        if len(grids) == 1:
            return cls(rows, tokens, grids[0], ran[0])
        return cls(rows, tokens, grids[0], ran[0], grids[1], ran[1])


def _at(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    """ys at x: linear between the grid points xs, ys[0] below them, extended from the last two
    beyond them."""
    return float(np.interp(x, xs, ys)) if x <= xs[-1] else _extend(xs, ys, x)


def _extend(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    if len(xs) == 1:
        return float(ys[0]) * x / xs[0]
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + slope * (x - xs[-1]))


def calibrated_cost_surface(backend, key: CalibrationKey, *, max_len: int,
                            floors: np.ndarray | None = None, refresh: bool = False) -> CostSurface:
    """`CostSurface.measure` on `backend`, cached beside the cost curves (file name
    `<curve's>-batch<max_rows>.json`)."""
    path = cache_root() / "calibration" / key.file_name().replace(
        ".json", f"-batch{backend.max_rows}.json")

    def read(data: dict) -> CostSurface | None:
        long = data["long_seconds"]
        surface = CostSurface(tuple(data["rows"]), tuple(data["tokens"]),
                              tuple(tuple(line) for line in data["seconds"]), data["context"],
                              None if long is None else tuple(tuple(line) for line in long),
                              data["long_context"])
        grids = [surface.seconds] + ([] if surface.long_seconds is None else [surface.long_seconds])
        if surface.tokens[-1] == max_len and surface.rows[-1] == backend.max_rows and all(
                np.shape(g) == (len(surface.rows), len(surface.tokens)) and np.all(np.asarray(g) > 0)
                for g in grids):
            return surface
        return None

    def record(surface: CostSurface) -> dict:
        long = surface.long_seconds
        return {"model": key.model_dir, "rows": list(surface.rows),
                "tokens": list(surface.tokens), "context": surface.context,
                "seconds": [list(line) for line in surface.seconds],
                "long_context": surface.long_context,
                "long_seconds": None if long is None else [list(line) for line in long]}

    return _cached(path, read, lambda: CostSurface.measure(backend, max_len=max_len,
                                                           floors=floors), record,
                   refresh=refresh)
