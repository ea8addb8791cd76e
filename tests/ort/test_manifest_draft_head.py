"""manifest.draft_head: an optional relative directory inside the model directory."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ortspec.runtime.errors import ManifestError
from ortspec.runtime.ort import manifest as mf

TINY_EXPORT = None  # the hand-written graph: no torch needed


@pytest.fixture(scope="module")
def data(tiny_dir) -> dict:
    return json.loads(mf.read_manifest(tiny_dir).to_json())


def test_absent_means_no_head_and_is_not_written(data):
    assert "draft_head" not in data
    assert mf.parse_manifest(data).draft_head is None


def test_a_relative_directory_round_trips(data):
    m = mf.parse_manifest({**data, "draft_head": "drafts/eagle3"})
    assert m.draft_head == "drafts/eagle3"
    assert json.loads(dataclasses.replace(m).to_json())["draft_head"] == "drafts/eagle3"


@pytest.mark.parametrize("bad", ["../eagle3", "drafts/../../x", "/abs/eagle3", "C:\\eagle3",
                                 "\\\\server\\share", "", 3, ["drafts"]])
def test_paths_leaving_the_directory_and_non_strings_are_refused(data, bad):
    with pytest.raises(ManifestError, match="manifest.draft_head"):
        mf.parse_manifest({**data, "draft_head": bad})
