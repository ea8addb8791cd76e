"""`ortspec`: generate, export, bench, check.

    ortspec export [SOURCE] [--out DIR] ...          (needs the `export` extra)
    ortspec generate --model DIR --prompt "..." [--chat] [--temperature T] ...
    ortspec bench [--split dev] [--per-category N] ...
    ortspec check --model DIR [--providers ...]
    ortspec serve [--model DIR] [--port 8000] [--max-concurrent N] ...   (needs the `serve` extra)

Errors the user can fix print as one line and exit with status 2, no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .args import UserErrorParser, add_model_options, check_drafter_arg, model_arg, providers_arg
from ..drafters import DRAFTER_NAMES, NEEDS_DRAFT_MODEL
from ..errors import InvalidOptionError, InvalidPromptError, OrtspecError
from ..validation import check_int
from .. import __version__

if TYPE_CHECKING:
    from ..decoding.options import SpeculativeOptions
    from ..ort.providers import ProviderChoice
    from ..request import DrafterSpec


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (the default): greedy, token for token plain decoding's output; above "
                        "0: sampled, with exactly the model's distribution")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample from the likeliest tokens whose probability sums to p, in (0, 1]")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampling (the same seed, the same text)")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """`generate`'s request, checked before the model loads; the providers chosen once."""

    options: SpeculativeOptions
    drafter: DrafterSpec
    draft_length: str | None  # "auto" (the cost model) or None (--fixed-draft-len)
    providers: ProviderChoice


NO_PROMPT = ("give --prompt TEXT or --prompt-file PATH (- reads standard input), or pipe the "
             "prompt to standard input")


def _stdin_is_piped() -> bool:
    """Standard input exists and is not a terminal (a pipe or a file)."""
    try:
        return sys.stdin is not None and not sys.stdin.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _check_generate_args(args: argparse.Namespace) -> tuple[str, GenerateRequest]:
    """Everything `generate` can check before loading the model: the prompt text, and the
    request as `check_request` sees it without a model (options, drafter, providers)."""
    from ..decoding.options import SpeculativeOptions
    from ..ort.providers import choose_providers
    from ..request import DrafterSpec, check_request

    # neither: a prompt piped to standard input (`echo ... | ortspec generate`) is read
    piped = args.prompt is None and args.prompt_file is None and _stdin_is_piped()
    if args.prompt is None and args.prompt_file is None and not piped:
        raise OrtspecError(NO_PROMPT)
    if args.prompt is not None and args.prompt_file is not None:
        raise OrtspecError("give --prompt TEXT or --prompt-file PATH, not both")
    if args.seed is not None:
        check_int("--seed", args.seed, minimum=0)
    if args.threads is not None:
        check_int("--threads", args.threads, minimum=0, what=" (0 = onnxruntime's default)")
    if args.draft is not None and args.drafter not in NEEDS_DRAFT_MODEL:
        with_draft = " or ".join(n for n in DRAFTER_NAMES if n in NEEDS_DRAFT_MODEL)
        raise InvalidOptionError(f"--draft is used only with --drafter {with_draft}, "
                                 f"not {args.drafter!r}")
    if args.recalibrate and args.fixed_draft_len:
        raise InvalidOptionError("--recalibrate measures the cost model's curve; it has no use "
                                 "with --fixed-draft-len")
    options = SpeculativeOptions(
        args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, max_draft_len=args.max_draft_len,
    )
    # made on the request's slot, whose draft decoder runs on the slot's target KV buffers
    drafter = DrafterSpec(args.drafter, ngram_size=args.ngram_size, max_draft_len=args.max_draft_len)
    draft_length = None if args.fixed_draft_len else "auto"
    check_request(None, options, drafter=drafter, draft_length=draft_length)
    request = GenerateRequest(options, drafter, draft_length,
                              choose_providers(providers_arg(args.providers)))
    source = "-" if piped else args.prompt_file
    if source is None:
        return args.prompt, request
    where = "standard input" if source == "-" else f"--prompt-file {source!r}"
    try:
        if source == "-":
            if sys.stdin is None:
                raise OrtspecError("--prompt-file - reads standard input, and there is none")
            # as read_text reads a file: UTF-8, universal newlines
            text = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8").read()
        else:
            text = Path(source).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InvalidPromptError(f"{where} is not UTF-8 text ({e})") from None
    except (OSError, ValueError, AttributeError) as e:
        if not piped:  # (piped: no readable stream after all, as if nothing was piped)
            if isinstance(e, OSError):
                raise OrtspecError(f"cannot read {where}: {e.strerror or e}") from None
            raise
        text = ""
    if piped and not text:
        raise OrtspecError(NO_PROMPT)
    return text, request


def cmd_generate(args: argparse.Namespace) -> int:
    from ..load import load_model

    prompt, request = _check_generate_args(args)
    needs_draft = args.drafter in NEEDS_DRAFT_MODEL
    cost_model = args.drafter != "none" and request.draft_length == "auto"
    path = model_arg(args.model)
    check_drafter_arg(args.drafter, path)
    model = load_model(path, providers=request.providers, threads=args.threads,
                       draft=(args.draft or True) if needs_draft else None)
    if cost_model or args.recalibrate:  # the cost model, made before the request
        model.prepare(refresh=args.recalibrate)
    stream = model.stream(prompt, drafter=request.drafter, options=request.options,
                          chat=args.chat, draft_length=request.draft_length)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    r = stream.result
    assert r is not None
    c = r.counters
    tps = r.num_tokens / c.total_seconds if c.total_seconds > 0 else 0.0
    inside = c.ort_seconds + c.draft_seconds  # the target's runs, and the drafter's (a draft model's)
    outside = 1 - inside / c.total_seconds if c.total_seconds > 0 else 0.0
    accepted = f"acceptance {c.acceptance_rate:.1%} ({c.accepted}/{c.drafted})" if c.drafted \
        else "nothing drafted"
    print(
        f"[{r.num_tokens} tokens, {tps:.1f} tok/s, finish={r.finish_reason}, "
        f"{c.mean_tokens_per_call:.2f} tokens/call, {accepted}, {c.target_calls} target calls, "
        f"{outside:.1%} of wall time outside the target's ORT runs and the drafter]",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = UserErrorParser(prog="ortspec", description="Lossless speculative decoding on ONNX Runtime")
    ap.add_argument("--version", action="version", version=f"ortspec {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    sub.add_parser("export", help="checkpoint -> ONNX model directory (run `ortspec export -h`)", add_help=False)

    g = sub.add_parser("generate", help="decode a prompt, streaming the text")
    add_model_options(g)
    g.add_argument("--prompt", help="the prompt text (or --prompt-file; with neither, a prompt "
                                    "piped to standard input is read)")
    g.add_argument("--prompt-file", help="a file holding the prompt text, UTF-8 (- reads standard "
                                         "input)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    _add_sampling(g)
    g.add_argument("--drafter", default="auto", choices=DRAFTER_NAMES,
                   help="auto (the default): eagle3 where the model lists a draft head, else "
                        "prompt-lookup")
    g.add_argument("--draft", help="draft model directory (default: the one the manifest lists)")
    g.add_argument("--ngram-size", type=int, default=3,
                   help="prompt lookup and n-gram drafters: the longest n-gram matched (default 3)")
    g.add_argument("--max-draft-len", type=int, default=8,
                   help="tokens a block drafts at most (default 8; 0: no drafting; at most the "
                        "model's max_verify_len - 1); the cost model chooses up to it")
    g.add_argument("--fixed-draft-len", action="store_true",
                   help="always draft --max-draft-len tokens (no cost model)")
    g.add_argument("--recalibrate", action="store_true",
                   help="measure the cost model's cost curve again (a few seconds) and update its cache")
    g.set_defaults(func=cmd_generate, parser=g)

    b = sub.add_parser("bench", help="latency benchmark on Spec-Bench (run `ortspec bench -h`)", add_help=False)
    c = sub.add_parser("check", help="check an export and provider for losslessness", add_help=False)
    sub.add_parser("serve", help="OpenAI-compatible HTTP server (run `ortspec serve -h`)",
                   add_help=False)
    del b, c
    return ap


SERVE_PACKAGES = {"fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic", "anyio"}


def _serve(argv: list[str]) -> int:
    try:
        from ..serve.cli import main as serve_main
    except ImportError as e:
        if (e.name or "").partition(".")[0] not in SERVE_PACKAGES:
            raise
        raise OrtspecError(
            f"`ortspec serve` needs the serve extra: pip install 'ortspec[serve]' ({e})"
        ) from None
    return serve_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "export":  # (its module names the export extra where it lacks)
            from ortspec.export.cli import main as export_main

            return export_main(argv[1:])
        if argv and argv[0] == "bench":
            from ortspec.runtime.bench.cli import main as bench_main

            return bench_main(argv[1:])
        if argv and argv[0] == "serve":
            return _serve(argv[1:])
        if argv and argv[0] == "check":
            from .check import main as check_main

            return check_main(argv[1:])
        args, extra = build_parser().parse_known_args(argv)
        if extra:  # named by the subcommand's own parser: `ortspec generate -h`
            args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return args.func(args)
    except OrtspecError as e:
        print(f"ortspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
