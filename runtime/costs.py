"""`ModelCosts`: a loaded model's cost model, measured once and shared by its requests.

It holds the cost-model draft-length policy (`draft_length.policy.AdaptiveDraftLength`) made
from the target's cost curve, the draft's and the draft head's step costs against the
target's, and, on a batching model, the cost surfaces of the batched calls. Every figure is
read from the calibration cache when it is there (`draft_length.calibration`), else measured on
a slot of the model's pool, never on a running request's state. `request_policy` gives each
request its view of the shared policy. What it reads of the model is declared by `CostHost`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

from .batching.rows import BatchRow
from .batching.runner import BatchRunner
from .decoding.options import SpeculativeOptions
from .decoding.protocols import DraftLengthPolicy
from .draft_length.calibration import CalibrationKey, CostSurface, calibrated_cost_curve, \
    calibrated_cost_surface, calibrated_step_ratio
from .draft_length.batch import BatchCorrection, BatchCosts
from .draft_length.policy import AdaptiveDraftLength
from .drafters.eagle3 import SOURCE as EAGLE3_SOURCE
from .ort import kernels, manifest as mf
from .ort.decoder import OrtDecoder
from .ort.head import HeadSessions, HeadSteps, OrtDraftHead
from .ort.sessions import OrtSessions
from .slots import DecodeSlot, SlotPool


class CostHost(Protocol):
    """What `ModelCosts` reads of the model it prices (`Model`)."""

    sessions: OrtSessions
    manifest: mf.Manifest
    slots: SlotPool
    runner: BatchRunner | None  # the target's batch runner, on a batching model
    draft_sessions: OrtSessions | None  # the draft model, once loaded
    draft_runner: BatchRunner | None  # the draft's batch runner, when its graph batches

    @property
    def draft_shares_kv(self) -> bool: ...

    def slot_draft(self, slot: DecodeSlot) -> OrtDecoder | BatchRow | None: ...

    def load_head(self) -> HeadSessions: ...


class ModelCosts:
    """The cost model of one loaded model: `prepare` makes the shared policy once (one thread
    measures, the others wait for it); `draft_loaded` adds a draft model loaded afterwards;
    `request_policy` is a request's view. `surface` and `draft_surface` are the batched calls'
    cost surfaces (target, and draft when its runner batches), None on a model that does not
    batch."""

    def __init__(self, host: CostHost) -> None:
        self.host = host
        self.policy: AdaptiveDraftLength | None = None
        self.surface: CostSurface | None = None
        self.draft_surface: CostSurface | None = None
        self.batch_correction: BatchCorrection | None = None  # learned from the runner's calls
        self._lock = threading.Lock()  # held while the shared policy is made or extended

    def prepare(self, *, refresh: bool = False) -> AdaptiveDraftLength:
        """The shared policy: made now (cached figures read, missing ones measured), or the one
        made before unless `refresh` measures everything again."""
        host = self.host
        with self._lock:
            if self.policy is not None and not refresh:
                return self.policy
            key = calibration_key(host.sessions)
            with host.slots.slot() as slot:
                curve = calibrated_cost_curve(slot.decoder, key, refresh=refresh)
            runner = host.runner
            if runner is not None:
                self.surface = runner.exclusive(
                    lambda backend, floors: calibrated_cost_surface(
                        backend, key, max_len=runner.max_verify_len, floors=floors,
                        refresh=refresh))
                self.batch_correction = BatchCorrection(
                    self.surface, packs_tokens=runner.backend.packs_tokens)
                runner.call_listener = self.batch_correction.observe
            policy = AdaptiveDraftLength(curve)
            self._measure_draft(policy, refresh=refresh)
            self._measure_head(policy, refresh=refresh)
            self.policy = policy
            return policy

    def draft_loaded(self) -> None:
        """A draft model was loaded after `prepare`: price its steps into the shared policy."""
        with self._lock:
            if self.policy is not None:
                self._measure_draft(self.policy, refresh=False)

    def _measure_draft(self, policy: AdaptiveDraftLength, *, refresh: bool) -> None:
        """The draft's costs into `policy`, when a draft is loaded: its step against the
        target's, and its batched one-token calls by rows when its runner batches."""
        host = self.host
        draft_sessions = host.draft_sessions
        if draft_sessions is None:
            return
        with host.slots.slot() as slot:
            # timings taken at different moments are not comparable on a drifting machine: the
            # draft's step is measured against the target's, interleaved
            draft = host.slot_draft(slot)
            assert draft is not None
            ratio = calibrated_step_ratio(
                draft, slot.decoder, calibration_key(host.sessions), refresh=refresh,
                draft_id=draft_id("draft", draft_sessions.model_dir, draft_sessions.graph_digest,
                                  shares_kv=host.draft_shares_kv))
            policy.draft_step_seconds = ratio * policy.curve.cost(1)
        draft_runner = host.draft_runner
        if draft_runner is not None:  # its one-token calls by rows: d(B, 1)
            draft_key = calibration_key(draft_sessions)
            self.draft_surface = draft_runner.exclusive(
                lambda backend, floors: calibrated_cost_surface(
                    backend, draft_key, max_len=1, floors=floors, refresh=refresh))

    def _measure_head(self, policy: AdaptiveDraftLength, *, refresh: bool) -> None:
        """The draft head's drafted-token cost into `policy` (its `paid_steps` of the eagle3
        source), when the manifest lists a head: a head step against the target's, interleaved
        (cached like the draft's)."""
        host = self.host
        if host.manifest.draft_head is None:
            return
        sessions = host.load_head()
        head = HeadSteps(OrtDraftHead.on(sessions))
        digest = sessions.config.files.get(sessions.config.graphs["head"], "")
        with host.slots.slot() as slot:
            ratio = calibrated_step_ratio(head, slot.decoder, calibration_key(host.sessions),
                                          draft_id=draft_id("head", sessions.head_dir, digest),
                                          refresh=refresh)
        policy.paid_steps[EAGLE3_SOURCE] = ratio * policy.curve.cost(1)

    def request_policy(self, draft_length: Any, options: SpeculativeOptions
                       ) -> DraftLengthPolicy | None:
        """A request's draft-length policy: `draft_length` itself unless it is "auto"; for
        "auto", the shared policy's view (prepared first if need be): a seeded request above
        temperature 0 gets a copy that times nothing, a batch row one that prices its block at
        the rows decoding now, any other request one that shares what it learns."""
        if draft_length != "auto":
            return draft_length
        shared = self.prepare()  # a no-op once prepared
        if options.seed is not None and options.temperature > 0:
            return shared.for_seeded_request()  # the seed fixes the output
        runner = self.host.runner
        if runner is not None and self.surface is not None:
            return shared.for_batch_row(BatchCosts(self.surface, lambda: runner.active_rows,
                                                   context=lambda: runner.active_context,
                                                   correction=self.batch_correction,
                                                   draft=self.draft_surface,
                                                   packs_tokens=runner.backend.packs_tokens))
        return shared.for_request()


def draft_id(kind: str, directory: Path, digest: str, *, shares_kv: bool = False) -> str:
    """What a draft's cached step ratio is filed under: its kind, directory name and graph."""
    return f"{kind}-{Path(directory).name}-{digest[:16]}" + ("-shared" if shares_kv else "")


def calibration_key(sessions: OrtSessions) -> CalibrationKey:
    """What the cost curve or surface measured on these sessions' calls is cached under."""
    return CalibrationKey(str(sessions.model_dir), sessions.graph_digest, tuple(sessions.providers),
                          sessions.intra_op_threads, sessions.min_call_rows,
                          kernels.library_digest())
