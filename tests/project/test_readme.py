"""The README's Python examples run as written (from the repository root)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_readme_python_examples_run(monkeypatch):
    pytest.importorskip("onnx", reason="the export extra makes the default model")
    from ortspec import export
    export.ensure_default_model(progress=False)
    monkeypatch.chdir(REPO)
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 2
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102 - our own docs
