"""A bounded reader of a GGUF file's header: its metadata, read without trusting a single length it holds.

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64 | metadata: key string, type u32, value ...

Every count and length in the file is checked against the bytes that remain before it is used, so a damaged or
hostile file (an array claiming 2^40 items, a tensor count of 2^62, a file cut short) is refused at once, in
memory bounded by `MAX_VALUE_BYTES`, where gguf's own reader looped, grew without bound or raised a traceback.
Arrays are skipped (their bytes are counted, not read), except that a string array is walked string by string.

The one place that asks "is this a model gqaify can read" (`problem`, for every command's MODEL or SRC: its
architecture and the hyperparameters transformers needs, without which it builds a 7B default) and "did gqaify
write this" (`has_key` and `tensors_sha256`, for --force).
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"GGUF"
MAX_VALUE_BYTES = 16 << 20  # a string value kept (gqaify's record is a few KB); longer ones are skipped
MAX_TENSOR_NAME = 1024  # bytes of a tensor's name (llama.cpp's are at most 64)
MAX_TENSOR_DIMS = 8  # llama.cpp's are at most 4
MAX_TENSORS = 1 << 20  # tensor infos read for a digest (a 405B model has a few thousand tensors)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# what transformers reads to build a model from a GGUF: without them it builds its default (a 7B Llama)
REQUIRED = ("block_count", "embedding_length", "attention.head_count")


class HeaderError(ValueError):
    """The file is not a readable GGUF header (the message says where it broke)."""


@dataclass
class Header:
    version: int
    tensor_count: int
    fields: dict[str, object] = field(default_factory=dict)  # scalars and strings; arrays as None
    lengths: dict[str, int] = field(default_factory=dict)  # each array's items (a vocabulary's tokens)
    tensors_sha256: str | None = None  # of the tensor infos (`tensor_info_bytes`), where read with `tensors=True`


class _Reader:
    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def left(self) -> int:
        return self.size - self.f.tell()

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.left():
            raise HeaderError(f"{what} claims {n:,} bytes where {self.left():,} remain")
        return self.f.read(n)

    def skip(self, n: int, what: str) -> None:
        if n < 0 or n > self.left():
            raise HeaderError(f"{what} claims {n:,} bytes where {self.left():,} remain")
        self.f.seek(n, os.SEEK_CUR)

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, keep: bool = True) -> str | None:
        length = self.scalar("<Q", what)
        if not keep or length > MAX_VALUE_BYTES:
            self.skip(length, what)
            return None
        start = self.f.tell()
        try:  # strictly, as transformers reads it (whose error would call the file "not a valid JSON file")
            return self.take(length, what).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise HeaderError(f"{what} is not UTF-8 text (byte {start + exc.start:,})") from exc

    def value(self, kind: int, key: str):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], key)
        if kind == _STRING:
            return self.string(key)
        raise HeaderError(f"{key} has an unknown value type {kind}")  # an array is `array`'s

    def array(self, key: str) -> int:
        """Skip an array's items (a string array walked string by string): how many it holds."""
        item, count = self.scalar("<I", key), self.scalar("<Q", key)
        if item in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[item]), f"{key} (an array of {count:,})")
        elif item == _STRING:
            if count * 8 > self.left():  # every string has at least its 8-byte length
                raise HeaderError(f"{key} claims {count:,} strings where {self.left():,} bytes remain")
            for _ in range(count):
                self.string(key, keep=False)
        else:
            raise HeaderError(f"{key} is an array of unknown or nested type {item}")
        return count


def tensor_info_bytes(name: str, dims: tuple[int, ...], kind: int, offset: int) -> bytes:
    """One tensor's info as the file holds it: its name, its dimensions (the file's order: the fastest first), its
    type (a ggml type number) and its data's offset. A digest of them all (`tensors_sha256`) tells the tensors a
    file was written with from those of a copy re-quantized, re-typed, re-shaped, renamed or cut."""
    encoded = name.encode("utf-8")
    dims_packed = struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
    return struct.pack("<Q", len(encoded)) + encoded + dims_packed + struct.pack("<IQ", kind, offset)


def read(path: str | os.PathLike, tensors: bool = False) -> Header:
    """The header of the GGUF file `path`: its version, tensor count and metadata (with `tensors`, also the SHA-256
    of its tensor infos, `Header.tensors_sha256`).

    Raises:
        HeaderError: not a GGUF file, or a count or length past the end of the file.
        OSError: the file cannot be read.
    """
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, size)
        if r.take(min(4, size), "the magic") != MAGIC:
            raise HeaderError("it does not begin with GGUF")
        version = r.scalar("<I", "the version")
        if version not in (2, 3):
            raise HeaderError(f"GGUF version {version} is not 2 or 3")
        tensors, entries = r.scalar("<Q", "the tensor count"), r.scalar("<Q", "the metadata count")
        if tensors * 24 > size or entries * 12 > size:  # each tensor's info and each entry takes this much at least
            raise HeaderError(f"it claims {tensors:,} tensors and {entries:,} metadata entries in {size:,} bytes")
        header = Header(version, tensors)
        for _ in range(entries):
            key = r.string("a metadata key") or ""
            kind = r.scalar("<I", key)
            if kind == _ARRAY:
                header.fields[key], header.lengths[key] = None, r.array(key)
            else:
                header.fields[key] = r.value(kind, key)
        if tensors:
            header.tensors_sha256 = _tensors_sha256(r, header.tensor_count)
        return header


def _tensors_sha256(r: _Reader, count: int) -> str:
    if count > MAX_TENSORS:
        raise HeaderError(f"it claims {count:,} tensors")
    digest = hashlib.sha256()
    for i in range(count):
        length = r.scalar("<Q", f"tensor {i}'s name")
        if length > MAX_TENSOR_NAME:
            raise HeaderError(f"tensor {i}'s name claims {length:,} bytes")
        name = r.take(length, f"tensor {i}'s name").decode("utf-8", "replace")
        n_dims = r.scalar("<I", f"tensor {name}")
        if n_dims > MAX_TENSOR_DIMS:
            raise HeaderError(f"tensor {name} claims {n_dims:,} dimensions")
        dims = struct.unpack(f"<{n_dims}Q", r.take(8 * n_dims, f"tensor {name}'s dimensions"))
        kind, offset = struct.unpack("<IQ", r.take(12, f"tensor {name}'s type and offset"))
        digest.update(tensor_info_bytes(name, dims, kind, offset))
    return digest.hexdigest()


def problem(path: Path, option: str) -> str | None:
    """Why the GGUF file `path` is not a model gqaify can read (damaged, or without the hyperparameters
    transformers needs), or None."""
    try:
        header = read(path)
    except HeaderError as exc:
        return f"{option} {path} is not a readable GGUF file ({exc}); check the file"
    except OSError as exc:
        return f"{option} {path} cannot be read ({exc.strerror}); check the file"
    arch = header.fields.get("general.architecture")
    if not isinstance(arch, str):
        return f"{option} {path} names no architecture (general.architecture); it is no model gqaify can read"
    missing = [f"{arch}.{key}" for key in REQUIRED if f"{arch}.{key}" not in header.fields]
    if missing:
        return (
            f"{option} {path} lacks {', '.join(missing)}: without them transformers would build a default model, "
            "not this one; check the file"
        )
    return None


def tensors_sha256(path: Path) -> str | None:
    """The SHA-256 of the GGUF file `path`'s tensor infos (`tensor_info_bytes`), None for a file that is no readable
    GGUF: read in memory bounded as the header is, and in time bounded by the tensor infos, not their data."""
    try:
        return read(path, tensors=True).tensors_sha256
    except (HeaderError, OSError):
        return None


def has_key(path: Path, key: str) -> bool:
    """Whether the GGUF file `path` carries the metadata `key` (False for a file that is no readable GGUF)."""
    try:
        return key in read(path).fields
    except (HeaderError, OSError):
        return False
