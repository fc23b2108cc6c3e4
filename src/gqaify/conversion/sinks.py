"""Where a conversion goes: a safetensors folder, or one GGUF file. The conversion writes a folder either way; a
sink says where that folder is made, what it must check first, and how the folder becomes OUT.

    FolderSink   the folder is staged beside OUT and renamed to OUT when whole (`gqaify.output.destination.staged`)
    GgufSink     the folder is made in a work folder beside OUT, written from there as one GGUF file, which is
                 renamed into place when whole (`gqaify.output.whole.file_into_place`); the work folder is removed

Both refuse a rival run's or a user's file rather than write over it, and leave nothing behind when stopped.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import gqaify.conversion.to_gguf as to_gguf
from gqaify.conversion.checkpoint import ShardWriter, sha256_file
from gqaify.conversion.record import ConversionRecord
from gqaify.conversion.registry import STREAM_SHAPE
from gqaify.conversion.settings import ConvertSettings
from gqaify.conversion.shapes import shape
from gqaify.conversion.source import Source
from gqaify.errors import Found, ResourceError
from gqaify.model import gguf_header
from gqaify.output.destination import current_umask, name_problem, resolve_out, staged, work_folder, write_provenance
from gqaify.output.whole import file_into_place
from gqaify.records import CONVERSION, as_json, read_record


@dataclass(frozen=True)
class Written:
    """What a sink put at OUT."""

    out: Path
    num_shards: int
    bytes_written: int


@dataclass(frozen=True)
class FolderSink:
    """A safetensors folder at `out` (config, shards, tokenizer, model card, gqaify.json)."""

    out: Path
    force: bool

    def checked(self, s: ConvertSettings) -> ConvertSettings:
        """The settings the request's checks read (`checks.check_request`): OUT is the folder itself."""
        return s

    def said(self, problems: list[str]) -> list[str]:
        """The request's problems as the user is told them: as they are (OUT is what was checked)."""
        return problems

    def problems(self, s: ConvertSettings) -> Found:
        if s.gguf_type is not None:
            return (
                f"--gguf-type {s.gguf_type} is the type of a GGUF file's matrices; name OUT with .gguf to write "
                "one, or drop --gguf-type"
            )
        return None

    def source_problems(self, source: Source) -> Found:
        return None

    def recorded(self, s: ConvertSettings) -> ConvertSettings:
        return s

    @contextlib.contextmanager
    def folder(self, size: int) -> Iterator[Path]:
        """The folder to write the conversion into, renamed to OUT when the block completes."""
        with staged(self.out, self.force, size, writes=CONVERSION) as staging:
            yield staging

    def finish(self, folder: Path, record: ConversionRecord, writer: ShardWriter, source: Source) -> Written:
        """Record the conversion in the folder, last (its file list names every other file)."""
        write_provenance(folder, record)
        return Written(self.out, writer.num_shards, writer.bytes_written)


@dataclass(frozen=True)
class GgufSink:
    """One GGUF file at `out`, its matrices of `gguf_type`, the conversion's record inside it (`to_gguf.RECORD_KEY`)."""

    out: Path
    force: bool
    gguf_type: str
    src: Path | None  # the source, if it is a local path

    @classmethod
    def of(cls, s: ConvertSettings) -> GgufSink:
        src = Path(s.src).expanduser() if s.src and s.src.strip() else None
        return cls(resolve_out(s.out), s.force, s.gguf_type or "f16", src)

    def checked(self, s: ConvertSettings) -> ConvertSettings:
        """The settings the request's checks read: the folder checks look at the work folder's place beside OUT
        (inside the source, unwritable, ...)."""
        return replace(s, out=str(self._stand_in))  # OUT's own: `problems`

    @property
    def _stand_in(self) -> Path:
        return self.out.with_name(f".{self.out.name[:64]}.gqaify-work")

    def said(self, problems: list[str]) -> list[str]:
        """The request's problems as the user is told them: naming OUT, not the work folder checked in its place
        (the user never named that folder; its place beside OUT is what is wrong)."""
        names = {str(self._stand_in): str(self.out), str(self._stand_in.resolve()): str(self.out.resolve())}
        said = []
        for problem in problems:
            for stand_in, out in names.items():
                problem = problem.replace(stand_in, out)
            said.append(problem)
        return said

    def problems(self, s: ConvertSettings) -> Found:
        if problem := name_problem(self.out):  # first: the file system refuses even to look up a name that long
            return problem
        if self.src is not None and _same_file(self.src, self.out):  # not "pass --force": it would be refused
            return f"OUT {self.out} is the source; name another file to write"
        # a new OUT's folder (writable, not inside the source, ...) is checked by the request's checks (`checked`)
        present = self.out.exists() or self.out.is_symlink()
        problems = [to_gguf.destination_problem(self.out, self.force) if present else None]
        problems.append(to_gguf.type_problem(s.gguf_type))
        if s.push_to_hub is not None:
            problems.append(
                "--push-to-hub uploads a converted folder; upload a .gguf file with "
                f"`huggingface-cli upload {s.push_to_hub} {self.out}`"
            )
        return problems

    def source_problems(self, source: Source) -> Found:
        """What GGUF cannot carry here: the architecture, the rotary scaling, the vocabulary (unless a GGUF file's
        tokenizer is copied, `tokenizer_gguf`)."""
        copied = tokenizer_gguf(source) is not None
        vocabulary = None if copied else to_gguf.vocabulary_problem(source.directory)
        return [to_gguf.gguf_problem(source.config), vocabulary]

    def recorded(self, s: ConvertSettings) -> ConvertSettings:
        """The settings as the record says them: with the type written (so a rerun writes it again)."""
        return replace(s, gguf_type=self.gguf_type)

    @contextlib.contextmanager
    def folder(self, size: int) -> Iterator[Path]:
        """A folder in this run's own work folder beside OUT (a rival run, or a file of the user's, is never written
        over), removed with it when the block ends."""
        with work_folder(self.out) as work, staged(work / "model", False, size) as staging:
            yield staging

    def finish(self, folder: Path, record: ConversionRecord, writer: ShardWriter, source: Source) -> Written:
        """Write the folder as the GGUF file, with `record` inside it, and put it in place whole (a GGUF source's
        tokenizer is copied from it as it is)."""
        partial = folder.parent / self.out.name
        try:
            writes = shape(record.settings.get("attention", STREAM_SHAPE)).write_gguf
            writes(folder, partial, self.gguf_type, tokenizer_gguf(source), json.dumps(as_json(record), indent=2))
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise ResourceError(f"no space left while writing {self.out}; nothing was left behind") from exc
            raise
        partial.chmod(0o666 & ~current_umask())
        replaceable = (lambda: to_gguf.destination_problem(self.out, True)) if self.force else None
        file_into_place(partial, self.out, replaceable)
        return Written(self.out, 1, self.out.stat().st_size)


def tokenizer_gguf(source: Source) -> Path | None:
    """The GGUF file whose tokenizer a GGUF output copies as it is there: the source, when it is one, or the GGUF file
    a folder gqaify wrote was converted from (an uptrained final/ of a GGUF), as its record names it, where that file
    is still there unchanged (its SHA-256 as recorded) and holds the folder's vocabulary. A byte-level BPE vocabulary
    (SmolLM2's, Llama 3's) reaches llama.cpp only so: written anew, it needs a pre-tokenizer only llama.cpp's own
    converter knows. None: the folder's tokenizer is written (`to_gguf.add_tokenizer`)."""
    if source.kind == "gguf":
        return Path(source.name).expanduser()
    try:
        origin = getattr(read_record(source.directory), "source", None)
    except (ValueError, OSError):  # no record, or one this gqaify cannot read: the folder's tokenizer
        return None
    if origin is None or origin.kind != "gguf":
        return None
    path = Path(origin.name)
    try:
        found = os.stat(path)
        same = _holds(str(path), found.st_size, found.st_mtime_ns, source.config.get("vocab_size"))
    except (OSError, gguf_header.HeaderError):  # gone, unreadable or no GGUF since it was recorded
        return None
    return path if same == origin.sha256 else None


@functools.lru_cache(maxsize=8)
def _holds(path: str, size: int, mtime_ns: int, vocab_size: int | None) -> dict[str, str] | None:
    """The SHA-256 of the GGUF file `path` by its name, as a conversion's record keeps it, where its tokenizer holds
    `vocab_size` tokens (None: another vocabulary). Asked when the source is checked and again when the file is
    written: hashed once while the file is as it was (its size and modification time the key)."""
    if gguf_header.read(path).lengths.get("tokenizer.ggml.tokens") != vocab_size:
        return None
    return {Path(path).name: sha256_file(Path(path))}


def sink_for(s: ConvertSettings) -> FolderSink | GgufSink:
    """The sink OUT names: a GGUF file when it ends in .gguf, else a folder."""
    if to_gguf.is_gguf_out(s.out):
        return GgufSink.of(s)
    return FolderSink(resolve_out(s.out) if s.out and s.out.strip() else Path(), s.force)


def _same_file(src: Path, out: Path) -> bool:
    """Whether writing `out` would replace the file `src`: one path, or one file through a symbolic link (of the
    file or of a folder above it) or a hard link."""
    if not src.exists():
        return False
    return src.resolve() == out.resolve() or (out.exists() and os.path.samefile(src, out))
