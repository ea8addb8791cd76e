"""Hugging Face transformers (PyTorch, eager) anchor: greedy `generate` plain vs prompt lookup.

Run with the main project venv (torch, transformers 5.x, gguf):

    .venv/bin/python -m ortspec.runtime.bench.anchors.hf_anchor \
        --gguf models/cache/SmolLM2-135M-Instruct.Q4_1.gguf --prompts prompts.jsonl --out hf.jsonl \
        --max-new-tokens 128 --repeats 2

The model is loaded from the GGUF with `AutoModelForCausalLM.from_pretrained(folder,
gguf_file=name)`, which dequantises it to float32: the same weights the onnxruntime-genai
anchor's graph was built from. The n-gram mode is `generate(..., prompt_lookup_num_tokens=10)`
(transformers' PromptLookupCandidateGenerator; `--ngram-size` sets its max_matching_ngram_size,
default transformers' own, 2). Modes run interleaved per prompt in one process; one JSON line
per run (format: anchor_io's docstring). `forward_calls` counts the model's forward passes
(prefill included) with a forward hook.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import anchor_io

DEFAULT_GGUF = "models/cache/SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.isdir(path):
        folder, kw = path, {}
    else:
        folder, name = os.path.split(os.path.abspath(path))
        kw = {"gguf_file": name}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    model.train(False)  # inference mode (what .eval() does)
    return model, tokenizer


def prompt_ids(tokenizer, p) -> list[int]:
    if "prompt" in p:
        return list(tokenizer(p["prompt"], add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # a BatchEncoding in some versions
        ids = ids["input_ids"]
    return [int(t) for t in ids]


class ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def generate(model, counter, ids, *, mode, max_new_tokens, temperature, seed, lookup_tokens, ngram_size):
    import torch

    input_ids = torch.tensor([ids], dtype=torch.long)
    kw = dict(
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        pad_token_id=model.generation_config.pad_token_id
        if model.generation_config.pad_token_id is not None
        else model.generation_config.eos_token_id,
    )
    if temperature > 0:
        torch.manual_seed(seed)
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    if mode == "ngram":
        kw["prompt_lookup_num_tokens"] = lookup_tokens
        if ngram_size is not None:
            kw["max_matching_ngram_size"] = ngram_size
    counter.calls = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, **kw)
    wall = time.perf_counter() - t0
    return [int(t) for t in out[0, len(ids):]], wall, counter.calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="GGUF file (or a Hugging Face model folder)")
    ap.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    ap.add_argument("--ngram-size", type=int, default=None, help="max_matching_ngram_size (default: transformers')")
    anchor_io.add_common_args(ap)
    args = ap.parse_args(argv)

    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"torch/transformers are not installed in {sys.executable}: {e}", file=sys.stderr)
        return 3
    if not os.path.exists(args.gguf):
        print(f"no model at {args.gguf} (run scripts/setup_anchors.sh to extract the GGUF)", file=sys.stderr)
        return 4
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.gguf)
    counter = ForwardCounter(model)
    modes = anchor_io.parse_modes(args.modes)
    prompts = anchor_io.validate_prompts(anchor_io.read_jsonl(args.prompts))
    greedy = args.temperature == 0
    out = anchor_io.RecordWriter(args.out)
    meta = {
        "system": "hf-transformers",
        "system_version": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "model": os.path.abspath(args.gguf),
        "threads": torch.get_num_threads(),
        "options": {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens,
            "max_matching_ngram_size": args.ngram_size,
        },
    }
    gen_kw = anchor_io.generate_options(args, lookup_tokens=args.prompt_lookup_num_tokens,
                                        ngram_size=args.ngram_size)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])

    encoded = [(p, prompt_ids(tokenizer, p)) for p in prompts]
    if not args.no_warmup and encoded:
        for mode in modes:
            generate(model, counter, encoded[0][1], mode=mode, **{**gen_kw, "max_new_tokens": min(16, args.max_new_tokens)})

    for p, ids in encoded:
        first_plain = None
        for rep in range(args.repeats):
            for mode in modes:
                new, wall, calls = generate(model, counter, ids, mode=mode, **gen_kw)
                if mode == "plain" and first_plain is None:
                    first_plain = new
                out.write(anchor_io.run_record(
                    meta, p, mode=mode, repeat=rep, ids=ids, new=new, eos=eos, wall=wall,
                    prefill=None, calls=calls, first_plain=first_plain, greedy=greedy,
                    stats=None))
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
