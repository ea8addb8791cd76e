"""onnxruntime-genai anchor: plain greedy decode vs its built-in n-gram speculative decoding.

Run with the anchor venv made by scripts/setup_anchors.sh:

    .venv-anchors/bin/python -m ortspec.runtime.bench.anchors.genai_anchor \
        --model models/cache/genai-smollm2-fp32 --prompts prompts.jsonl --out genai.jsonl \
        --max-new-tokens 128 --repeats 2

For each prompt, the modes run interleaved in one process (plain, ngram, plain, ngram, ...);
one JSON line per run (format: anchor_io's docstring). The n-gram mode is onnxruntime-genai
0.18's prompt-lookup drafter, enabled per request with
`GeneratorParams.set_speculative_options(ngram_size=N, max_draft_tokens=K)` (K <= 16); its
counters come from `Generator.get_speculative_stats()` and are kept in each record's `stats`.

    --step-latency 256   instead: the per-step latency of a plain decode at a ~256-token context
                         (median over --steps single-token steps), one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from . import anchor_io

# speculative counters worth keeping per record (the full dict has ~60 entries)
KEPT_STATS = (
    "rounds",
    "draft_tokens_proposed",
    "draft_tokens_evaluated",
    "draft_tokens_accepted",
    "correction_tokens",
    "bonus_tokens",
    "target_forward_passes",
    "target_verify_forward_passes",
    "target_reanchor_forward_passes",
    "standard_fallback_steps",
    "ngram_lookup_hits",
    "ngram_lookup_misses",
    "acceptance_rate",
    "mean_emitted_tokens_per_round",
    "observed_speedup",
)


def load_model(model_dir: str, threads: int | None):
    import onnxruntime_genai as og

    config = og.Config(model_dir)
    if threads is not None:
        config.overlay(
            json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": int(threads)}}}})
        )
    model = og.Model(config)
    return model, og.Tokenizer(model)


def prompt_ids(tokenizer, p) -> list[int]:
    text = p.get("prompt")
    if text is None:
        text = tokenizer.apply_chat_template(json.dumps(p["messages"]), add_generation_prompt=True)
    return [int(t) for t in tokenizer.encode(text)]


def generate(model, ids, *, mode, max_new_tokens, temperature, seed, ngram_size, max_draft_tokens, eos_ids=(2,)):
    """One request; returns (new token ids, wall s, prefill s, forward calls, stats)."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    search = {"max_length": len(ids) + max_new_tokens, "num_beams": 1}
    if temperature > 0:
        search.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, random_seed=seed)
    else:
        search.update(do_sample=False)
    params.set_search_options(**search)
    if mode == "ngram":
        params.set_speculative_options(ngram_size=ngram_size, max_draft_tokens=max_draft_tokens)
    generator = og.Generator(model, params)
    t0 = time.perf_counter()
    generator.append_tokens(ids)
    t1 = time.perf_counter()
    while not generator.is_done():
        generator.generate_next_token()
    t2 = time.perf_counter()
    new = [int(t) for t in generator.get_sequence(0)[len(ids):]]
    # onnxruntime-genai stops at end-of-sequence without appending it to the sequence; keep it in
    # the output, as HF generate (and ortspec) do, so outputs compare across systems
    if len(new) < max_new_tokens:
        last = [int(t) for t in generator.get_next_tokens()]
        if last and last[0] in eos_ids and (not new or new[-1] != last[0]):
            new.append(last[0])
    stats = None
    forward_calls = len(new)  # plain: the prefill yields the first token, one step per later one
    if mode == "ngram":
        full = generator.get_speculative_stats()
        stats = {k: full[k] for k in KEPT_STATS if k in full}
        # the target passes of the speculative loop (verify, re-anchor) and its plain fallback
        # steps; the first fallback step takes the prefill's logits, so the prefill is the
        # pass that count leaves out (as in plain mode: prefill + n-1 steps = n calls)
        forward_calls = int(full.get("target_forward_passes", 0)) + int(full.get("standard_fallback_steps", 0))
    del generator
    return new, t2 - t0, t1 - t0, forward_calls, stats


def step_latency(model, tokenizer, context: int, steps: int, seed: int) -> dict:
    """Median ms of one plain decode step with ~`context` tokens in the cache."""
    import numpy as np
    import onnxruntime_genai as og

    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(100, 40000, size=context)]
    params = og.GeneratorParams(model)
    # min_length keeps end-of-sequence from stopping the measurement early
    params.set_search_options(do_sample=False, max_length=context + steps + 1, min_length=context + steps + 1)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)  # the prefill
    gen.generate_next_token()  # samples from the prefill's logits: no forward pass, not timed
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        gen.generate_next_token()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return {
        "type": "step_latency",
        "context": context,
        "steps": steps,
        "median_ms": statistics.median(times),
        "p10_ms": times[len(times) // 10],
        "p90_ms": times[(len(times) * 9) // 10],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/cache/genai-smollm2-fp32", help="onnxruntime-genai model folder")
    ap.add_argument("--ngram-size", type=int, default=3)
    ap.add_argument("--max-draft-tokens", type=int, default=10, help="1..16")
    ap.add_argument("--step-latency", type=int, metavar="CONTEXT", default=None)
    ap.add_argument("--steps", type=int, default=32, help="steps timed by --step-latency")
    anchor_io.add_common_args(ap, prompts_required=False)
    args = ap.parse_args(argv)
    if args.step_latency is None and not args.prompts:
        ap.error("--prompts is required (unless --step-latency)")

    try:
        import onnxruntime_genai as og
    except ImportError as e:
        print(f"onnxruntime-genai is not installed in {sys.executable}: {e}", file=sys.stderr)
        return 3
    if not os.path.isfile(os.path.join(args.model, "genai_config.json")):
        print(f"no onnxruntime-genai model at {args.model} (run scripts/setup_anchors.sh)", file=sys.stderr)
        return 4

    model, tokenizer = load_model(args.model, args.threads)
    out = anchor_io.RecordWriter(args.out)
    meta = {
        "system": "onnxruntime-genai",
        "system_version": og.__version__,
        "model": os.path.abspath(args.model),
        "threads": args.threads,
    }

    if args.step_latency is not None:
        step_latency(model, tokenizer, args.step_latency, 4, args.seed)  # warm-up
        out.write({**meta, **step_latency(model, tokenizer, args.step_latency, args.steps, args.seed)})
        out.close()
        return 0

    modes = anchor_io.parse_modes(args.modes)
    prompts = anchor_io.validate_prompts(anchor_io.read_jsonl(args.prompts))
    greedy = args.temperature == 0
    options = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "ngram_size": args.ngram_size,
        "max_draft_tokens": args.max_draft_tokens,
    }
    meta["options"] = options
    gen_kw = anchor_io.generate_options(args, ngram_size=args.ngram_size,
                                        max_draft_tokens=args.max_draft_tokens)
    eos = set(int(t) for t in tokenizer.eos_token_ids)
    gen_kw["eos_ids"] = eos

    encoded = [(p, prompt_ids(tokenizer, p)) for p in prompts]
    if not args.no_warmup and encoded:
        for mode in modes:
            generate(model, encoded[0][1], mode=mode, **{**gen_kw, "max_new_tokens": min(16, args.max_new_tokens)})

    for p, ids in encoded:
        first_plain = None
        for rep in range(args.repeats):
            for mode in modes:
                new, wall, prefill, calls, stats = generate(model, ids, mode=mode, **gen_kw)
                if mode == "plain" and first_plain is None:
                    first_plain = new
                rec = anchor_io.run_record(
                    meta, p, mode=mode, repeat=rep, ids=ids, new=new, eos=eos, wall=wall,
                    prefill=prefill, calls=calls, first_plain=first_plain, greedy=greedy,
                    stats=stats)
                out.write(rec)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
