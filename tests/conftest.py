"""Test-session settings shared by every test module."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_calibration_cache(tmp_path_factory):
    """Cost-curve calibrations go to a directory of this session's, not the user's cache: models
    built by tests must not leave files behind, and a calibration from another run must not
    decide a test's draft lengths. Subprocesses (the CLI tests) inherit it."""
    old = os.environ.get("ORTSPEC_CACHE_DIR")
    os.environ["ORTSPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("ortspec-cache"))
    yield
    if old is None:
        os.environ.pop("ORTSPEC_CACHE_DIR", None)
    else:
        os.environ["ORTSPEC_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def window_fp32():
    """The default model exported with `--attention window` (batched decoding), fp32."""
    from ortspec.export import ensure_default_model

    return ensure_default_model("fp32", attention="window", progress=False)


@pytest.fixture(scope="session")
def model_dir():
    """The default model's fp32 export (exported on first use, cached under models/)."""
    pytest.importorskip("onnx", reason="the export extra makes the default model")
    from ortspec import export
    return export.ensure_default_model("fp32", progress=False)


@pytest.fixture(scope="session")
def int4_model_dir():
    """The default model's int4 export, its native precision."""
    pytest.importorskip("onnx", reason="the export extra makes the model")
    from ortspec import export
    return export.ensure_default_model(quant="int4", progress=False)


@pytest.fixture(scope="module")
def tiny_dir(request, tmp_path_factory):
    """The module's tiny model directory. A module that sets `TINY_EXPORT = {"seed": ...,
    "capacity": ..., "max_verify_len": ...}` gets a random tiny Llama (ortspec.export.tiny) exported
    with those settings; one that sets `TINY_EXPORT = None` gets the hand-written graph of
    `helpers.export.write_graph_dir`, which needs no torch."""
    from helpers.export import write_graph_dir

    spec = getattr(request.module, "TINY_EXPORT")
    if spec is None:
        return write_graph_dir(tmp_path_factory.mktemp("tiny") / "model")
    from ortspec.export import export_model
    from ortspec.export.tiny import make_tiny_llama

    spec = dict(spec)
    src = make_tiny_llama(tmp_path_factory.mktemp("src") / "tiny-llama", seed=spec.pop("seed"))
    return export_model(src, out=tmp_path_factory.mktemp("out") / "llama", progress=False, **spec)
