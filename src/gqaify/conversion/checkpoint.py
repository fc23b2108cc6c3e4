"""Checkpoint I/O: read tensors lazily, write safetensors shards as a stream.

Every source exposes each tensor's shape and dtype before any data is read, so the whole output is
planned up front: names, shapes, shard boundaries, and so every shard's header. The writer then writes
each shard's header first and appends tensors in planned order as they arrive:

    a tensor that passes through unchanged  is copied byte range to byte range inside the kernel
                                            (os.copy_file_range): it never enters this process's memory
    a converted (or cast) tensor            is written from memory

so memory holds one layer's K/V at a time, whatever the model size, and the conversion runs at about the
speed of copying the files. (safetensors' own `save_file` needs a whole shard in memory.) The file format,
from the safetensors spec: an 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}} padded with spaces to a
multiple of 8, then the tensors' bytes, contiguous, offsets relative to the end of the header.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import struct
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import SafetensorError, safe_open

from gqaify.errors import UserError

LOG = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
OUTPUT_PATTERN = "model{suffix}.safetensors"  # the names save_pretrained writes

# safetensors' dtype codes (the header's "dtype" field)
DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True)
class ByteRange:
    """Where a tensor's raw bytes sit in a file."""

    path: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SourceTensor:
    name: str
    meta: TensorMeta
    load: Callable[[], torch.Tensor]
    file: Path | None = None  # the file it is read from; None when already in memory
    bytes: ByteRange | None = None  # set where the raw bytes can be copied without loading


class TensorSource(Protocol):
    """Tensors of a checkpoint: their metadata up front, then the tensors in the same order, or some by name."""

    files: list[Path]  # the files the tensors come from (for provenance)

    def metadata(self) -> dict[str, TensorMeta]: ...

    def iter_tensors(self) -> Iterator[SourceTensor]: ...

    def load(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        """The tensors called `names`, each in memory of its own (calibration reads one layer at a time)."""
        ...


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset where its data starts.

    Raises:
        UserError: the file is not a complete safetensors file (also checked by `safe_open`).
    """
    try:
        with safe_open(path, framework="pt"):
            pass  # validates the header and that the data fits in the file
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (SafetensorError, OSError, ValueError, struct.error) as exc:
        raise UserError(f"corrupt shard {path}: {exc}; re-download or re-save the checkpoint") from exc
    header.pop("__metadata__", None)
    return header, 8 + length


class SafetensorsSource:
    """Safetensors shards: tensors in file offset order, each loadable through `safe_open` or copyable as bytes."""

    def __init__(self, files: list[Path]):
        self.files = files
        self._tensors: list[tuple[str, TensorMeta, ByteRange]] = []
        for path in files:
            header, start = read_safetensors_header(path)
            for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
                begin, end = info["data_offsets"]
                meta = TensorMeta(tuple(info["shape"]), _DTYPES[info["dtype"]])
                self._tensors.append((name, meta, ByteRange(path, start + begin, end - begin)))

    def metadata(self) -> dict[str, TensorMeta]:
        return {name: meta for name, meta, _ in self._tensors}

    def iter_tensors(self) -> Iterator[SourceTensor]:
        for name, meta, where in self._tensors:
            load = functools.partial(_load_safetensor, where.path, name)
            yield SourceTensor(name, meta, load, where.path, where)

    def load(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        wanted = set(names)
        by_file: dict[Path, list[str]] = {}
        for name, _, where in self._tensors:
            if name in wanted:
                by_file.setdefault(where.path, []).append(name)
        out = {}
        for path, in_file in by_file.items():  # each file opened once, its tensors copied out, then closed
            with safe_open(path, framework="pt") as f:
                out.update({name: f.get_tensor(name).clone() for name in in_file})
        return out


def _load_safetensor(path: Path, name: str) -> torch.Tensor:
    """One tensor in memory of its own: `safe_open` maps the whole file, and pages read through the mapping
    stay resident until it closes, so the tensor is copied out and the file closed at once."""
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(name).clone()


class TorchBinSource:
    """Pickled PyTorch shards, loaded with `weights_only=True` (no code runs) and memory-mapped."""

    def __init__(self, files: list[Path]):
        self.files = files
        self._order: list[tuple[Path, list[str]]] = []
        self._meta: dict[str, TensorMeta] = {}
        for path in files:
            state = self._load(path)
            self._meta.update({n: TensorMeta(tuple(t.shape), t.dtype) for n, t in state.items()})
            self._order.append((path, list(state)))

    @staticmethod
    def _load(path: Path) -> dict[str, torch.Tensor]:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError... for bad files
            raise UserError(f"corrupt or unsafe shard {path}: {exc}; re-download the checkpoint") from exc
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise UserError(f"{path} is not a state dict of tensors; point SRC at a Hugging Face model folder")
        return state

    def metadata(self) -> dict[str, TensorMeta]:
        return self._meta

    def iter_tensors(self) -> Iterator[SourceTensor]:
        for path, names in self._order:
            state = self._load(path)
            for name in names:
                yield SourceTensor(name, self._meta[name], functools.partial(state.__getitem__, name), path)

    def load(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        wanted, out = set(names), {}
        for path, in_file in self._order:
            if wanted.intersection(in_file):
                state = self._load(path)  # memory-mapped: only the tensors copied here are read
                out.update({name: state[name].clone() for name in in_file if name in wanted})
        return out


class StateDictSource:
    """Tensors already in memory (a dequantized GGUF). A tensor that is the same view as an earlier one (tied
    weights: lm_head.weight is embed_tokens.weight) is kept once, under its first name, as save_pretrained does."""

    def __init__(self, state_dict: dict[str, torch.Tensor], files: list[Path]):
        self.files = files
        seen: set[tuple] = set()
        self._tensors: dict[str, torch.Tensor] = {}
        for name, t in state_dict.items():
            view = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if view not in seen:
                seen.add(view)
                self._tensors[name] = t

    def metadata(self) -> dict[str, TensorMeta]:
        return {n: TensorMeta(tuple(t.shape), t.dtype) for n, t in self._tensors.items()}

    def iter_tensors(self) -> Iterator[SourceTensor]:
        for name, t in self._tensors.items():
            yield SourceTensor(name, TensorMeta(tuple(t.shape), t.dtype), functools.partial(torch.Tensor.detach, t))

    def load(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        return {name: self._tensors[name].detach() for name in names if name in self._tensors}


def open_checkpoint(directory: Path) -> TensorSource:
    """The tensors of the Hugging Face checkpoint in `directory` (safetensors preferred over .bin).

    Raises:
        UserError: no weights, a shard named by the index is missing, or a shard is corrupt.
    """
    for index_name, single_name, source in (
        (SAFETENSORS_INDEX, SAFETENSORS_SINGLE, SafetensorsSource),
        (BIN_INDEX, BIN_SINGLE, TorchBinSource),
    ):
        index = directory / index_name
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise UserError(f"corrupt index {index}: {exc}; re-download the checkpoint") from exc
            files = [directory / name for name in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise UserError(
                    f"shard {missing[0]} named in {index_name} is missing from {directory} "
                    f"({len(missing)} missing); re-download the checkpoint"
                )
            tensors = source(files)
            absent = sorted(set(weight_map) - set(tensors.metadata()))
            if absent:
                raise UserError(
                    f"tensor {absent[0]!r} is in {index_name} but not in {weight_map[absent[0]]}; "
                    "the shard is corrupt or from another model, re-download the checkpoint"
                )
            return tensors
        if (directory / single_name).is_file():
            return source([directory / single_name])
    raise UserError(
        f"{directory} has no {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, {BIN_SINGLE} or {BIN_INDEX}; "
        "point SRC at a Hugging Face model folder, a hub id, or a .gguf file"
    )


class ShardWriter:
    """Writes the planned safetensors shards as a stream: each shard's header first, then its tensors in order.

    The plan is `huggingface_hub`'s (what `save_pretrained` uses): tensors in the given order, a new shard
    when the next tensor would pass `max_shard_size`, a tensor larger than that alone in its own shard.
    Tensors must arrive in plan order; a shard's file is closed as soon as its last tensor is in.
    """

    def __init__(self, directory: Path, plan: dict[str, TensorMeta], max_shard_size: int):
        self.directory = directory
        self.plan = plan
        self.split = split_state_dict_into_shards_factory(
            plan,
            get_storage_size=lambda meta: meta.nbytes,
            filename_pattern=OUTPUT_PATTERN,
            max_shard_size=max_shard_size,
        )
        self._remaining = {f: list(names) for f, names in self.split.filename_to_tensors.items()}
        self._open: dict[str, object] = {}  # filename -> unbuffered file, while the shard is being written
        self._sources: dict[Path, object] = {}
        self.bytes_written = 0

    @property
    def num_shards(self) -> int:
        return len(self.split.filename_to_tensors)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append a tensor from memory."""
        meta = self.plan[name]
        if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
            raise RuntimeError(f"{name}: planned {meta}, got {tuple(tensor.shape)} {tensor.dtype}")
        f = self._next(name)
        if meta.nbytes:
            # (numel,) bytes, no copy for a contiguous tensor
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._done(name)

    def copy(self, name: str, source: ByteRange) -> None:
        """Append a tensor by copying its raw bytes from a source file, inside the kernel where it can."""
        if source.nbytes != self.plan[name].nbytes:
            raise RuntimeError(f"{name}: planned {self.plan[name].nbytes} bytes, source has {source.nbytes}")
        f = self._next(name)
        src = self._sources.get(source.path)
        if src is None:  # one source file open at a time: sources are read in order
            for old in self._sources.values():
                old.close()
            src = open(source.path, "rb", buffering=0)  # noqa: SIM115 (closed by close())
            self._sources = {source.path: src}
        copy_range(src.fileno(), f.fileno(), source.offset, source.nbytes)
        self._done(name)

    def _next(self, name: str):
        filename = self.split.tensor_to_filename[name]
        if self._remaining[filename][0] != name:
            raise RuntimeError(f"{name} arrived out of plan order; {self._remaining[filename][0]} was due")
        f = self._open.get(filename)
        if f is None:
            f = self._open[filename] = open(self.directory / filename, "xb", buffering=0)  # noqa: SIM115
            f.write(self._header(filename))
        return f

    def _done(self, name: str) -> None:
        filename = self.split.tensor_to_filename[name]
        self._remaining[filename].pop(0)
        self.bytes_written += self.plan[name].nbytes
        if not self._remaining[filename]:
            self._open.pop(filename).close()

    def _header(self, filename: str) -> bytes:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in self.split.filename_to_tensors[filename]:
            meta = self.plan[name]
            header[name] = {
                "dtype": DTYPE_CODES[meta.dtype],
                "shape": list(meta.shape),
                "data_offsets": [offset, offset + meta.nbytes],
            }
            offset += meta.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        return struct.pack("<Q", len(encoded)) + encoded

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        for f in [*self._open.values(), *self._sources.values()]:
            f.close()
        self._open, self._sources = {}, {}

    def close(self) -> None:
        """Check every planned tensor was written; write the index when there are several shards."""
        self.__exit__(None, None, None)
        unfinished = sorted(f for f, names in self._remaining.items() if names)
        if unfinished:
            raise RuntimeError(f"shards never completed: {unfinished}")
        if self.split.is_sharded:
            index = {"metadata": self.split.metadata, "weight_map": self.split.tensor_to_filename}
            (self.directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def copy_range(src_fd: int, dst_fd: int, offset: int, nbytes: int) -> None:
    """Copy `nbytes` from `src_fd` at `offset` to the current position of `dst_fd`.

    `os.copy_file_range` copies inside the kernel (and shares blocks on filesystems that can); where it is
    refused (older kernels, some cross-filesystem copies) `os.sendfile`, then plain reads and writes.
    """
    end = offset + nbytes
    for copy in (_copy_file_range, _sendfile, _read_write):
        try:
            while offset < end:
                done = copy(src_fd, dst_fd, offset, end - offset)
                if done == 0:
                    raise OSError(errno.EIO, f"unexpected end of file at byte {offset}")
                offset += done
            return
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTSUP):
                raise
    raise OSError(errno.EIO, "no way to copy the byte range")  # unreachable: _read_write always works


def _copy_file_range(src_fd: int, dst_fd: int, offset: int, count: int) -> int:
    return os.copy_file_range(src_fd, dst_fd, min(count, 1 << 30), offset)


def _sendfile(src_fd: int, dst_fd: int, offset: int, count: int) -> int:
    return os.sendfile(dst_fd, src_fd, offset, min(count, 1 << 30))


def _read_write(src_fd: int, dst_fd: int, offset: int, count: int) -> int:
    return os.write(dst_fd, os.pread(src_fd, min(count, 1 << 24), offset))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read into one reused 1 MiB buffer (hashlib releases the GIL while hashing)."""
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(buffer[:n])
    return digest.hexdigest()


def nonfinite_problem(tensors: dict[str, torch.Tensor], fix: str) -> str | None:
    """The first floating-point tensor holding NaN or Inf, named with how many it holds and `fix`; None if every one
    is finite."""
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            return f"tensor {name!r} holds {bad:,} NaN or Inf values: the checkpoint is damaged (re-download it); {fix}"
    return None
