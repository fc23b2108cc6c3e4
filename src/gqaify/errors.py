"""How gqaify fails: each kind of failure has its exit status and says what happened on one line.

UserError       bad input: names the problem and the fix                       exit 2, nothing written
ResourceError   the machine ran out of something (disk space): says what/how much   exit 1, no traceback
Interrupted     Ctrl-C or SIGTERM: says what is left on disk, and how to resume    exit 130 or 143
anything else   a bug in gqaify: the traceback is printed                          exit 1

A process of a CPU (gloo) launch whose peer stopped (killed, out of memory, Ctrl-C) fails in its next collective:
that is not a bug either (`peer_lost`), but a ResourceError saying so, exit 1.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable


class UserError(Exception):
    """Bad input: a message of one line naming the problem and how to fix it."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


class ResourceError(Exception):
    """Not the user's input and not a bug: the machine ran out of something. One line, no traceback."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal; the message (if any) says what is left and how to go on.

    A subclass of KeyboardInterrupt, so that every cleanup written for Ctrl-C also runs for SIGTERM.
    """

    def __init__(self, message: str = "", signum: int = signal.SIGINT):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM

    def with_message(self, message: str) -> Interrupted:
        return Interrupted(message, self.signum)


# The stop signal that arrived while a command ran, recorded by the command line's handlers. The exception a
# handler raises can come out of a library as another one (torch, inside safetensors' loader, turns it into a
# ValueError): an error raised after a stop signal is still a stop, not a bug.
_stop_signals: list[int] = []


def record_stop_signal(signum: int) -> None:
    _stop_signals.append(signum)


def forget_stop_signals() -> None:
    """A new command starts: signals recorded for an earlier one (in this process) no longer apply."""
    _stop_signals.clear()


def as_interrupt(exc: BaseException) -> Interrupted | None:
    """`exc` as the stop it stands for: Ctrl-C, SIGTERM, or an error raised after a stop signal; else None."""
    if isinstance(exc, Interrupted):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted(str(exc), signal.SIGINT)
    if _stop_signals and isinstance(exc, Exception):
        return Interrupted("", _stop_signals[-1])
    return None


# What gloo (torch.distributed's CPU backend) says when the process at the other end of a connection is gone: its
# socket read end of file, or the connection reset or broken. torch has no exception type for it: gloo's
# IoException arrives as a plain RuntimeError whose message starts with the place in gloo's TCP transport that
# raised it (third_party/gloo/gloo/transport/tcp/pair.cc: "Connection closed by peer [ADDRESS]", "Read error
# [ADDRESS]: Connection reset by peer", "writev [ADDRESS]: Broken pipe", "Socket closed [ADDRESS]").
_GLOO_TRANSPORT = "gloo/transport/"
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed")


# What a process of a launch says when its peer stopped (`peer_lost`); a stage adds what is left.
PEER_STOPPED = "another process of the launch stopped"


def peer_lost(exc: BaseException | None) -> bool:
    """`exc`, or an error it arose from (its cause or context), is gloo's word that another process of the launch
    is gone: the process that raised it stopped only because its peer did. Timeouts (a peer that hangs) are not.
    Only CPU (gloo) launches are recognised: NCCL's failures on GPUs are not told apart from others here (its
    watchdog often aborts the process itself), so they still end with a traceback."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if isinstance(exc, RuntimeError) and _GLOO_TRANSPORT in text and any(p in text for p in _PEER_GONE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def one_line(exc: BaseException) -> str:
    """ "ConnectError: [Errno -2] Name or service not known": an exception's type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


# What a check returns: one problem (a string), none (None), or several (a list). Checks return whichever reads
# best; `problems_in` gathers them, in order.
Found = str | Iterable[str] | None


def problems_in(*found: Found) -> list[str]:
    """Every problem `found` holds, in order: `problems_in(one_problem(), several_problems(), None)`."""
    problems = []
    for item in found:
        if isinstance(item, str):
            problems += [item] if item else []
        elif item is not None:
            problems += [p for p in item if p]
    return problems


def raise_if_problems(*found: Found) -> None:
    """Raise one `UserError` carrying every problem found (`problems_in`), so the user fixes them all in one go."""
    if problems := problems_in(*found):
        raise UserError("; ".join(problems))
