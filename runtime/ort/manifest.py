"""The model directory's schema: `manifest.json`, read and validated before anything is opened.

A model directory holds everything the runtime needs and nothing it executes:

    manifest.json    this schema (format version 1)
    *.onnx, *.data   the graph(s) and their weights, stored once
    tokenizer.json   for the `tokenizers` library

The export writes the manifest with `Manifest.to_json`; the runtime reads it with
`read_manifest`, which checks types and ranges and that every file it names stays inside the
directory and matches its recorded sha256. Graph inputs and outputs follow fixed names
(`ortspec.runtime.ort.graph_io`):

    input_ids                  int64  [B, S]
    attention_mask             int64  [B, W]   row b: past_b + S ones, then zeros (W >= each)
    position_ids (optional)    int64  [B, S]
    logit_rows (optional)      int64  [N]      positions b * S + s whose logits the call computes
    token_rows (optional)      int64  [M]      positions b * S + s whose tokens the call computes
    past_key_values.{i}.key    dtype  [B, kv_heads, capacity, head_dim]   bound to present.{i}.key
    past_key_values.{i}.value  dtype  [B, kv_heads, capacity, head_dim]   bound to present.{i}.value
    logits                     fp32   [N, vocab]   row n: after position logit_rows[n]
                                      (a graph without logit_rows: [B, S, vocab])
    hidden_states (optional)   fp32   [N, K * hidden]  row n: at position logit_rows[n], the
                                      residual streams entering the K decoder layers that
                                      `hidden_state_layers` lists, concatenated in its order

ortspec's exports (exporter revision 3 on) take `logit_rows` and run the LM head on the
positions it names only: a prompt chunk asks for its last position, a padded block for its real
ones (graph_io.logit_rows_for). A graph without it (an earlier export, onnxruntime-genai's)
computes every position; `OrtDecoder` runs both, batched decoding needs the input.

The batched graph (`--attention window`, exporter revision 5 on) also takes `token_rows`: its
MatMuls, norms and LM head run on those M positions only (each row's own tokens, not its
padding nor the rows riding along; graph_io.token_rows_for), gathered into [M, hidden], and
only the attention sees the [B, S] grid. A call then costs about what its M tokens do, not
B * S, so a row's drafts do not make every other row of the call pay for their width.

B is 1 unless the manifest's `max_batch` says the graph takes more rows (see
`ortspec.runtime.batching.runner`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path, PureWindowsPath
from typing import Any

from ..errors import ManifestError
from ..paths import export_command
from .onnx_guard import check_graph
from ..validation import is_int

FORMAT_NAME = "ortspec-model"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
DTYPES = ("fp32", "fp16")
ENTRY_POINTS = ("step", "verify")
MAX_MIN_CALL_ROWS = 2
MAX_BATCH = 256  # the most rows a manifest may declare for one batched call
# extra["attention"] of an export attending with the package's ortspec.CacheAttention kernel
CACHE_ATTENTION_OP = "CacheAttention"
MAX_HIDDEN_STATE_LAYERS = 8  # the most layer ids `hidden_state_layers` may list (EAGLE-3: 3)


# architectures an export may record ("llama" covers Llama 2/3, SmolLM and Mistral)
FAMILIES = ("llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3")

@dataclasses.dataclass(frozen=True)
class Architecture:
    family: str  # one of FAMILIES: the architecture the graph was built from
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int


@dataclasses.dataclass(frozen=True)
class EntryPoint:
    graph: str  # file name inside the model directory
    min_len: int  # shortest block of new tokens this entry point accepts
    max_len: int  # longest
    provider: str = "any"  # "any", or the execution provider this graph flavour is built for


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """A chat template reduced to plain string pieces, applied without executing anything.

    A conversation renders as `prefix` + for each message `message.format(role=, content=)` +
    (`generation_prompt` when a reply is wanted). `default_system` is inserted as a system message
    when the conversation has none and it is not empty.
    """

    message: str
    generation_prompt: str
    prefix: str = ""
    default_system: str = ""

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        msgs = list(messages)
        if self.default_system and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.default_system})
        parts = [self.prefix]
        for m in msgs:
            # str.replace, not str.format: message content may contain braces
            parts.append(self.message.replace("{role}", m["role"]).replace("{content}", m["content"]))
        if add_generation_prompt:
            parts.append(self.generation_prompt)
        return "".join(parts)


@dataclasses.dataclass(frozen=True)
class Manifest:
    source: dict[str, Any]  # {"kind": "gguf"|"hf"|"default", "path": str, "sha256": str}
    architecture: Architecture
    dtype: str
    capacity: int
    max_verify_len: int
    entry_points: dict[str, EntryPoint]
    stop_token_ids: tuple[int, ...]
    tokenizer: str
    chat_format: ChatFormat | None
    chat_template: str | None = None  # the original Jinja text, informational only
    bos_token_id: int | None = None
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> sha256
    draft_of: str | None = None  # for a self-speculative draft: relative path of its target
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # the fewest rows (tokens, over all of a call's B rows) any call of the graph runs: 2 pads a
    # single new token with a copy of itself (the extra row is dropped, its KV slot overwritten
    # by the next call), because onnxruntime's CPU kernels compute one row differently from the
    # same row among several (see runtime/row_invariance.py); the usable capacity is then one
    # token less. A batched call of one token a row over B >= 2 rows needs no padding
    # (graph_io.call_width): its MatMuls see B rows, and the window graph's attention multiplies
    # a token's whole group of query heads at once
    min_call_rows: int = 1
    # the fewest query rows the graph's attention runs: 2 where the graph itself pads a
    # one-token call's attention with a copy of the token (its MatMuls run the one row), since
    # onnxruntime's CPU GroupQueryAttention computes a lone query on another path (the quantized
    # GQA exports); that copy's key/value slot is one past the call's, so the usable capacity is
    # one token less here too
    min_attention_rows: int = 1
    # with min_attention_rows 2: a small graph of the export's row-wise kernels (a file of the
    # directory, listed in `files`) the runtime runs at load; where one of them computes a lone
    # row otherwise than among several on this machine, every call runs two rows
    # (runtime/row_invariance.lone_rows_exact)
    row_probe: str | None = None
    # the most requests one call may carry: the window-attention graph takes B rows, each with
    # its own valid length; 1 for the rest
    max_batch: int = 1
    # the graph's optional `hidden_states` output: the ids k (1..num_layers - 1, distinct) of
    # the decoder layers whose entering residual stream it returns (the output of layer k - 1,
    # before the final norm; transformers' `hidden_states[k]`; vLLM's EAGLE-3
    # aux_hidden_state_layers), in the order of its columns; None: no such output
    hidden_state_layers: tuple[int, ...] | None = None
    # a trained draft head (EAGLE-3) exported beside the model: its directory, relative to the
    # model directory (e.g. "drafts/eagle3"); None: no head
    draft_head: str | None = None

    @property
    def hidden_state_width(self) -> int:
        """Columns of the `hidden_states` output (0 without it)."""
        return len(self.hidden_state_layers or ()) * self.architecture.hidden_size

    @property
    def precision(self) -> str:
        """The weights' precision in words: `dtype` (the activations' and the KV cache's) where
        the weights are float, else e.g. "int4 weights (8-bit head), fp32 activations"."""
        weights = self.extra.get("weights")
        if not isinstance(weights, dict) or not isinstance(weights.get("bits"), int):
            return self.dtype
        head = weights.get("lm_head_bits")  # None: a float head
        head = " (float head)" if head is None else "" if head == weights["bits"] else \
            f" ({head}-bit head)"
        return f"int{weights['bits']} weights{head}, {self.dtype} activations"

    @property
    def reserved_slots(self) -> int:
        """KV slots past the usable capacity that a padded call may write."""
        return max(self.min_call_rows, self.min_attention_rows) - 1

    @property
    def rows_exact(self) -> bool:
        """Whether a verify row must equal its step bit for bit: a graph that pads lone rows, or
        one attending with ortspec.CacheAttention, whose kernels compute a row alike at every
        call size (export/attention.py)."""
        return self.reserved_slots > 0 or self.attends_in_place

    @property
    def attends_in_place(self) -> bool:
        """Whether the graph attends with ortspec.CacheAttention: each query over its own row
        of the cache, read in place up to its position."""
        return self.extra.get("attention") == CACHE_ATTENTION_OP

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        if self.hidden_state_layers is None:  # an optional field: absent, as in older manifests
            del d["hidden_state_layers"]
        else:
            d["hidden_state_layers"] = list(self.hidden_state_layers)
        if self.draft_head is None:  # optional too
            del d["draft_head"]
        return json.dumps({"format": FORMAT_NAME, **d}, indent=2, sort_keys=False) + "\n"

    def write(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / MANIFEST_FILE
        path.write_text(self.to_json(), encoding="utf-8")
        return path


def sha256_file(path: str | os.PathLike, *, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def safe_member(directory: Path, name: str, *, what: str) -> Path:
    """`directory / name`, refusing absolute paths, `..`, and symlinks that lead outside."""
    if not isinstance(name, str) or not name:
        raise ManifestError(f"{what}: expected a file name, got {name!r}")
    p = Path(name)
    if p.is_absolute() or ".." in p.parts or name.startswith(("/", "\\")):
        raise ManifestError(f"{what}: {name!r} must be a relative path inside the model directory")
    full = directory / p
    root = directory.resolve()
    resolved = full.resolve()
    if resolved != root and root not in resolved.parents:
        raise ManifestError(f"{what}: {name!r} resolves outside the model directory ({resolved})")
    return full


# -- validation ---------------------------------------------------------------------------------


def _get(d: dict, key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise ManifestError(f"{where}: missing required field {key!r}")
    v = d[key]
    if typ is int and not is_int(v):
        raise ManifestError(f"{where}.{key}: expected an integer, got {v!r}")
    if not isinstance(v, typ):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise ManifestError(f"{where}.{key}: expected {names}, got {type(v).__name__} {v!r}")
    return v


def _int_in(d: dict, key: str, lo: int, hi: int, where: str) -> int:
    v = _get(d, key, int, where)
    if not lo <= v <= hi:
        raise ManifestError(f"{where}.{key} = {v} is out of range; allowed {lo}..{hi}")
    return v


def parse_manifest(data: Any) -> Manifest:
    """Check a decoded manifest.json against the schema; every error names the field."""
    if not isinstance(data, dict):
        raise ManifestError(f"manifest: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT_NAME:
        raise ManifestError(f"manifest.format: expected {FORMAT_NAME!r}, got {data.get('format')!r}")
    version = _get(data, "format_version", int, "manifest")
    if version != FORMAT_VERSION:
        raise ManifestError(
            f"manifest.format_version = {version}; this ortspec reads version {FORMAT_VERSION}"
        )
    a = _get(data, "architecture", dict, "manifest")
    w = "manifest.architecture"
    family = _get(a, "family", str, w)
    if family not in FAMILIES:
        raise ManifestError(f"{w}.family = {family!r}; supported: {', '.join(map(repr, FAMILIES))}")
    arch = Architecture(
        family=family,
        num_layers=_int_in(a, "num_layers", 1, 1024, w),
        num_heads=_int_in(a, "num_heads", 1, 1024, w),
        num_kv_heads=_int_in(a, "num_kv_heads", 1, 1024, w),
        head_dim=_int_in(a, "head_dim", 1, 4096, w),
        hidden_size=_int_in(a, "hidden_size", 1, 1 << 20, w),
        vocab_size=_int_in(a, "vocab_size", 2, 1 << 24, w),
    )
    if arch.num_heads % arch.num_kv_heads:
        raise ManifestError(
            f"{w}: num_heads {arch.num_heads} is not a multiple of num_kv_heads {arch.num_kv_heads}"
        )
    dtype = _get(data, "dtype", str, "manifest")
    if dtype not in DTYPES:
        raise ManifestError(f"manifest.dtype = {dtype!r}; allowed: {', '.join(DTYPES)}")
    capacity = _int_in(data, "capacity", 2, 1 << 20, "manifest")
    max_verify_len = _int_in(data, "max_verify_len", 1, min(capacity, 4096), "manifest")
    eps = _get(data, "entry_points", dict, "manifest")
    entry_points = {}
    for name in ENTRY_POINTS:
        if name not in eps:
            raise ManifestError(f"manifest.entry_points: missing {name!r} (need {ENTRY_POINTS})")
    for name, e in eps.items():
        where = f"manifest.entry_points.{name}"
        if not isinstance(e, dict):
            raise ManifestError(f"{where}: expected an object")
        graph = _get(e, "graph", str, where)
        lo = _int_in(e, "min_len", 1, capacity, where)
        hi = _int_in(e, "max_len", lo, capacity, where)
        provider = e.get("provider", "any")
        if not isinstance(provider, str):
            raise ManifestError(f"{where}.provider: expected a string, got {provider!r}")
        entry_points[name] = EntryPoint(graph=graph, min_len=lo, max_len=hi, provider=provider)
    if entry_points["step"].min_len != 1:
        raise ManifestError("manifest.entry_points.step must accept a block of 1 token")
    if entry_points["verify"].max_len != max_verify_len:
        raise ManifestError(
            f"manifest.entry_points.verify.max_len = {entry_points['verify'].max_len} "
            f"but max_verify_len = {max_verify_len}; they must agree"
        )
    stops = _get(data, "stop_token_ids", list, "manifest")
    for t in stops:
        if not is_int(t) or not 0 <= t < arch.vocab_size:
            raise ManifestError(
                f"manifest.stop_token_ids: {t!r} is not a token id in 0..{arch.vocab_size - 1}"
            )
    bos = data.get("bos_token_id")
    if bos is not None and (not is_int(bos) or not 0 <= bos < arch.vocab_size):
        raise ManifestError(f"manifest.bos_token_id = {bos!r} is not a token id")
    chat = data.get("chat_format")
    chat_format = None
    if chat is not None:
        if not isinstance(chat, dict):
            raise ManifestError("manifest.chat_format: expected an object or null")
        w = "manifest.chat_format"
        chat_format = ChatFormat(
            message=_get(chat, "message", str, w),
            generation_prompt=_get(chat, "generation_prompt", str, w),
            prefix=chat.get("prefix", "") if isinstance(chat.get("prefix", ""), str) else "",
            default_system=chat.get("default_system", "")
            if isinstance(chat.get("default_system", ""), str) else "",
        )
        if "{content}" not in chat_format.message:
            raise ManifestError(f"{w}.message must contain '{{content}}'")
    files = data.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in files.items()
    ):
        raise ManifestError("manifest.files: expected an object of file name -> sha256 hex")
    source = _get(data, "source", dict, "manifest")
    template = data.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ManifestError("manifest.chat_template: expected a string or null")
    draft_of = data.get("draft_of")
    if draft_of is not None and not isinstance(draft_of, str):
        raise ManifestError("manifest.draft_of: expected a string or null")
    extra = data.get("extra", {})
    if not isinstance(extra, dict):
        raise ManifestError("manifest.extra: expected an object")
    min_rows = _int_in(data, "min_call_rows", 1, MAX_MIN_CALL_ROWS, "manifest") \
        if "min_call_rows" in data else 1
    if min_rows > max_verify_len or min_rows >= capacity:
        raise ManifestError(f"manifest.min_call_rows = {min_rows} needs max_verify_len >= "
                            f"{min_rows} and capacity > {min_rows}")
    attention_rows = _int_in(data, "min_attention_rows", 1, MAX_MIN_CALL_ROWS, "manifest") \
        if "min_attention_rows" in data else 1
    if attention_rows > max_verify_len or attention_rows >= capacity:
        raise ManifestError(f"manifest.min_attention_rows = {attention_rows} needs "
                            f"max_verify_len >= {attention_rows} and capacity > {attention_rows}")
    row_probe = data.get("row_probe")
    if row_probe is not None and not (isinstance(row_probe, str) and row_probe in files):
        raise ManifestError("manifest.row_probe: expected null or a file name listed in "
                            "manifest.files")
    max_batch = _int_in(data, "max_batch", 1, MAX_BATCH, "manifest") if "max_batch" in data else 1
    hidden_layers = _hidden_state_layers(data.get("hidden_state_layers"), arch.num_layers)
    draft_head = _relative_dir(data.get("draft_head"), "manifest.draft_head")
    return Manifest(
        source=source, architecture=arch, dtype=dtype, capacity=capacity,
        max_verify_len=max_verify_len, entry_points=entry_points, stop_token_ids=tuple(stops),
        tokenizer=_get(data, "tokenizer", str, "manifest"), chat_format=chat_format,
        chat_template=template, bos_token_id=bos, files=dict(files), draft_of=draft_of,
        extra=extra, format_version=version, min_call_rows=min_rows,
        min_attention_rows=attention_rows, row_probe=row_probe, max_batch=max_batch,
        hidden_state_layers=hidden_layers, draft_head=draft_head,
    )


def _relative_dir(value: Any, what: str) -> str | None:
    """null/absent, or a relative path inside the model directory: not absolute (POSIX or
    Windows), no '..'."""
    if value is None:
        return None
    windows = PureWindowsPath(value) if isinstance(value, str) else None
    if not isinstance(value, str) or not value or Path(value).is_absolute() or windows.anchor \
            or ".." in windows.parts:
        raise ManifestError(f"{what}: expected null or a relative path inside the model "
                            f"directory, got {value!r}")
    return value


def _hidden_state_layers(value: Any, num_layers: int) -> tuple[int, ...] | None:
    """manifest.hidden_state_layers: null/absent, or 1..MAX_HIDDEN_STATE_LAYERS distinct layer
    ids in 1..num_layers - 1."""
    if value is None:
        return None
    where = "manifest.hidden_state_layers"
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_HIDDEN_STATE_LAYERS:
        raise ManifestError(f"{where}: expected null or a list of 1..{MAX_HIDDEN_STATE_LAYERS} "
                            f"layer ids, got {value!r}")
    for k in value:
        if not is_int(k) or not 1 <= k <= num_layers - 1:
            raise ManifestError(f"{where}: {k!r} is not a layer id in 1..{num_layers - 1} (the "
                                f"decoder layer whose entering residual stream is returned)")
    if len(set(value)) != len(value):
        raise ManifestError(f"{where}: layer ids repeat: {value!r}")
    return tuple(value)


def read_manifest(directory: str | os.PathLike, *, verify_checksums: bool = True) -> Manifest:
    """Read and validate `directory/manifest.json`; check that its files exist inside the
    directory and (by default) match their recorded sha256."""
    d = Path(directory)
    if not d.is_dir():
        command = export_command(d)
        hint = f"; the default model's export: make it with `{command}`" if command else ""
        raise ManifestError(f"model directory {str(d)!r} does not exist or is not a "
                            f"directory{hint}")
    path = d / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"{str(d)!r} has no {MANIFEST_FILE}; is it an `ortspec export` output?")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    m = parse_manifest(data)
    named = {m.tokenizer, *(e.graph for e in m.entry_points.values())}
    for name in sorted(named):
        if not safe_member(d, name, what="manifest file").is_file():
            raise ManifestError(f"manifest names {name!r}, which is missing from {str(d)!r}")
        if name not in m.files:
            raise ManifestError(f"manifest.files has no sha256 for {name!r}")
    for name, digest in m.files.items():
        p = safe_member(d, name, what="manifest.files")
        if not p.is_file():
            raise ManifestError(f"manifest.files names {name!r}, which is missing from {str(d)!r}")
        if verify_checksums and sha256_file(p) != digest:
            raise ManifestError(f"{name!r} does not match its sha256 in the manifest (corrupted?)")
    for name in sorted({e.graph for e in m.entry_points.values()}):
        # what the graph would make onnxruntime open: inside, listed, and the I/O expected
        check_graph(d, name, files=m.files, num_layers=m.architecture.num_layers,
                    hidden_states=m.hidden_state_layers is not None)
    return m

