"""Output folders (a conversion's OUT, eval's --out): they appear whole or not at all, and gqaify never removes a
file it did not write.

    staging     OUT is written into a hidden folder beside it and renamed to OUT when complete, so a crash or
                a kill never leaves a partial OUT. The staging folder's name records its owner (a hash of the
                host name, the process id and the process's start time):

                    .OUT.gqaify-<host>-<pid>-<start>-<random>        a folder being written
                    .OUT.gqaify-old-<host>-<pid>-<start>-<random>    the OUT it replaces, set aside

    --force     replaces OUT only if it is empty, or if gqaify wrote it as the same command's output: its
                gqaify.json lists every file in the folder, nothing else is there, and it records what the command
                writes (`written_kind`: an eval replaces an eval report, never a model; a conversion replaces a
                conversion). The old OUT is set aside, the new one renamed into place, then the old one deleted;
                if the rename fails, the old one is put back. The current folder, its ancestors, an empty OUT, a
                mount point, a read-only folder and what the command reads (`overlap_problem`) are never targets.

    checks      `destination_problems` finds all of the above before any work: a refusal costs nothing. It
                starts with `name_problem`: a name longer than the file system allows, less what the staging
                names add to OUT's (a name gqaify could not make beside OUT is refused as OUT's own).

    files       a file or folder that a run rewrites in a folder of its own (a corpus's shards and gqaify.json,
                uptrain's run.json, checkpoints and final model) is written under a hidden name beside it,
                .NAME.tmp, and renamed over it when complete (`whole.written_whole`): it too is whole or absent.

    claims      a command that writes into OUT over a long run, in place (generate's corpus, shard by shard), holds
                OUT for its whole duration (`claims.claimed`): an exclusive lock on a file beside it, .OUT.gqaify.claim,
                which names the holder's pid. A second run for the same OUT is refused at once and writes nothing.
                The kernel drops the lock when its process ends, however it ends: what a killed run left is taken
                over by the next run, never mistaken for a live one. Anything else of that name (a link, a FIFO,
                a file that is no claim) is refused, never followed, truncated or deleted.

    leftovers   a run killed with SIGKILL cannot clean up after itself. The next run writing beside the same
                OUT removes the staging folders whose owner process is gone (and puts back an old OUT that a
                killed replacement had set aside), and says so; it leaves alone those of live processes, of
                other hosts, and of unknown owners (`leftovers.remove_leftovers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import gqaify.records as records
from gqaify.errors import UserError
from gqaify.output.leftovers import owner_tag, remove_created
from gqaify.output.whole import put_in_place_when_whole
from gqaify.records import PROVENANCE_FILE, Provenance, listed_files, read_provenance, record_text

LOG = logging.getLogger(__name__)


def resolve_out(out: str | os.PathLike) -> Path:
    """`out` as an absolute path with `.` and `..` taken away (symbolic links are kept: OUT may be one)."""
    return Path(os.path.abspath(os.path.expanduser(os.fspath(out))))


# -- what may be written, and what may be replaced -------------------------------------------------------------


def destination_problems(
    out: str | os.PathLike, force: bool, option: str = "OUT", writes: str | None = None
) -> list[str]:
    """Problems with writing a new folder at `out` (replacing it if `force`, where it holds `writes`, what the
    command writes: see `replace_problem`): empty, here, taken, unwritable."""
    if not os.fspath(out).strip():
        return [f"{option} is empty; name the folder to write"]
    if problem := name_problem(out, option):
        return [problem]  # first: the file system refuses even to look up a name that long
    path = resolve_out(out)
    here = Path.cwd().resolve()
    real = path.resolve()
    if real == here or real in here.parents:
        return [f"{option} {out} is the current folder or one above it; name a new folder to write into"]
    if path.is_symlink() and not path.exists():
        return [f"{option} {path} is a broken symbolic link; remove it or choose another {option}"]
    if not path.exists():
        if not _writable_location(path):
            return [f"cannot write {path}: its parent is not a writable folder; choose another {option}"]
        return []
    if not path.is_dir():
        return [f"{path} exists and is not a folder; choose another {option}"]
    problem = _unreplaceable(path, option)
    if problem:
        return [problem]
    if not force:
        return [f"{path} already exists; pass --force to replace it, or choose another {option}"]
    problem = replace_problem(path, option, writes)
    return [problem] if problem else []


def overlap_problem(out: str | os.PathLike, read: str | os.PathLike, what: str, option: str = "OUT") -> str | None:
    """Why `out` may not be written where it is: it is `read` (a folder or file the command reads, which `what`
    names: "the source folder"), inside it, or holds it; else None. Symbolic links are resolved: two names of one
    folder are one folder. Checked before `destination_problems`, whose "pass --force" would be the wrong fix."""
    src, dst = Path(read).expanduser().resolve(), resolve_out(out).resolve()
    if dst == src:
        return f"{option} {out} is {what} itself, which gqaify never modifies; choose another {option}"
    if src in dst.parents or dst in src.parents:
        return f"{option} {out} overlaps {what} {src}, which gqaify never modifies; choose another {option}"
    return None


# What the longest name gqaify makes beside OUT adds to OUT's name: .OUT.gqaify-old-<host>-<pid>-<start>-<random>
# (`staged`), with a process id of up to 7 digits, a start time of up to 13 (centiseconds) and mkdtemp's 8 characters.
_ADDED_BESIDE = len("..gqaify-old-") + 8 + 1 + 7 + 1 + 13 + 1 + 8
_NAME_MAX = 255  # where the file system does not say (os.pathconf): what Linux, macOS and Windows allow


def name_problem(out: str | os.PathLike, option: str = "OUT", beside: bool = True) -> str | None:
    """Why the file system would refuse a name in `out`, or None: a folder to be made on the way to it, or its own
    name, is longer than the file system allows; with `beside` (a command that stages OUT beside it: `staged`,
    `work_folder`), OUT's name leaves no room for the hidden names gqaify makes beside it."""
    if not os.fspath(out).strip():
        return None
    path = resolve_out(out)
    existing = next(p for p in (path, *path.parents) if os.path.exists(p))  # os.path.exists: no error on any name
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        name_max = _NAME_MAX
    for part in path.relative_to(existing).parts[:-1]:
        if (size := len(os.fsencode(part))) > name_max:
            return (
                f"{option} {path} has a folder name longer than the file system allows ({size} bytes, at most "
                f"{name_max}): choose a shorter name"
            )
    size, added = len(os.fsencode(path.name)), _ADDED_BESIDE if beside else 0
    if size + added <= name_max:
        return None
    room = f": {name_max} less the {added} that gqaify adds to name its working folders beside it" if added else ""
    return (
        f"{option} name is longer than the file system allows ({size} bytes, at most {name_max - added}{room}): "
        "choose a shorter name"
    )


def writable_problem(folder: Path, option: str) -> str | None:
    """Why a command could not write into `folder` (made if missing, else written into as it is), or None."""
    if folder.is_dir():
        writable = os.access(folder, os.W_OK | os.X_OK)
        return None if writable else f"{option} {folder} is read-only; choose another {option}"
    if not _writable_location(folder):
        return f"cannot write {folder}: its parent is not a writable folder; choose another {option}"
    return None


def _unreplaceable(folder: Path, option: str) -> str | None:
    """Why `folder` could not be replaced even with --force: the folder beside it, or itself, cannot be changed."""
    if not os.access(folder.parent, os.W_OK | os.X_OK):
        return f"cannot write beside {folder}: {folder.parent} is not writable; choose another {option}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is read-only; choose another {option}"
    if os.path.ismount(folder):  # a rename cannot replace it
        return f"{folder} is a mount point, which gqaify does not replace; choose a folder inside it as {option}"
    return None


def replace_problem(folder: Path, option: str = "OUT", writes: str | None = None) -> str | None:
    """Why `--force` may not replace `folder`, or None: it is empty, or holds exactly the files gqaify wrote as
    `writes` (the record kind the command writes, `records.CONVERSION` or `records.REPORT`; None: it replaces only an
    empty folder)."""
    entries = sorted(folder.iterdir())
    if not entries:
        return None
    listed = listed_files(folder)
    if listed is None:
        return (
            f"--force replaces only a folder gqaify wrote, and {folder} holds {_some(entries)} but no "
            f"{PROVENANCE_FILE} listing them; choose another {option}, or empty it yourself"
        )
    kind, wanted = written_kind(folder), KIND_WORDS.get(writes)
    if wanted is None or kind != wanted:
        what = "an empty folder" if wanted is None else wanted
        return (
            f"--force on {option} replaces only {what}, and {folder} holds {kind or 'another output of gqaify'}; "
            f"choose another {option}"
        )
    foreign = [p for p in entries if p.name != PROVENANCE_FILE and (p.name not in listed or not _plain_file(p))]
    if foreign:
        return (
            f"--force replaces only what gqaify wrote, but {folder} also holds {_some(foreign)}; move "
            f"{'it' if len(foreign) == 1 else 'them'} out, or choose another {option}"
        )
    return None


# What a folder gqaify wrote holds, as its gqaify.json says: --force replaces a folder only with output of the same
# kind. Each record's kind (`records.Provenance.kind`) as the messages name it.
KIND_WORDS = {
    records.CONVERSION: "a converted model",
    records.UPTRAINED: "an uptrained model",
    records.REPORT: "an eval report",
    records.CORPUS: "a corpus",
}
# A model's files: a folder holding one is a model, whatever its record says (a report never holds one)
_MODEL_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.gguf", "*.pt", "*.pth")


def written_kind(folder: Path) -> str | None:
    """What gqaify wrote in `folder`, in words (`KIND_WORDS`: "a converted model", "an eval report", ...), as its
    gqaify.json records; "a model" for any other folder holding a model's files; None where neither tells."""
    provenance = read_provenance(folder) if (folder / PROVENANCE_FILE).is_file() else None  # not a run.json
    kind = None if provenance is None else provenance.kind
    if kind in (records.CONVERSION, records.UPTRAINED):
        return KIND_WORDS[kind]
    if any(any(folder.glob(pattern)) for pattern in _MODEL_FILES):
        return "a model (its config.json or weights)"
    return KIND_WORDS.get(kind)


def write_provenance(folder: Path, record: Provenance) -> None:
    """Write `record` (a record with `files`: `records`) as folder/gqaify.json, listing every file now in the
    folder: call it last."""
    files = sorted(p.name for p in folder.iterdir() if p.name != PROVENANCE_FILE)
    (folder / PROVENANCE_FILE).write_text(record_text(dataclasses.replace(record, files=files)))


def space_problem(out: Path, needed: int, option: str = "OUT") -> str | None:
    """A problem if the filesystem that will hold `out` has fewer than `needed` bytes free."""
    where = _existing_ancestor(out)
    free = shutil.disk_usage(where).free
    if free >= needed:
        return None
    return (
        f"not enough disk space for {out}: it needs {needed:,} bytes and {_filesystem(where)} has {free:,} free; "
        f"free some space or choose another {option}"
    )


# -- staging ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def staged(out: Path, force: bool, size: int = 0, option: str = "OUT", writes: str | None = None) -> Iterator[Path]:
    """A hidden folder beside `out`, renamed to `out` when the block completes and removed if it does not.

    Args:
        out: the folder to create (or, with `force`, to replace; see `replace_problem`).
        size: the bytes the block will write, named in the message if the disk fills up.
        option: how the command line names `out`, for the messages.
        writes: the record kind the block writes (`records.CONVERSION`, `records.REPORT`): what `force` may
            replace.

    Raises:
        UserError: `out` appeared meanwhile (without `force`), or changed so that it may not be replaced.
        ResourceError: the disk filled up; nothing was left behind.
    """
    created = []  # parent folders made here, removed again if the block fails
    for parent in reversed(out.parents):
        if not parent.exists():
            parent.mkdir()
            created.append(parent)
    free = shutil.disk_usage(out.parent).free
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.gqaify-{owner_tag()}-", dir=out.parent))
    except OSError as exc:
        remove_created(created)
        raise UserError(f"cannot write beside {out} ({exc.strerror}); choose another {option}") from exc

    def put_in_place() -> None:
        _apply_umask(staging)
        _swap_into_place(staging, out, force, option, writes)

    def full_disk() -> str:
        return (
            f"no space left on {_filesystem(out.parent)} while writing {out}: it needs {size:,} bytes and "
            f"{free:,} were free when it started (something else is filling the disk?); nothing was left behind"
        )

    try:
        with put_in_place_when_whole(staging, put_in_place, full_disk):
            yield staging
    except BaseException:
        remove_created(created)
        raise


def _swap_into_place(staging: Path, out: Path, force: bool, option: str, writes: str | None) -> None:
    """Rename `staging` to `out`; with `force`, the old `out` is set aside and put back if the rename fails."""
    if force and out.is_dir():
        problem = replace_problem(out, option, writes)  # checked again: it may have changed since the run started
        if problem:
            raise UserError(problem)
        aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.gqaify-old-{owner_tag()}-", dir=out.parent))
        out.rename(aside / out.name)
        try:
            staging.rename(out)
        except BaseException:
            (aside / out.name).rename(out)
            aside.rmdir()
            raise
        shutil.rmtree(aside)
        return
    try:
        staging.rename(out)  # replaces an empty folder; refuses anything else
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise UserError(
                f"{out} already exists: it appeared while this run was writing (another run writing the same "
                f"{option}?) and was not touched; pass --force to replace it, or choose another {option}"
            ) from exc
        raise


def _apply_umask(folder: Path) -> None:
    """Give the output the permissions of a normally created folder (mkdtemp makes it private)."""
    umask = current_umask()
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


# -- helpers ---------------------------------------------------------------------------------------------------


def _existing_ancestor(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _writable_location(path: Path) -> bool:
    """Whether `path` could be created: its nearest existing ancestor is a writable directory."""
    parent = _existing_ancestor(path.parent)
    return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)


def _filesystem(path: Path) -> str:
    """The device holding `path` and where it is mounted, as `df` names them."""
    import psutil

    real = str(path.resolve())
    best = None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip("/") or "/"
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and (
            best is None or len(mount) > len(best.mountpoint)
        ):
            best = part
    return f"{best.device} (mounted at {best.mountpoint})" if best else f"the filesystem of {path}"


def _plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _some(paths: list[Path]) -> str:
    more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
    return f"{paths[0].name}{more}"


@contextlib.contextmanager
def work_folder(out: Path) -> Iterator[Path]:
    """A hidden folder beside `out` for intermediate files, removed when the block ends, and named as a staging
    folder is, so that `leftovers.remove_leftovers(out)` removes it once a killed run's process is gone. The parent
    folders made for it are removed again if the block fails (as `staged` removes its own): a refusal writes
    nothing."""
    created = []
    for parent in reversed(out.parents):
        if not parent.exists():
            parent.mkdir()
            created.append(parent)
    try:
        folder = Path(tempfile.mkdtemp(prefix=f".{out.name}.gqaify-{owner_tag()}-", dir=out.parent))
    except BaseException:
        remove_created(created)
        raise
    try:
        yield folder
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        remove_created(created)
        raise
    shutil.rmtree(folder, ignore_errors=True)
