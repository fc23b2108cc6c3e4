"""What runs leave beside OUT, and its removal: the hidden names a run makes there carry their owner (a hash of the
host name, the process id and its start time: `owner_tag`), so that the next run removes what a killed run left
(`remove_leftovers`) and leaves alone what a live one is writing; the parent folders a run made are removed again
when it fails (`remove_created`)."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import re
import shutil
import socket
from pathlib import Path

LOG = logging.getLogger(__name__)

_OWNER = re.compile(r"^\.(?P<out>.+)\.gqaify-(?P<old>old-)?(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)-[^-]+$")


def remove_leftovers(out: Path) -> list[str]:
    """Clear what killed runs left beside `out`; return one message per folder found (also logged).

    A staging folder whose owner process is gone is removed; an old OUT that a killed replacement had set
    aside is put back if OUT is missing (else removed: the replacement is in place). Folders of live
    processes are left alone silently; those of other hosts or without an owner in their name, with a word.
    """
    messages = []
    if not out.parent.is_dir():
        return messages
    for folder in sorted(out.parent.glob(f".{glob.escape(out.name)}.gqaify-*")):
        if not folder.is_dir() or folder.is_symlink():
            continue
        owner = _OWNER.match(folder.name)
        if owner is None or owner["out"] != out.name:
            messages.append(f"left {folder} alone: its name records no owner; delete it if no conversion is running")
            continue
        alive = _alive(owner["host"], int(owner["pid"]), int(owner["start"]))
        if alive is None:
            messages.append(f"left {folder} alone: it belongs to a run on another host")
            continue
        if alive:
            continue  # a run writing it now
        pid = owner["pid"]
        if owner["old"] and (folder / out.name).is_dir() and not out.exists() and not out.is_symlink():
            (folder / out.name).rename(out)
            shutil.rmtree(folder, ignore_errors=True)
            messages.append(f"put back {out}, which a replacement killed mid-swap (process {pid}) had set aside")
            continue
        size = _tree_size(folder)
        shutil.rmtree(folder, ignore_errors=True)
        messages.append(f"removed {folder} ({size / 1e6:,.1f} MB), left by a run that was killed (process {pid})")
    for message in messages:
        LOG.warning(message)
    return messages


def owner_tag(pid: int | None = None) -> str:
    """host hash, pid and start time (centiseconds) of a process: what tells a later run whether it lives."""
    pid = os.getpid() if pid is None else pid
    return f"{host_hash()}-{pid}-{_start_time(pid)}"


def host_hash() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _start_time(pid: int) -> int | None:
    import psutil

    try:
        return round(psutil.Process(pid).create_time() * 100)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _alive(host: str, pid: int, start: int) -> bool | None:
    """Whether the process (`pid`, started at `start`) on `host` still runs; None for another host."""
    if host != host_hash():
        return None
    started = _start_time(pid)
    return started is not None and abs(started - start) <= 1  # a reused pid has another start time


def remove_created(created: list[Path]) -> None:
    for parent in reversed(created):
        with contextlib.suppress(OSError):
            parent.rmdir()


def _tree_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
