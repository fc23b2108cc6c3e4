"""A claim on OUT: one run at a time writes into it in place over a long run (generate's corpus, shard by shard).

`claimed` holds an exclusive lock on .OUT.gqaify.claim beside OUT, which names the holder's pid: a second run
for the same OUT is refused at once and writes nothing. The kernel drops the lock when its process ends, however
it ends: the claim file a killed run left is removed by the next run, never mistaken for a live one. A claim is only
ever written into a file its run created (O_EXCL): anything else of that name (a symbolic or hard link, a FIFO, a
file that is no claim) is refused, never followed, truncated or deleted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from gqaify.errors import UserError
from gqaify.output.leftovers import remove_created

LOG = logging.getLogger(__name__)

CLAIM_SUFFIX = ".gqaify.claim"  # .OUT.gqaify.claim beside OUT: outside the .OUT.gqaify-* names of staging folders
CLAIM_INSIDE = ".gqaify.claim"  # in OUT itself, for a claim `inside` allows where nothing can be written beside OUT
_CLAIM_WRITTEN_WITHIN = 1.0  # seconds a refused run waits for the holder to write its pid into a new claim
_CLAIM_MAX_BYTES = 4096  # a claim is a short JSON object: a longer file is none


@contextlib.contextmanager
def claimed(out: Path, command: str, option: str = "OUT", inside: bool = False) -> Iterator[None]:
    """Hold `out` for this process for the whole block: a run that asks for the same `out` meanwhile (another
    process, or another claim in this one) is refused at once, and the block's own run goes on untouched.

    The claim is an exclusive `flock` on .OUT.gqaify.claim beside `out` (beside the folder a symbolic link names:
    two names of one folder are one claim), which records the holder's pid and `command` for the refusal. The
    kernel drops the lock when its process ends, so a claim file a killed run left is removed and made anew. The file
    is removed when the block ends, and so are the parent folders made for it if they are still empty. Anything
    else of that name (a symbolic link, a FIFO, a folder, a file that is no claim) is refused, and left as it is.

    With `inside`, a writable folder `out` in a place that cannot be written (a read-only parent) holds its claim
    itself, as `out`/.gqaify.claim: every run asking for that folder finds the same place read-only and looks there
    too. The caller counts that name as its own (uptrain's output_dir).

    Raises:
        UserError: another run holds `out`: "OUT is being written by another gqaify generate (pid N); ...";
            the claim's name holds something else; or nothing can be written beside `out`.
    """
    real = out.resolve()
    path = real.with_name(f".{real.name}{CLAIM_SUFFIX}")
    if inside and real.is_dir() and not os.access(real.parent, os.W_OK) and os.access(real, os.W_OK):
        path = real / CLAIM_INSIDE
    created = []  # parent folders made here, removed again at the end if empty
    for parent in reversed(real.parents):
        if not parent.exists():
            try:
                parent.mkdir()
            except OSError as exc:
                remove_created(created)
                raise UserError(f"cannot create {parent} ({exc.strerror}); choose another {option}") from exc
            created.append(parent)
    try:
        fd = _lock_claim(path, out, option)
    except BaseException:
        remove_created(created)
        raise
    try:
        if fd is not None:  # a file this run created and locked: nothing else has it open for writing
            os.write(fd, json.dumps({"pid": os.getpid(), "command": command}).encode())
        yield
    finally:
        if fd is not None:
            if _names(path, fd):  # while locked: a run that opened this file meanwhile sees it gone, and claims anew
                with contextlib.suppress(OSError):
                    path.unlink()
            os.close(fd)
        remove_created(created)


def _lock_claim(path: Path, out: Path, option: str) -> int | None:
    """An open descriptor of the claim file `path`, exclusively locked (None where the filesystem has no locks):
    always a new file, created here with O_EXCL (links not followed); a claim file a killed run left is removed
    first.

    Raises:
        UserError: another run holds the lock; `path` is no claim file (`_open_claim`), has other names (a hard
            link) or other content; it cannot be created.
    """
    import fcntl

    while True:
        new = True
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            new, fd = False, _open_claim(path, out, option)
            if fd is None:
                continue  # removed meanwhile: create it
        except OSError as exc:
            raise UserError(f"cannot write beside {out} ({exc.strerror}); choose another {option}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _claim_holder(fd)
            os.close(fd)
            raise UserError(
                f"{out} is being written by another {holder}; wait for it or choose another {option}"
            ) from None
        except OSError as exc:  # a filesystem without locks (some FUSE mounts): go on, and say what is not guarded
            if new and _names(path, fd):
                with contextlib.suppress(OSError):
                    path.unlink()
            os.close(fd)
            LOG.warning("cannot lock %s (%s): a rival run writing %s would not be refused", path, exc.strerror, out)
            return None
        if not _names(path, fd):
            os.close(fd)  # its holder finished and removed it between our open and our lock: claim the new file
            continue
        if new:
            return fd
        # A claim a killed run left (locked now, so no run is writing it): it is removed and claimed anew with
        # O_EXCL, so that the claim is only ever written into a file this run created. A file with another name
        # (a hard link) or other content is not gqaify's: refused, and left as it is.
        problem = "a file with other names (a hard link)" if os.fstat(fd).st_nlink != 1 else None
        if problem is None and not _holds_a_claim(fd):
            problem = "a file of other content"
        if problem is None:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:  # a stale claim another user left in a folder this one may not change
                os.close(fd)
                raise UserError(
                    f"cannot remove the stale claim {path} ({exc.strerror}); delete it, then rerun"
                ) from None
        os.close(fd)
        if problem is not None:
            raise UserError(_not_a_claim(path, problem, out, option))


def _open_claim(path: Path, out: Path, option: str) -> int | None:
    """An open descriptor of the existing `path`, if it is a plain file (links not followed: a FIFO or a device
    is never opened); None if it is gone.

    Raises:
        UserError: `path` is a symbolic link, a folder or any other thing than a plain file; it cannot be opened.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(mode):
        raise UserError(_not_a_claim(path, _file_kind(mode), out, option))
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a link since the look
            raise UserError(_not_a_claim(path, "a symbolic link", out, option)) from None
        raise UserError(f"cannot write beside {out} ({exc.strerror}); choose another {option}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UserError(_not_a_claim(path, _file_kind(mode), out, option))
    return fd


def _file_kind(mode: int) -> str:
    """ "a symbolic link", "a FIFO", ...: what a file of `mode` (lstat's) is, in words."""
    kinds = {stat.S_ISLNK: "a symbolic link", stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a FIFO"}
    return next((name for test, name in kinds.items() if test(mode)), "a special file (a socket or device)")


def _not_a_claim(path: Path, what: str, out: Path, option: str) -> str:
    return (
        f"{path} is {what}, not a claim gqaify wrote; gqaify holds {option} {out} under that name and left it as it "
        "is: move it away, then rerun"
    )


def _holds_a_claim(fd: int) -> bool:
    """Whether the file at `fd` holds a claim as `claimed` writes it ({"pid": N, "command": "..."}), or nothing
    (what a claim is between its creation and its first write, and what a run killed then leaves)."""
    data = os.pread(fd, _CLAIM_MAX_BYTES + 1, 0)
    if not data:
        return True
    try:
        value = json.loads(data) if len(data) <= _CLAIM_MAX_BYTES else None
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"pid", "command"}
        and isinstance(value["pid"], int)
        and isinstance(value["command"], str)
    )


def _names(path: Path, fd: int) -> bool:
    """Whether `path` (not followed, if a link) is the file open at `fd`."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except FileNotFoundError:
        return False


def _claim_holder(fd: int) -> str:
    """ "gqaify generate (pid 123)": who holds the claim open at `fd`, as the holder wrote it (it writes just after
    locking: wait a moment for it)."""
    deadline = time.monotonic() + _CLAIM_WRITTEN_WITHIN
    while True:
        try:
            holder = json.loads(os.pread(fd, _CLAIM_MAX_BYTES, 0))
            return f"{holder['command']} (pid {int(holder['pid'])})"
        except (OSError, ValueError, TypeError, KeyError):
            if time.monotonic() > deadline:
                return "gqaify run (pid unknown)"
            time.sleep(0.02)
