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

    return ensure_default_model(attention="window", progress=False)
