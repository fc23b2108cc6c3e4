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
import hashlib
import json
import logging
import os
import struct
from pathlib import Path

import torch
from huggingface_hub import split_state_dict_into_shards_factory

# The readers live in gqaify.model.loading, below every stage (eval and uptrain check a model's weights with them before
# loading it); imported here for the writer and for the conversion's modules
from gqaify.model.loading import (  # noqa: F401 (re-exported)
    BIN_INDEX,
    BIN_SINGLE,
    DTYPE_CODES,
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    ByteRange,
    SafetensorsSource,
    SourceTensor,
    StateDictSource,
    TensorMeta,
    TensorSource,
    TorchBinSource,
    open_checkpoint,
    read_safetensors_header,
)

LOG = logging.getLogger(__name__)

OUTPUT_PATTERN = "model{suffix}.safetensors"  # the names save_pretrained writes


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
