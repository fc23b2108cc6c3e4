"""How a command runs, whichever entry started it (`gqaify`, `python -m gqaify.uptrain`): its exit status, its
one-line errors, and stop signals.

Exit status (see `gqaify.errors`): 0 done; 2 bad input (one line on stderr naming the problem and the fix,
nothing written); 1 the machine ran out of something (one line, e.g. disk space), another process of a CPU (gloo)
launch stopped (one line; `errors.peer_lost`), or an internal error (a bug: the traceback is printed); 130
interrupted with Ctrl-C, 143 stopped with SIGTERM (one line saying what is left); 141, with nothing said, where the
reader of its output went away (`gqaify recipes | head`). A stage that leaves something behind when it fails (uptrain's
checkpoints) says what, and this module makes the line (`Left`, `raise_as_said`).

Standard output is written with care too (`guarded_stdout`): a command started with it closed (`>&-`) is refused
before it does anything (2); one that cannot write it (`> /dev/full`: 1 for a full disk, 2 for anything else) says
so in one line, never in a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from gqaify.errors import (
    PEER_STOPPED,
    Interrupted,
    ResourceError,
    UserError,
    as_interrupt,
    forget_stop_signals,
    peer_lost,
    record_stop_signal,
)
from gqaify.output.whole import is_full_disk


def run_command(command: Callable[[], object], verbose: bool = False, process_exit: bool = False) -> int:
    """Run `command` (a stage: it parses its settings, runs, prints what it did) and return its exit status.

    `process_exit`: the process exits with that status next (its entry's `main` with no argv): a process whose peer
    in a launch stopped then keeps SIGTERM ignored to its exit (`_sigterm_as_interrupt`); otherwise, a caller in
    the same process, every signal handler is as it was before."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        with guarded_stdout():
            return _run(command, process_exit)
    except UserError as exc:  # standard output closed: refused before the command does anything
        return said(exc)


def _run(command: Callable[[], object], process_exit: bool) -> int:
    """`run_command` once standard output is guarded: the command's exit status, its failure said in one line."""
    with _sigterm_as_interrupt(process_exit) as ignore_sigterm:
        try:
            command()
            sys.stdout.flush()  # within the try: a reader gone before the last buffered line is found here
        except SystemExit as exc:  # a settings parser: --help, or a usage error reported on one line
            return flushed(int(exc.code or 0))
        except (UserError, ResourceError) as exc:
            if peer_lost(exc):  # a stage that said what its peer's stop left (uptrain's checkpoints)
                ignore_sigterm()
            return said(exc)
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (an `Interrupted`)
            return _stopped(as_interrupt(exc))
        except BrokenPipeError:  # `gqaify recipes | head`: the reader has what it wanted
            return reader_gone()
        except Exception as exc:
            if peer_lost(exc):
                ignore_sigterm()
                say(f"gqaify: error: {PEER_STOPPED}, and this one with it: that process's output says why")
                return 1
            stop = as_interrupt(exc)  # a stop signal that a library turned into an error of its own
            if stop is not None:
                return _stopped(stop)
            traceback.print_exc()
            say("gqaify: internal error (a bug in gqaify, not in your input); please report it")
            return 1
    return 0


@contextlib.contextmanager
def written_before_a_stop(what: str):
    """Within, a stage's output is whole already (what is left is its summary): a stop (Ctrl-C, SIGTERM) says `what`
    was written, where it said "nothing was written" of a conversion it cut short only in its summary."""
    try:
        yield
    except KeyboardInterrupt as exc:
        raise as_interrupt(exc).with_message(what) from None


def said(exc: UserError | ResourceError) -> int:
    """Say `exc` on its one line and return its exit status: 2 for bad input, 1 for a resource that ran out."""
    say(f"gqaify: error: {exc}")
    return 2 if isinstance(exc, UserError) else 1


@dataclass(frozen=True)
class Left:
    """What a stage that failed leaves on disk, in the words its one line ends with (`raise_as_said`) after each
    cause: a stop (Ctrl-C, SIGTERM), another process of the launch stopping (`errors.peer_lost`), and the disk of
    `disk` filling up. None: the stage has nothing to add for that cause (its error is raised as it is)."""

    stopped: str | None = None
    lost: str | None = None
    full: str | None = None
    disk: str = ""  # "output_dir /runs/a": what filled up


def raise_as_said(exc: BaseException, left: Left) -> None:
    """Raise the one-line error that a stage failing with `exc` ends with, saying what it `left`: an `Interrupted`
    for a stop, a `ResourceError` for another process's stop or for a full disk (the peer's stop first: the launcher
    stops this process too). Return where `exc` is none of these or `left` says nothing of its cause: the caller
    raises `exc` as it is (a `UserError` says its own line; anything else is a bug)."""
    if peer_lost(exc):
        if left.lost is not None:
            raise ResourceError(f"{PEER_STOPPED}; {left.lost}") from exc
        return
    stop = as_interrupt(exc)
    if stop is not None:
        if left.stopped is not None:
            raise stop.with_message(left.stopped) from None
        return
    if left.full is not None and is_full_disk(exc):
        raise ResourceError(f"no space left on the disk of {left.disk}; {left.full}") from exc


def say(line: str) -> None:
    """Write `line` and its newline to stderr in one write: the processes of a launch that each say the same line
    (a refusal every rank meets) never cut into each other's lines. `print` writes the text and the newline apart
    where stderr is unbuffered (PYTHONUNBUFFERED, python -u); one write of up to PIPE_BUF bytes to a pipe is whole."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def quiet_transformers() -> None:
    """Turn off transformers' own progress bars ("Loading weights", the hub's downloads, "Converting and de-quantizing
    GGUF tensors"), which printed between gqaify's lines, -q or not: a command shows one bar per long step, its own,
    and -q silences that too. Each command calls this before it loads a model. transformers' GGUF reader draws its bar
    with tqdm itself, past transformers' switch: it is given the bar that follows the switch."""
    from transformers import modeling_gguf_pytorch_utils as gguf_reader
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    gguf_reader.tqdm = transformers_logging.tqdm


def flushed(code: int) -> int:
    """`code`, once what is buffered for standard output is written; `reader_gone`'s status where its reader left
    (`gqaify --help | true`), and the one line of standard output that cannot be written (`guarded_stdout`)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return reader_gone()
    except (UserError, ResourceError) as exc:
        return said(exc)
    return code


# What a command started with its standard output closed (`gqaify recipes >&-`) is told: Python gives it no
# sys.stdout at all, where every print would be lost without a word (and a library's write to file descriptor 1
# would land in whatever file the process opened next).
CLOSED_STDOUT = (
    "standard output is closed (>&-), so nothing gqaify prints could be read; give the command one: > FILE, or "
    "> /dev/null to discard what it prints"
)
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # the disk behind standard output is full


@contextlib.contextmanager
def guarded_stdout():
    """Within, standard output says its own failures (`_Stdout`): a write or flush that fails, other than for a
    reader gone (`reader_gone`), raises the one-line `ResourceError` (no room: `> /dev/full`, a full disk) or
    `UserError` (anything else) that `run_command` says. Nested, the outer one holds.

    Raises:
        UserError: standard output is closed (`CLOSED_STDOUT`), before the block runs.
    """
    if sys.stdout is None:
        raise UserError(CLOSED_STDOUT)
    if isinstance(sys.stdout, _Stdout):
        yield
        return
    stream = sys.stdout
    sys.stdout = _Stdout(stream)
    try:
        yield
    finally:
        if isinstance(sys.stdout, _Stdout) and sys.stdout.stream is stream:
            sys.stdout = stream


class _Stdout:
    """Standard output (`stream`), whose failures to write are said as gqaify says every failure: in one line. A
    failure that is not Python's own (an `OSError` such as ENOSPC) raised from `print` looked like gqaify's bug; it
    is also one that argparse swallows, printing --help, so that nothing was said and the status was 0."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:  # the reader left: `run_command` says nothing (141)
            raise
        except OSError as exc:
            raise _unwritable(self.stream, exc) from None

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _unwritable(self.stream, exc) from None

    def __getattr__(self, name: str):  # fileno, isatty, encoding, buffer...: the stream's own
        return getattr(self.stream, name)


def _unwritable(stream, exc: OSError) -> UserError | ResourceError:
    """The one-line error for standard output (`stream`) that failed with `exc`; what is still buffered for it is
    dropped (its file descriptor pointed at /dev/null, as `reader_gone` does), so that the exit's own flush cannot
    fail again."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    why = exc.strerror or str(exc)
    if exc.errno in _NO_ROOM:
        return ResourceError(
            f"standard output cannot be written ({why}), so what gqaify printed there is lost; point it at a file "
            "on a disk with room, or > /dev/null"
        )
    return UserError(
        f"standard output cannot be written ({why}), so what gqaify printed there is lost; point it at a file "
        "or terminal it can write, or > /dev/null"
    )


def reader_gone() -> int:
    """The status of a command whose standard output was closed by its reader (`| head`), as a shell reports a
    process SIGPIPE stopped (128 + 13), with nothing said: stdout is pointed at /dev/null, so that the exit's
    flush of what is still buffered cannot fail again."""
    import os

    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _stopped(stop: Interrupted) -> int:
    """One line: how the run was stopped, and what it left (the stop's message; none: nothing, as every output
    appears whole or not at all; a run that leaves something, uptrain's checkpoints, the demo's finished steps,
    says so)."""
    what = "stopped by SIGTERM" if stop.signum == signal.SIGTERM else "interrupted"
    say(f"gqaify: {what}; {str(stop) or 'nothing was written'}")
    return stop.exit_status


@contextlib.contextmanager
def _sigterm_as_interrupt(process_exit: bool = False):
    """While the block runs, SIGTERM raises `Interrupted` (as Ctrl-C raises KeyboardInterrupt), so that the
    same cleanup runs; a second SIGTERM is ignored until the cleanup is done. Both signals are recorded
    (`errors.record_stop_signal`), so that a library turning the exception into its own is still a stop.

    A process whose peer in a launch stopped (`errors.peer_lost`) ignores SIGTERM from then on: the launcher stops
    what is left of a launch with SIGTERM once one process ended, which would cut into the line this process says
    about it, or replace its exit status. The block gets the function that starts ignoring it. With
    `process_exit` (the process exits when the block ends) it stays ignored to the exit; otherwise the previous
    handler is back when the block ends, as for every other way out.
    """
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield lambda: None
        return
    ignoring = []  # not empty once SIGTERM is ignored to the end

    def ignore_sigterm():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ignoring.append(True)

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if peer_lost(sys.exc_info()[1]):  # the launcher's echo of the peer's stop this process is handling
            ignoring.append(True)
            return
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
        yield ignore_sigterm
    finally:
        if not (ignoring and process_exit):
            signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
