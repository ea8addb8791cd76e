"""OrtDecoder against PyTorch and against itself on a tiny exported Llama: entry points agree,
rollback is a length change with bitwise-identical logits, chunked prefill, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.export import write_graph_dir
from transformers import AutoModelForCausalLM

from ortspec.export import export_model
from ortspec.export.tiny import make_tiny_llama
from ortspec.runtime.ort import graph_io as gio
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.errors import CapacityError, InvalidPromptError, OrtspecError
from ortspec.runtime.ort.decoder import OrtDecoder

CAP, VERIFY = 64, 4
TOKENS = [5, 77, 301, 12, 190, 45, 9, 260, 33, 101, 7, 250, 64, 18]  # [14]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    src = make_tiny_llama(tmp_path_factory.mktemp("src") / "tiny-llama", seed=3)
    out = export_model(src, out=tmp_path_factory.mktemp("out") / "llama", capacity=CAP,
                       max_verify_len=VERIFY, progress=False)
    return src, out


@pytest.fixture()
def decoder(tiny):
    return OrtDecoder(tiny[1])


@pytest.fixture(scope="module")
def reference(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny[0]).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].numpy()  # [n, vocab]


def test_step_and_verify_match_pytorch(decoder, reference):
    step = np.stack([decoder.forward_token(t) for t in TOKENS])  # [n, vocab]
    decoder.reset()
    verify = np.concatenate([decoder.forward_batch(TOKENS[i:i + VERIFY])
                             for i in range(0, len(TOKENS), VERIFY)])
    assert step.shape == verify.shape == (len(TOKENS), decoder.vocab_size)
    assert step.dtype == np.float32
    assert np.abs(step - verify).max() <= 1e-4
    assert np.abs(step - reference).max() <= 1e-3
    assert np.abs(verify - reference).max() <= 1e-3
    assert np.abs(reference).max() > 0.5  # the logits are not trivially near zero
    assert decoder.length == len(TOKENS)


def test_rollback_gives_the_logits_of_a_fresh_decode_bitwise(decoder):
    prefix, block, rejected = TOKENS[:6], TOKENS[6:9], [1, 2, 3]
    decoder.forward_batch(prefix)
    fresh = decoder.forward_batch(block)  # [3, vocab]
    decoder.reset()
    decoder.forward_batch(prefix)
    decoder.forward_batch(rejected)  # a draft that was rejected...
    decoder.truncate(len(prefix))  # ...rolled back by a length change
    assert decoder.length == len(prefix)
    again = decoder.forward_batch(block)
    np.testing.assert_array_equal(again, fresh)
    # step entry point after a partial rollback: stale KV beyond the length is never read
    decoder.truncate(len(prefix) + 1)
    one = decoder.forward_token(block[1])
    decoder.forward_batch(rejected)  # different garbage beyond position len(prefix) + 1
    decoder.truncate(len(prefix) + 1)
    np.testing.assert_array_equal(decoder.forward_token(block[1]), one)


def test_chunked_prefill_equals_its_blocks_and_token_by_token(decoder):
    assert decoder.prefill_chunk == decoder.capacity  # CPU: prompts go in chunks of up to 128
    wide = decoder.forward_batch(TOKENS)  # one call
    assert decoder.ort_calls == 1
    decoder.reset()
    decoder.prefill_chunk = VERIFY
    whole = decoder.forward_batch(TOKENS)  # 14 tokens > VERIFY: run as 4 + 4 + 4 + 2
    assert whole.shape == (len(TOKENS), decoder.vocab_size)
    assert decoder.ort_calls == 1 + 4
    assert np.abs(whole - wide).max() <= 1e-4
    decoder.reset()
    blocks = np.concatenate([decoder.forward_batch(TOKENS[i:i + VERIFY])
                             for i in range(0, len(TOKENS), VERIFY)])
    np.testing.assert_array_equal(whole, blocks)
    decoder.reset()
    steps = np.stack([decoder.forward_token(t) for t in TOKENS])
    assert np.abs(whole - steps).max() <= 1e-4
    decoder.reset()
    # prefill runs the LM head on the last row only, forward_batch on all 14: the CPU's float
    # Gemm gives a row the same bits whatever the row count
    np.testing.assert_array_equal(decoder.prefill(TOKENS), whole[-1])
    assert decoder.length == len(TOKENS)


def _every_row_graph(src, dst):
    """A copy of export `src` whose graph has no logit_rows input and returns logits for every
    position, [1, S, vocab], as exports before revision 3 and onnxruntime-genai's graphs do."""
    import hashlib
    import json
    import shutil

    import onnx
    from onnx import TensorProto, helper

    shutil.copytree(src, dst)
    model = onnx.load(str(dst / "model.onnx"), load_external_data=False)
    g = model.graph
    for n in g.node:
        if n.op_type == "Gather" and list(n.input)[1:] == [gio.LOGIT_ROWS]:
            gather = n
    gather.op_type, gather.input[:] = "Identity", gather.input[:1]  # every row reaches the head
    del gather.attribute[:]
    for n in g.node:
        n.output[:] = ["logits_flat" if o == gio.LOGITS else o for o in n.output]
    vocab = mf.read_manifest(src).architecture.vocab_size
    g.node.extend([
        helper.make_node("Shape", [gio.INPUT_IDS], ["ids_shape"]),
        helper.make_node("Constant", [], ["vocab"],
                         value=helper.make_tensor("v", TensorProto.INT64, [1], [vocab])),
        helper.make_node("Concat", ["ids_shape", "vocab"], ["logits_shape"], axis=0),
        helper.make_node("Reshape", ["logits_flat", "logits_shape"], [gio.LOGITS])])
    kept = [i for i in g.input if i.name != gio.LOGIT_ROWS]
    del g.input[:]
    g.input.extend(kept)
    for o in g.output:
        if o.name == gio.LOGITS:
            o.CopyFrom(helper.make_tensor_value_info(gio.LOGITS, TensorProto.FLOAT,
                                                     [1, "sequence_length", vocab]))
    (dst / "model.onnx").write_bytes(model.SerializeToString())
    data = json.loads((dst / "manifest.json").read_text())
    data["files"]["model.onnx"] = hashlib.sha256((dst / "model.onnx").read_bytes()).hexdigest()
    (dst / "manifest.json").write_text(json.dumps(data))
    return dst


def test_a_graph_computing_every_row_decodes_alike(tiny, tmp_path):
    """The LM head on the rows a call reads only (logit_rows) changes no logit: a graph that
    computes every position (an earlier export, onnxruntime-genai's) gives the same ones
    through every entry point, and OrtDecoder runs both."""
    ours = OrtDecoder(tiny[1])
    every = OrtDecoder(_every_row_graph(tiny[1], tmp_path / "every"))
    assert ours._bindings[id(ours.sessions.by_entry["verify"])][0].has_logit_rows
    assert not every._bindings[id(every.sessions.by_entry["verify"])][0].has_logit_rows
    for d in (ours, every):
        d.prefill_chunk = VERIFY
    got = []
    for d in (ours, every):
        got.append([d.prefill(TOKENS[:9]), d.forward_batch(TOKENS[9:12]),
                    d.forward_token(TOKENS[12]), d.forward_batch(TOKENS[:10])])
    for a, b in zip(*got, strict=True):
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= 1e-5


def test_prefill_reads_a_prompt_in_chunks_of_its_own(decoder):
    """prefill needs the last row's logits only, so its calls may be longer than forward_batch's
    (whose every row comes back): fewer calls, the same logits."""
    assert decoder.prompt_chunk >= decoder.prefill_chunk
    decoder.prefill_chunk, decoder.prompt_chunk = VERIFY, 2 * VERIFY
    whole = decoder.forward_batch(TOKENS)  # 14 tokens: 4 + 4 + 4 + 2
    decoder.reset()
    calls = decoder.ort_calls
    last = decoder.prefill(TOKENS)  # 8 + 6
    assert decoder.ort_calls - calls == 2 and decoder.length == len(TOKENS)
    assert np.abs(last - whole[-1]).max() <= 1e-4
    assert decoder.forward_token(TOKENS[0]).shape == (decoder.vocab_size,)


def test_kv_buffers_are_updated_in_place(decoder):
    assert decoder.kv_mode == "shared" and len(decoder._kv_sets) == 1
    buffers = decoder._kv_sets[0]
    ptrs = [b.data_ptr() for b in buffers]
    decoder.forward_batch(TOKENS[:5])
    decoder.forward_token(TOKENS[5])
    key0 = buffers[0].numpy()  # [1, kv_heads, capacity, head_dim]
    assert np.abs(key0[:, :, :6]).min(axis=-1).max() > 0  # the 6 positions were written
    assert not key0[:, :, 6:].any()  # nothing beyond them
    assert [b.data_ptr() for b in buffers] == ptrs
    outputs = {o.data_ptr() for o in decoder._bindings[id(decoder.sessions.by_entry["step"])][0]
               .io.get_outputs()}
    assert set(ptrs) <= outputs  # the present outputs are the very same buffers


def test_capacity_is_checked_before_running(decoder):
    decoder.forward_batch(list(range(CAP - 2)))
    calls = decoder.ort_calls
    with pytest.raises(CapacityError, match="capacity of 64"):
        decoder.forward_batch([1, 2, 3])
    assert decoder.length == CAP - 2 and decoder.ort_calls == calls
    decoder.forward_batch([1, 2])  # exactly full is fine
    with pytest.raises(CapacityError):
        decoder.forward_token(1)
    assert decoder.length == CAP


@pytest.mark.parametrize("tokens", [[-1], [320], [5, 400], [], [1.5], [[1, 2]]])
def test_invalid_token_ids_are_refused(decoder, tokens):
    decoder.forward_token(5)
    with pytest.raises(InvalidPromptError):
        decoder.forward_batch(tokens)
    assert decoder.length == 1


@pytest.mark.parametrize("length", [-1, 4, 2.0, True])
def test_truncate_refuses_lengths_outside_the_cache(decoder, length):
    decoder.forward_batch([1, 2, 3])
    with pytest.raises(ValueError):
        decoder.truncate(length)
    assert decoder.length == 3
    decoder.truncate(0)
    assert decoder.length == 0


def test_time_inside_onnxruntime_is_counted(decoder):
    assert decoder.ort_seconds == 0.0 and decoder.ort_calls == 0
    decoder.forward_token(3)
    decoder.forward_batch([4, 5])
    assert decoder.ort_calls == 2 and decoder.ort_seconds > 0.0


def test_non_finite_logits_raise_and_keep_the_length(tmp_path):
    d = write_graph_dir(tmp_path, poison=True)
    dec = OrtDecoder(d)
    with pytest.raises(OrtspecError, match="NaN or infinite"):
        dec.forward_token(1)
    assert dec.length == 0


def test_two_graph_files_share_the_kv_buffers(tiny, tmp_path, decoder):
    import dataclasses
    import shutil

    d = shutil.copytree(tiny[1], tmp_path / "two")
    shutil.copy(d / "model.onnx", d / "verify.onnx")  # same weights file, second graph
    m = mf.read_manifest(d, verify_checksums=False)
    m = dataclasses.replace(
        m, entry_points={**m.entry_points,
                         "verify": dataclasses.replace(m.entry_points["verify"],
                                                       graph="verify.onnx")},
        files={**m.files, "verify.onnx": mf.sha256_file(d / "verify.onnx")})
    m.write(d)
    two = OrtDecoder(d)
    assert two.sessions.by_entry["step"] is not two.sessions.by_entry["verify"]
    a = [two.forward_token(t) for t in TOKENS[:3]] + list(two.forward_batch(TOKENS[3:7]))
    b = [decoder.forward_token(t) for t in TOKENS[:3]] + list(decoder.forward_batch(TOKENS[3:7]))
    np.testing.assert_array_equal(np.stack(a), np.stack(b))


def test_decoders_join_global_thread_pools_an_application_created(tiny):
    # in a fresh interpreter: global pools are process-wide and cannot be removed again
    import subprocess
    import sys

    code = (
        "import onnxruntime as ort, numpy as np\n"
        "from ortspec.runtime.ort.decoder import OrtDecoder\n"
        "ort.set_global_thread_pool_sizes(1, 1)\n"
        f"d = OrtDecoder({str(tiny[1])!r})\n"
        "print(np.isfinite(d.forward_batch([1, 2, 3])).all())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"
