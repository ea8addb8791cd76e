"""resolve_providers: onnxruntime's convention, defaults filtered by what the graph is built for,
and TensorRT options (checked without a GPU by pretending the providers exist)."""

from __future__ import annotations

import pytest

import ortspec.runtime.ort.providers as providers_mod
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.errors import ProviderError
from ortspec.runtime.ort.providers import CPU, CUDA, TENSORRT, default_kv_mode, kv_device, \
    resolve_providers, tensorrt_profiles


def _manifest(dtype: str, provider: str) -> mf.Manifest:
    arch = mf.Architecture(family="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                           hidden_size=64, vocab_size=320)
    return mf.Manifest(
        source={"kind": "hf", "path": "x", "sha256": "0" * 64}, architecture=arch, dtype=dtype,
        capacity=128, max_verify_len=8,
        entry_points={"step": mf.EntryPoint("model.onnx", 1, 1, provider),
                      "verify": mf.EntryPoint("model.onnx", 1, 8, provider)},
        stop_token_ids=(2,), tokenizer="tokenizer.json", chat_format=None)


@pytest.fixture()
def gpu_build(monkeypatch):
    monkeypatch.setattr(providers_mod, "available_providers", lambda: [TENSORRT, CUDA, CPU])


def test_default_on_this_build_is_the_cpu():
    assert resolve_providers(None) == [(CPU, {})]


def test_explicit_missing_provider_names_what_is_available(monkeypatch):
    monkeypatch.setattr(providers_mod, "available_providers", lambda: [CPU])
    with pytest.raises(ProviderError, match="'CUDAExecutionProvider' is not available.*"
                                            "available: CPUExecutionProvider"):
        resolve_providers(["cuda"])
    with pytest.raises(ProviderError):
        resolve_providers([])
    with pytest.raises(ProviderError, match="neither a name"):
        resolve_providers([42])


def test_names_pairs_and_aliases_are_accepted():
    assert resolve_providers("cpu") == [(CPU, {})]
    assert resolve_providers([(CPU, {"arena_extend_strategy": "kSameAsRequested"})]) == \
        [(CPU, {"arena_extend_strategy": "kSameAsRequested"})]
    assert resolve_providers((CPU, {})) == [(CPU, {})]


def test_defaults_keep_only_providers_the_graph_is_built_for(gpu_build):
    # fp32 GQA graph: CUDA's GQA kernel is fp16-only and TensorRT does not import GQA
    assert [n for n, _ in resolve_providers(None, manifest=_manifest("fp32", CPU))] == [CPU]
    fp16 = _manifest("fp16", f"{CUDA},{CPU}")
    assert [n for n, _ in resolve_providers(None, manifest=fp16)] == [CUDA, CPU]
    # a graph for any provider: the full default order
    assert [n for n, _ in resolve_providers(None, manifest=_manifest("fp16", "any"))] == \
        [TENSORRT, CUDA, CPU]


def test_tensorrt_gets_cache_fp16_and_profiles(gpu_build, tmp_path):
    m = _manifest("fp16", "any")
    [(name, opts)] = resolve_providers(["tensorrt"], manifest=m, model_dir=tmp_path)
    assert name == TENSORRT
    assert opts["trt_engine_cache_enable"] is True and opts["trt_fp16_enable"] is True
    assert opts["trt_engine_cache_path"] == str(tmp_path / "trt_cache")
    # what the caller passes wins over the defaults
    [(_, mine)] = resolve_providers([("tensorrt", {"trt_fp16_enable": False})], manifest=m)
    assert mine["trt_fp16_enable"] is False


def test_tensorrt_profiles_cover_step_and_verify_at_capacity():
    p = tensorrt_profiles(_manifest("fp32", "any"))
    mins, opts, maxs = (p[f"trt_profile_{k}_shapes"].split(",") for k in ("min", "opt", "max"))
    per_profile = 3 + 2 * 2  # input_ids, attention_mask, logit_rows, 2 layers x (key, value)
    assert len(mins) == len(opts) == len(maxs) == 2 * per_profile
    assert mins[0] == "input_ids:1x1" and maxs[0] == "input_ids:1x1"  # step: S = 1
    assert mins[per_profile] == "input_ids:1x1" and maxs[per_profile] == "input_ids:1x8"
    assert maxs[1] == "attention_mask:1x128"
    assert mins[2] == "logit_rows:1" and maxs[per_profile + 2] == "logit_rows:8"  # N <= S
    assert "past_key_values.1.value:1x2x128x16" in maxs


def test_kv_lives_on_the_device_of_the_first_provider():
    assert kv_device([(CPU, {})]) == ("cpu", 0)
    assert kv_device([(CUDA, {"device_id": 1}), (CPU, {})]) == ("cuda", 1)
    assert kv_device([(TENSORRT, {}), (CUDA, {})]) == ("cuda", 0)


def test_only_tensorrt_gets_ping_pong_kv_buffers():
    assert default_kv_mode([(TENSORRT, {}), (CUDA, {}), (CPU, {})]) == "ping-pong"
    assert default_kv_mode([(CUDA, {}), (CPU, {})]) == "shared"
    assert default_kv_mode([(CPU, {})]) == "shared"
