"""ortspec.runtime.bench: latency benchmarks on Spec-Bench, plain vs speculative, side by side in one run.

    ortspec bench --split dev --per-category 5 --max-new-tokens 128 --temperature 0

See `cli.py` for every option, `workload.py` for the prompts, `runner.py` for how pairs are
interleaved, `report.py` for the tables, JSON and plots.
"""
