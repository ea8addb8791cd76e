"""EAGLE-3 head training (export/eagle3_train/) on a tiny random Llama of 8 layers: the pipeline
end to end writes a speculators checkpoint that export/eagle3.py reads and `export_model(...,
draft_head=...)` imports; the trainable layer's first step is eagle3_reference's forward; the
loss falls on a fixed sample; the prompts never include a held-out Spec-Bench id; the vocabulary
maps round-trip; the manifest records seed and sources; one seed gives one set of weights."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from ortspec.export import export_model
from ortspec.export.eagle3 import Eagle3Target, read_eagle3_head
from ortspec.export.eagle3_export import HEAD_DIR
from ortspec.export.eagle3_reference import embed, head_forward, project_aux
from ortspec.export.eagle3_train import TrainConfig, train_head
from ortspec.export.eagle3_train.loop import HeadShape, TrainableHead, sample_loss, train
from ortspec.export.eagle3_train.prompts import SPEC_BENCH, spec_bench_dev_prompts, \
    training_prompts
from ortspec.export.eagle3_train.teacher import Teacher
from ortspec.export.eagle3_train.vocab import draft_vocab, maps, target_ids
from ortspec.export.tiny import VOCAB, make_tiny_llama
from ortspec.runtime.ort import manifest as mf

pytestmark = pytest.mark.slow  # builds a torch checkpoint, distils and trains

LAYERS, HIDDEN = 8, 64
CFG = TrainConfig(steps=6, prompts=4, max_new_tokens=8, max_prompt_chars=60, draft_vocab=100,
                  seed=7, validation=0.25)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "tiny-llama8", seed=4,
                           num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def trained(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("head") / "head"
    return train_head(str(src), out, CFG, progress=False)


def test_the_written_head_reads_and_imports(src, trained, tmp_path):
    head = read_eagle3_head(trained.out, target=Eagle3Target(HIDDEN, VOCAB, LAYERS))
    assert head.source_format == "speculators" and head.draft_vocab_size == 100
    assert head.layer_ids == (2, 4, 5) and not head.has_own_embedding
    out = export_model(src, out=tmp_path / "exp", capacity=64, max_verify_len=4,
                       progress=False, draft_head=trained.out)
    assert mf.read_manifest(out).draft_head == HEAD_DIR


def test_the_manifest_records_seed_sources_and_hashes(trained):
    data = json.loads((trained.out / "data_manifest.json").read_text())
    recipe = json.loads((trained.out / "recipe.json").read_text())
    assert data["seed"] == recipe["seed"] == CFG.seed and recipe["steps"] == CFG.steps
    assert set(data["sources"]) <= {"spec-bench-dev", "self-instruct"}
    assert all(s["licence"] for s in data["sources"].values())
    assert data["train_tokens"] == sum(s["tokens"] for s in data["samples"]
                                       if s["split"] == "train") > 0
    import hashlib
    for name, digest in data["files"].items():
        assert hashlib.sha256((trained.out / name).read_bytes()).hexdigest() == digest


def test_prompts_never_take_a_held_out_spec_bench_id():
    dev = spec_bench_dev_prompts()
    assert len(dev) == 240 and all(int(p.ident.split(":")[1]) % 2 == 0 for p in dev)
    for seed in range(5):
        for p in training_prompts(300, seed=seed, self_instruct=0.1):
            if p.source == SPEC_BENCH:
                assert int(p.ident.split(":")[1]) % 2 == 0


def test_vocab_maps_round_trip():
    seqs = [[5, 5, 5, 9, 9, 300, 1], [9, 2, 2]]
    kept = draft_vocab(seqs, size=6, vocab=VOCAB)
    assert kept.tolist() == [0, 1, 2, 5, 9, 300]  # the 5 seen tokens, topped up with id 0
    d2t, t2d = maps(kept, VOCAB)
    assert torch.equal(target_ids(d2t), kept)
    assert torch.equal(torch.nonzero(t2d).flatten(), kept)
    assert draft_vocab(seqs, size=3, vocab=VOCAB).tolist() == [2, 5, 9]


def _fixed(seed=0, n=12, vocab=40):
    g = torch.Generator().manual_seed(seed)
    shape = HeadShape(16, 2, 1, 8, 32, 1e-5, 1e4, 512, vocab)
    ids = torch.randint(0, vocab, (n,), generator=g)
    t = Teacher(ids, torch.randn(n, 48, generator=g),
                torch.log_softmax(3 * torch.randn(n, vocab, generator=g), -1), 0)
    table = torch.randn(vocab, 16, generator=g)
    return shape, t, table, torch.arange(vocab)


def _head(shape, seed):
    return TrainableHead(shape, target_hidden=16, lm_head_init=torch.zeros(shape.draft_vocab, 16),
                         seed=seed)


def test_the_loss_falls_on_a_fixed_sample():
    shape, t, table, kept = _fixed()
    head = _head(shape, 0)
    r = train(head, [t], table, steps=40, lr=3e-3, seed=0)
    assert np.mean(r.losses[-5:]) < 0.8 * np.mean(r.losses[:5])


def test_one_seed_gives_one_set_of_weights():
    shape, t, table, kept = _fixed()
    states = []
    for seed in (3, 3, 4):
        head = _head(shape, seed)
        train(head, [t], table, steps=3, seed=seed)
        states.append(head.state())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not all(torch.equal(states[0][k], states[2][k]) for k in states[0])


def test_the_first_step_is_the_reference_forward(tmp_path):
    """Write a trainable head and read it back: its unrolled step 0 is head_forward."""
    from ortspec.export.eagle3_train.write import speculators_config, write_head

    shape, t, table, kept = _fixed()
    head = _head(shape, 1)
    train(head, [t], table, steps=2, seed=1)
    d2t, t2d = maps(kept, shape.draft_vocab)
    write_head(tmp_path / "h", dict(head.state(), d2t=d2t, t2d=t2d),
               speculators_config(shape, vocab=shape.draft_vocab, target_hidden=16,
                                  layer_ids=(2, 4, 5)), recipe={}, data={})
    ref_head = read_eagle3_head(tmp_path / "h")
    m = t.ids.numel() - 1
    with torch.no_grad():
        step0 = head.unroll(t.aux[:m], table[t.ids[1:]], 1)[0]
    ref = head_forward(ref_head, project_aux(ref_head, t.aux[:m].numpy()),
                       embed(ref_head, t.ids[1:].numpy(), table.numpy()), np.arange(m))
    np.testing.assert_allclose(step0.numpy(), ref.logits.numpy(), atol=1e-4, rtol=1e-4)
    assert sample_loss(head, t, table, steps=3, decay=0.8)[0].item() > 0


@pytest.mark.parametrize("bad", [dict(steps=0), dict(draft_vocab=-1), dict(device="cuda"),
                                 dict(temperature=0.5)])
def test_bad_options_are_refused_before_any_work(tmp_path, bad):
    from ortspec.export import ExportOptionError

    with pytest.raises(ExportOptionError):
        train_head("/nonexistent", tmp_path / "h", TrainConfig(**bad), progress=False)
    assert not (tmp_path / "h").exists()


# -- the runtime distiller and the answer-only context -------------------------------------------

RT_CFG = TrainConfig(steps=4, prompts=4, max_new_tokens=8, max_prompt_chars=60, draft_vocab=100,
                     seed=3, validation=0.25, sampled_copies=1, workers=3)


@pytest.fixture(scope="module")
def exported(src, tmp_path_factory):
    return export_model(src, out=tmp_path_factory.mktemp("rt") / "exp", capacity=256,
                        max_verify_len=4, progress=False, hidden_states="auto")


def test_the_runtime_distiller_writes_the_targets_own_draws(src, exported, tmp_path):
    from ortspec.runtime import SpeculativeOptions, load_model
    from ortspec.export.eagle3_train.distill_ort import distill_with_runtime
    from ortspec.export.eagle3_train.pipeline import distill_jobs

    prompts = training_prompts(RT_CFG.prompts, seed=RT_CFG.seed, self_instruct=0.25)
    jobs = distill_jobs(prompts, RT_CFG)
    assert [j.temperature for j in jobs] == [0.0, 1.0] * len(prompts)
    assert len({j.seed for j in jobs}) == len(jobs)
    model = load_model(exported)
    cache = tmp_path / "cache"
    kw = dict(max_new_tokens=8, max_prompt_chars=60, cache=cache)
    samples = distill_with_runtime(model, jobs, workers=3, **kw)
    for job, s in zip(jobs, samples):
        assert s.ident.startswith(job.prompt.ident + "@")
        prompt, answer = s.ids[:s.answer_start], s.ids[s.answer_start:]
        if not job.prompt.needs_question:
            assert prompt == model.encode(job.prompt.text[:60], chat=True)
        # T=0: plain greedy decoding of the prompt alone, whatever ran beside it and whatever
        # the drafter did; T=1: the same seed's draw again (one request at a time)
        greedy = job.temperature == 0
        again = model.generate(prompt, drafter=None if greedy else "auto",
                               options=SpeculativeOptions(max_new_tokens=8,
                                                          temperature=job.temperature,
                                                          seed=None if greedy else job.seed))
        assert answer == again.tokens
    # a second run reads every answer back from the cache, writing nothing
    before = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert distill_with_runtime(model, jobs, workers=1, **kw) == samples
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == before


def test_training_from_runtime_answers_keeps_each_prompt_on_one_side(src, exported, tmp_path):
    cfg = dataclasses.replace(RT_CFG, runtime_model=str(exported))
    r = train_head(str(src), tmp_path / "h", cfg, cache=tmp_path / "c", progress=False)
    data = json.loads((r.out / "data_manifest.json").read_text())
    sides: dict[str, set[str]] = {}
    for s in data["samples"]:
        sides.setdefault(s["id"].split("@")[0], set()).add(s["split"])
    assert len(data["samples"]) == 2 * RT_CFG.prompts
    # the export returns the head's layers: the head learns from the states it will read
    assert json.loads((r.out / "recipe.json").read_text())["teacher"] == f"the export {exported}"
    assert all(len(v) == 1 for v in sides.values())
    assert {"train", "validation"} == set().union(*sides.values())


def test_the_teacher_starts_where_the_drafter_does(src):
    from ortspec.export.eagle3_train.distill import load_target
    from ortspec.export.eagle3_train.teacher import teacher_force

    model = load_target(str(src), capacity=256, progress=False).model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    kept = torch.tensor([1, 5, 7, 300])
    t = teacher_force(model, ids, (2, 4, 5), answer_start=12, kept=kept)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    assert t.ids.tolist() == ids[11:] and t.loss_from == 0
    full = torch.cat([out.hidden_states[i][0] for i in (2, 4, 5)], -1)
    assert torch.equal(t.aux, full[11:])  # states of the whole sequence, rows from the answer
    want = torch.log_softmax(out.logits[0, 11:].float(), -1)[:, kept]
    assert torch.allclose(t.logp.float(), want, atol=1e-2, rtol=1e-3)  # stored in float16


@pytest.mark.parametrize("bad", [dict(sampled_copies=1), dict(sampled_copies=-1), dict(schedule="linear"),
                                 dict(workers=0)])
def test_bad_distiller_options_are_refused(tmp_path, bad):
    from ortspec.export import ExportOptionError

    with pytest.raises(ExportOptionError):
        train_head("/nonexistent", tmp_path / "h", TrainConfig(**bad), progress=False)
    assert not (tmp_path / "h").exists()


def test_the_exported_teacher_agrees_with_pytorch(src, tmp_path):
    from ortspec.export.eagle3_train.distill import load_target
    from ortspec.export.eagle3_train.teacher import teacher_force, teacher_force_exported
    from ortspec.runtime.ort.decoder import OrtDecoder

    out = export_model(src, out=tmp_path / "hs", capacity=256, max_verify_len=4,
                       progress=False, hidden_states="auto")
    decoder = OrtDecoder(out)
    assert decoder.hidden_state_layers == (2, 4, 5)
    model = load_target(str(src), capacity=256, progress=False).model
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (30,), generator=g).tolist()
    kept = torch.tensor([0, 3, 9, 200, 301])
    for answer_start in (1, 17):
        a = teacher_force(model, ids, (2, 4, 5), answer_start=answer_start, kept=kept)
        b = teacher_force_exported(decoder, ids, answer_start=answer_start, kept=kept)
        assert torch.equal(a.ids, b.ids) and a.loss_from == b.loss_from == 0
        assert torch.allclose(a.aux, b.aux, atol=1e-3, rtol=1e-3)
        assert torch.allclose(a.logp.float(), b.logp.float(), atol=2e-2)
    assert decoder.length == 0  # left empty for the next sample


def test_cached_answers_are_keyed_by_the_weights_format():
    from types import SimpleNamespace

    from ortspec.export.eagle3_train.distill_ort import Job, _key, model_id

    def model(dtype, weights):
        return SimpleNamespace(manifest=SimpleNamespace(source={"path": "x.gguf"}, dtype=dtype,
                                                        extra={"weights": weights}))

    fp32 = model("fp32", {"format": "float", "dtype": "fp32"})
    int4 = model("fp32", {"format": "MatMulNBits", "bits": 4, "scheme": "block-min"})
    sym = model("fp32", {"format": "MatMulNBits", "bits": 4, "scheme": "symmetric"})
    job = Job(spec_bench_dev_prompts()[0], 0.0, 0)
    keys = {_key(model_id(m), job, max_new_tokens=8, max_prompt_chars=60)
            for m in (fp32, int4, sym)}
    assert len(keys) == 3


def test_a_half_copy_imports_with_the_rounded_weights(trained, tmp_path):
    import hashlib

    from safetensors.torch import load_file

    from ortspec.export.eagle3_train.write import store_half

    half = store_half(trained.out, tmp_path / "h16")
    a, b = load_file(trained.out / "model.safetensors"), load_file(half / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            assert b[k].dtype == torch.float16 and torch.equal(b[k], a[k].half())
        else:
            assert torch.equal(a[k], b[k])
    target = Eagle3Target(HIDDEN, VOCAB, LAYERS)
    h32, h16 = read_eagle3_head(trained.out, target=target), read_eagle3_head(half, target=target)
    for k in ("fc", "q", "k", "v", "o", "gate", "up", "down", "norm", "lm_head"):
        w32, w16 = getattr(h32, k), getattr(h16, k)
        assert w16.dtype == np.float32 and np.array_equal(w16, w32.astype(np.float16))
    assert np.array_equal(h32.target_ids(), h16.target_ids())
    data = json.loads((half / "data_manifest.json").read_text())
    for name, digest in data["files"].items():
        assert hashlib.sha256((half / name).read_bytes()).hexdigest() == digest
    assert "float16" in json.loads((half / "recipe.json").read_text())["stored"]
