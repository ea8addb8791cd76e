"""The documentation against the code: the constants README.md and docs/ quote, their links, and
the modules they tell the reader to run.

Each number is read from the docs' text with a regex next to a stable phrase and compared with
the constant the code uses, so changing either one without the other fails here. No model is
loaded; only the runtime and the standard library are imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ortspec.runtime.batching import prefix_cache, prompts, runner
from ortspec.runtime.decoding import protocols
from ortspec.runtime.drafters import draft_model, target_cache
from ortspec.runtime.model import DEFAULT_MAX_CONCURRENT
from ortspec.runtime.ort import sessions

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
# the Markdown a reader meets: the README and docs/, benchmark summaries included
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]

# Benchmark modules being moved out of scripts/ into runtime/bench/ in parallel; the docs
# already name them. Remove an entry once its module file exists under runtime/bench/.
PACKAGE_DIRS = {"ortspec.runtime": REPO / "runtime", "ortspec.export": REPO / "export"}


def _text(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


def _numbers(name: str, pattern: str) -> list[str]:
    """Every match of `pattern`'s group in file `name` (whitespace in the pattern matches any run
    of whitespace, line breaks included); at least one."""
    rx = re.compile(pattern.replace(" ", r"\s+"))
    found = rx.findall(_text(name))
    assert found, f"{name}: no text matches {pattern!r}; the sentence quoting the constant moved"
    return found


def _export_constant(name: str):
    """A literal constant of export/api.py, read without importing the export (torch)."""
    tree = ast.parse(_text("export/api.py"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"export/api.py has no constant {name}")


PHRASE = object()  # a pattern without a number: only the phrase must be there

# (file, pattern with one group, the value the code uses)
QUOTED = [
    # the batch runner's prefill budget: the prompts waiting at once share a call of this many
    ("docs/architecture.md", r"share a prefill call of up to (\d+) prompt tokens in all", runner.BATCH_PREFILL_TOKENS),
    ("docs/architecture.md", r"\((`BATCH_PREFILL_TOKENS`) in `batching/runner.py`\)", PHRASE),
    ("docs/batching.md", r"prefill calls of up to (\d+) tokens in all", runner.BATCH_PREFILL_TOKENS),
    ("docs/serve.md", r"prefill calls of up to (\d+) prompt tokens in all", runner.BATCH_PREFILL_TOKENS),
    # the prefix-wait threshold and the barrier
    ("docs/architecture.md", r"at least (\d+) more tokens \(`PREFIX_WAIT_TOKENS`\)", prompts.PREFIX_WAIT_TOKENS),
    ("docs/architecture.md", r"never less than (\d+) ms \(`GATHER_SECONDS`\)", round(runner.GATHER_SECONDS * 1000)),
    ("docs/architecture.md", r"\(`WAIT_FRACTION` ([\d.]+) of", runner.WAIT_FRACTION),
    # the ORT decoder's prompt chunks, and the fallback of a decoder that states no block limit
    ("docs/architecture.md", r"chunks of up to (\d+) tokens, `PROMPT_CHUNK`", sessions.PROMPT_CHUNK),
    ("docs/architecture.md", r"would pass (\d+) MiB", sessions.PROMPT_SCRATCH_BYTES >> 20),
    ("docs/architecture.md", r"chunks of `DYNAMIC_PREFILL_CALL_TOKENS`, (\d+),", sessions.DYNAMIC_PREFILL_CALL_TOKENS),
    ("docs/architecture.md", r"`FALLBACK_PREFILL_CHUNK` \((\d+)\)", protocols.FALLBACK_PREFILL_CHUNK),
    ("docs/concurrency.md", r"chunked prefills \((\d+) × vocab floats", sessions.DYNAMIC_PREFILL_CALL_TOKENS),
    # slots
    ("docs/architecture.md", r"\(`DEFAULT_MAX_CONCURRENT`, (\d+)\)", DEFAULT_MAX_CONCURRENT),
    ("docs/concurrency.md", r"`max_concurrent` \(default (\d+)\)", DEFAULT_MAX_CONCURRENT),
    # the prefix cache's default size
    ("docs/architecture.md", r"\(`DEFAULT_PREFIX_CACHE_MIB`, (\d+) MiB", prefix_cache.DEFAULT_PREFIX_CACHE_MIB),
    ("docs/batching.md", r"\(`prefix_cache_mib`, (\d+) MiB by default\)", prefix_cache.DEFAULT_PREFIX_CACHE_MIB),
    ("docs/serve.md", r"\(`--prefix-cache-mib`, (\d+) MiB by default", prefix_cache.DEFAULT_PREFIX_CACHE_MIB),
    ("docs/serve.md", r"\| `--prefix-cache-mib` \| (\d+) \|", prefix_cache.DEFAULT_PREFIX_CACHE_MIB),
    ("README.md", r"\[--prefix-cache-mib (\d+)\]", prefix_cache.DEFAULT_PREFIX_CACHE_MIB),
    # drafters
    ("docs/draft-models.md", r"passes `draft_context=(\w+)` by default", draft_model.DEFAULT_DRAFT_CONTEXT),
    ("docs/drafters.md", r"kept as its top (\d+) tokens renormalised", target_cache.CACHED_TOP),
    # the window export's rows
    ("docs/architecture.md", r"manifest `max_batch` (\d+)\)", _export_constant("MAX_BATCH")["window"]),
    ("docs/batching.md", r"the manifest's `max_batch`, (\d+)\)", _export_constant("MAX_BATCH")["window"]),
    ("docs/serve.md", r"the manifest's `max_batch`, (\d+);", _export_constant("MAX_BATCH")["window"]),
]


@pytest.mark.parametrize("name, pattern, value", QUOTED, ids=[f"{n}:{p[:40]}" for n, p, _ in QUOTED])
def test_quoted_constant_matches_the_code(name, pattern, value):
    for found in _numbers(name, pattern):
        if value is PHRASE:
            continue
        if isinstance(value, float):
            assert float(found) == value, f"{name} says {found} ({pattern!r}), the code {value}"
        else:
            assert found == str(value), f"{name} says {found!r} ({pattern!r}), the code {value!r}"


def test_serve_defaults_match_the_docs():
    serve_cli = pytest.importorskip("ortspec.runtime.serve.cli", reason="the serve extra")
    from ortspec.runtime.serve.engine import BATCHED_MAX_CONCURRENT

    args = serve_cli.build_parser().parse_args([])
    for name in ("README.md", "docs/serve.md"):
        assert _numbers(name, r"\[--max-(concurrent) N\]") == ["concurrent"]  # from the model
        assert _numbers(name, r"\[--max-queue (\d+)\]") == [str(args.max_queue)]
    assert args.max_concurrent is None  # serve.engine.default_max_concurrent of the model
    assert _numbers("docs/serve.md", r"\| `--max-concurrent` \| (\d+) on a batching model") \
        == [str(BATCHED_MAX_CONCURRENT)]
    assert _numbers("docs/serve.md", r"at most its `max_batch`\), else (\d+) \|") \
        == [str(DEFAULT_MAX_CONCURRENT)]
    assert args.prefix_cache_mib == prefix_cache.DEFAULT_PREFIX_CACHE_MIB
    drafters = next(a for a in serve_cli.build_parser()._actions if a.dest == "drafter")
    assert _numbers("docs/serve.md", r"\[--drafter ([a-z0-9|+-]+)\]") == ["|".join(drafters.choices)]
    assert _numbers("docs/serve.md", r"\| `--drafter` \| ([a-z-]+) \|") == [args.drafter]


def test_the_serve_examples_name_the_model_the_default_export_serves():
    from ortspec.runtime.paths import DEFAULT_MODEL_NAME

    for name in ("README.md", "docs/serve.md"):
        ids = re.findall(r"""model["']?\s*[:=]\s*["']([^"']+)["']""", _text(name))
        assert ids and set(ids) == {DEFAULT_MODEL_NAME}, (name, ids)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans: formulas such as `E[tokens](k)`
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_relative_links_point_at_files(page):
    broken = []
    for target in _relative_links(page):
        path = target.split("#", 1)[0]
        if not path:  # a link within the page
            continue
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: links to missing files: {broken}"


MODULE = re.compile(r"python -m (ortspec(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def _module_file(module: str) -> Path | None:
    for package, directory in PACKAGE_DIRS.items():
        if module == package or module.startswith(package + "."):
            rest = module[len(package):].lstrip(".").split(".") if module != package else []
            base = directory.joinpath(*rest)
            for candidate in (base.with_suffix(".py"), base / "__main__.py"):
                if rest and candidate.is_file():
                    return candidate
    return None


def test_modules_the_docs_run_exist():
    named = {m for page in PAGES for m in MODULE.findall(page.read_text(encoding="utf-8"))}
    assert "ortspec.runtime.cli" in named  # the pattern still finds what it should
    missing = sorted(m for m in named if _module_file(m) is None)
    assert not missing, f"`python -m` modules named in the docs without a module file: {missing}"


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = _text("README.md").splitlines()
    assert len(lines) <= 200
    head = "\n".join(lines[:30])
    assert "make demo" in head and "make test" in head
