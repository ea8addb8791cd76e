"""What a bench run has measured so far, prompt by prompt, so that a long run can be resumed.

A run writes `partial.jsonl` into its output directory as it goes: a first line naming the run
(model, workload, methods, decoding options) and then one line a finished prompt (its records
and skipped entries). `ortspec bench --resume` with the same options reads it back, measures
only the prompts it lacks and writes the tables over all of them; the file is removed once the
tables are written. A resumed run's methods start their draft-length estimates afresh, as at
the start of any run; each keeps the order it had at each prompt's place in the workload.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ortspec.runtime.errors import InvalidOptionError

FILE_NAME = "partial.jsonl"


class Checkpoint:
    """The partial results of one run in `out`; `key` names the run (every option that changes
    what a record measures)."""

    def __init__(self, out: Path, key: dict[str, Any]) -> None:
        self.path = out / FILE_NAME
        self.key = json.loads(json.dumps(key))  # as it reads back from the file
        self.records: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []

    @property
    def done(self) -> frozenset[int]:
        """The question ids measured (or skipped) so far."""
        return frozenset(r["question_id"] for r in self.records + self.skipped)

    def begin(self) -> None:
        """Write the file: the run's options, then what `resume` read (nothing for a fresh run),
        in a directory made if missing."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", encoding="utf-8") as f:  # rewritten whole: no torn line kept
            f.write(json.dumps({"run": self.key}) + "\n")
            if self.records or self.skipped:
                f.write(json.dumps({"records": self.records, "skipped": self.skipped}) + "\n")

    def add(self, records: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> None:
        """One finished prompt's results, appended and flushed."""
        self.records += records
        self.skipped += skipped
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"records": records, "skipped": skipped}) + "\n")

    def finish(self) -> None:
        """The tables are written: the partial file is no longer needed."""
        self.path.unlink(missing_ok=True)

    def resume(self) -> None:
        """Read the measured prompts of the file the same run left; nothing is written. A file
        of another run, or none, is refused (before anything loads or is decoded)."""
        if not self.path.is_file():
            raise InvalidOptionError(f"--resume: {self.path} does not exist (no run to resume in "
                                     f"{self.path.parent}; run without --resume)")
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            parts = [json.loads(ln) for ln in lines if ln.strip()]
        except ValueError:  # a run killed while writing leaves at most its last line torn
            try:
                parts = [json.loads(ln) for ln in lines[:-1] if ln.strip()]
            except ValueError as e:
                raise InvalidOptionError(f"--resume: {self.path} is not a bench checkpoint ({e})") from None
        if not parts or not isinstance(parts[0], dict) or "run" not in parts[0]:
            raise InvalidOptionError(f"--resume: {self.path} is not a bench checkpoint")
        theirs = parts[0]["run"]
        if theirs != self.key:
            changed = sorted(k for k in set(theirs) | set(self.key) if theirs.get(k) != self.key.get(k))
            raise InvalidOptionError(
                f"--resume: {self.path} is from a run with other options ({', '.join(changed)}: "
                + "; ".join(f"{k} was {theirs.get(k)!r}, now {self.key.get(k)!r}" for k in changed)
                + "); use the same options, or run without --resume to start afresh")
        self.records = [r for p in parts[1:] for r in p.get("records", [])]
        self.skipped = [s for p in parts[1:] for s in p.get("skipped", [])]
