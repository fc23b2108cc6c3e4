"""A file or folder written whole or not at all: under a hidden name beside its place, renamed into place when
complete (`written_whole`, `write_text_whole`, `file_into_place`); a full disk said in one line (`is_full_disk`).
A command's OUT is this with OUT's own rules (`output.destination.staged`)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from gqaify.errors import ResourceError, UserError


@contextlib.contextmanager
def written_whole(path: Path, full_disk: str | None = None, main_process: bool = True) -> Iterator[Path]:
    """A hidden name beside `path` (.NAME.tmp) to write a file or a folder into, renamed over `path` when the block
    completes and removed if it does not: readers find the old `path` or the new one, never a part. What a killed
    run left under that name is removed first. (`staged` is this for a command's OUT, with OUT's rules.)

    Args:
        full_disk: the message of the `ResourceError` a full disk raises (None: the OSError itself).
        main_process: False in the other processes of a distributed run, which write into the same name and
            leave removing it and renaming it to the main process.

    Raises:
        ResourceError: the disk filled up (with `full_disk`); `path` is as it was.
    """
    partial = path.with_name(f".{path.name}.tmp")
    if not main_process:
        yield partial
        return
    _remove(partial)
    message = None if full_disk is None else lambda: full_disk
    with put_in_place_when_whole(partial, lambda: _replace(partial, path), message):
        yield partial


@contextlib.contextmanager
def put_in_place_when_whole(
    partial: Path, put_in_place: Callable[[], None], full_disk: Callable[[], str] | None
) -> Iterator[None]:
    """Call `put_in_place` when the block completes; if the block or it fails, remove `partial`, and turn a full
    disk into a `ResourceError` with the message `full_disk()` (where given)."""
    try:
        yield
        put_in_place()
    except BaseException as exc:
        _remove(partial)
        if full_disk is not None and isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise ResourceError(full_disk()) from exc
        raise


def write_text_whole(path: Path, text: str, full_disk: str | None = None) -> None:
    """Write the text file `path` (UTF-8) whole or not at all (`written_whole`).

    Raises:
        ResourceError: the disk filled up (with `full_disk`); what was at `path` before stays.
    """
    with written_whole(path, full_disk=full_disk) as partial:
        partial.write_text(text, encoding="utf-8")


def readable_as_umask_allows(folder: Path) -> None:
    """Give every file under `folder` the mode a file the process creates gets (0666 less the umask): a library
    that writes through a private temporary file (safetensors' 0600) leaves it readable to its owner alone."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def is_full_disk(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is the file system's ENOSPC: an OSError, or a library's own
    error that only says so in words (safetensors' StorageFull)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(exc) or "StorageFull" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _replace(partial: Path, path: Path) -> None:
    """Rename `partial` to `path`, replacing the file or folder there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)  # a rename replaces a file or an empty folder, not a full one
    os.replace(partial, path)


def _remove(path: Path) -> None:
    """Remove the file or folder at `path`, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def file_into_place(partial: Path, out: Path, replaceable: Callable[[], str | None] | None, option: str = "OUT"):
    """Put the finished file `partial` (in this run's own work folder) at `out`, refusing a rival.

    Without `replaceable` (no --force), `out` is created only if nothing is there: a hard link made with the
    kernel's create-if-absent, so that of two runs writing one OUT, one wins and the other is refused, each file
    whole. With it, `out` is replaced only if `replaceable()` (asked again now: another run may have written it
    since the run began) finds no problem, by an atomic rename.

    Raises:
        UserError: `out` appeared meanwhile (without --force), or may no longer be replaced.
    """
    if replaceable is not None:
        if problem := replaceable():
            raise UserError(problem)
        os.replace(partial, out)
        return
    try:
        os.link(partial, out)
    except FileExistsError as exc:
        raise UserError(
            f"{out} already exists: it appeared while this run was writing (another run writing the same {option}?) "
            f"and was not touched; pass --force to replace it, or choose another {option}"
        ) from exc
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP):  # no hard links here: rename
            raise
        if out.exists() or out.is_symlink():
            raise UserError(
                f"{out} already exists: it appeared while this run was writing; pass --force to "
                f"replace it, or choose another {option}"
            ) from exc
        os.replace(partial, out)
