"""`ortspec check`: run the losslessness checks (`ortspec.runtime.check.checks`) on one export and
provider, and print them as a table.

    ortspec check [--model DIR] [--providers CUDAExecutionProvider,CPUExecutionProvider]
                  [--threads N] [--draws N] [--new-tokens N] [--seed N] [--alpha A]

Exit status: 0 all checks passed, 1 a check failed, 2 a bad model directory, provider or option
(one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from ..check.checks import ALPHA, format_table, run_checks
from .args import UserErrorParser, add_model_options, model_arg, providers_arg
from ..errors import InvalidOptionError, OrtspecError
from ..validation import check_int


def build_parser() -> argparse.ArgumentParser:
    ap = UserErrorParser(prog="ortspec check",
                         description="check an export and provider for losslessness")
    add_model_options(ap)
    ap.add_argument("--draws", type=int, default=20_000, help="draws per sampler test")
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens per greedy-identity prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alpha", type=float, default=ALPHA, help="significance level per test")
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad option values before the model loads."""
    for name, lo in (("draws", 100), ("new_tokens", 1), ("seed", 0)):
        v = getattr(args, name)
        if v < lo:
            raise InvalidOptionError(f"--{name.replace('_', '-')} must be >= {lo}, got {v}")
    if args.threads is not None:
        check_int("--threads", args.threads, minimum=0, what=" (0 = onnxruntime's default)")
    if not 0 < args.alpha < 1:
        raise InvalidOptionError(f"--alpha must be in (0, 1), got {args.alpha}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        check_args(args)
        return _run(args)
    except OrtspecError as e:
        print(f"ortspec: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from ..load import load_model

    t0 = time.perf_counter()
    path = model_arg(args.model)
    model = load_model(path, providers=providers_arg(args.providers), threads=args.threads)
    m = model.manifest
    print(f"ortspec check: {path} ({m.precision}, capacity {m.capacity}, verify up to "
          f"{m.max_verify_len}) on {', '.join(model.providers)}", flush=True)
    rows = run_checks(model, draws=args.draws, seed=args.seed, new_tokens=args.new_tokens,
                      alpha=args.alpha)
    print(format_table(rows))
    failed = [r for r in rows if not r.passed]
    print(f"{len(rows) - len(failed)}/{len(rows)} checks passed "
          f"({time.perf_counter() - t0:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
