"""Where does a verify row stop computing what a step computes? Node by node, on any export.

    .venv/bin/python scripts/row_invariance_layers.py models/exported/smollm2-135m-instruct-int4

Every node output of the graph becomes a graph output; the graph then runs a prompt, and from
the same past a step (one new token, or two rows when --padded, as `min_call_rows: 2` runs it)
and verify blocks of the given lengths starting with the same token. For each block length it
prints the first node, in graph order, whose row for that token is not bitwise the step's, and
the largest logit difference. Needs the export extra (onnx).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import onnx
import onnxruntime as ort

from ortspec.runtime.ort import kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--block-lengths", default="2,4,8,16")
    ap.add_argument("--prompt-tokens", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--padded", action="store_true",
                    help="run the step as two rows (the token twice), as min_call_rows 2 does")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.block_lengths.split(",")]

    model = onnx.load(f"{args.model_dir}/model.onnx")
    declared = {o.name for o in model.graph.output}
    nodes = [(n.op_type, n.name, o) for n in model.graph.node for o in n.output
             if o and o not in declared]
    for _, _, o in nodes:
        model.graph.output.append(onnx.helper.make_value_info(o, onnx.TypeProto()))
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    kernels.register(so)  # the graph may run ortspec's ops (the int4 exports do)
    session = ort.InferenceSession(model.SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    graph_inputs = {i.name for i in session.get_inputs()}
    takes_rows = "logit_rows" in graph_inputs
    packs = "token_rows" in graph_inputs  # the batched graph: every token computed here
    kv_types = {"tensor(float)": np.float32, "tensor(float16)": np.float16}  # the cache's dtype
    pasts = {i.name: np.zeros([1, *i.shape[1:]], kv_types[i.type]) for i in session.get_inputs()
             if i.name.startswith("past_key_values")}

    def run(ids, past, total):
        feed = dict(past, input_ids=np.array([ids], np.int64),
                    attention_mask=np.ones((1, total), np.int64))
        if takes_rows:  # exporter revision 3 on: the logits of every position, [S, vocab]
            feed["logit_rows"] = np.arange(len(ids), dtype=np.int64)
        if packs:
            feed["token_rows"] = np.arange(len(ids), dtype=np.int64)
        return dict(zip(names, session.run(None, feed)))

    rng = np.random.default_rng(0)
    vocab = session.get_outputs()[0].shape[-1]
    p = args.prompt_tokens
    prompt = rng.integers(0, vocab, size=p).tolist()
    cont = rng.integers(0, vocab, size=max(lengths)).tolist()
    out = run(prompt, pasts, p)
    past = {k: out[k.replace("past_key_values", "present")] for k in pasts}
    step = run(cont[:1] * 2, past, p + 2) if args.padded else run(cont[:1], past, p + 1)
    for n in lengths:
        block = run(cont[:n], past, p + n)
        first, compared = None, 0
        for op, name, o in nodes:
            a, b = step.get(o), block.get(o)
            if a is None or b is None or a.dtype != np.float32 or a.ndim != b.ndim:
                continue
            if a.ndim == 3 and a.shape[0] == 1:  # [1, S, ...] activations
                a, b = a[0], b[0]
            elif a.ndim != 2:  # else [S, ...] rows, as graphs on flat rows hold them
                continue
            if a.shape[0] not in (1, 2) or b.shape[0] != n or a.shape[1:] != b.shape[1:]:
                continue
            compared += 1
            diff = float(np.abs(a[0] - b[0]).max())
            if diff > 0:
                first = f"{op} {name!r} (max |diff| {diff:.3g})"
                break
        first_row = (lambda x: x[0]) if takes_rows else (lambda x: x[0, 0])  # [vocab]
        logits = float(np.abs(first_row(step["logits"]) - first_row(block["logits"])).max())
        print(f"block of {n:2d}: first differing node {first or 'none'} ({compared} node "
              f"outputs compared); logits max |diff| {logits:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
