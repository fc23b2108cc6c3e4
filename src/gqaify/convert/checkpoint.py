"""Checkpoint I/O: read tensors lazily, one source file at a time; write size-capped safetensors shards.

Readers expose every tensor's shape and dtype before any data is read, so the whole output (names,
shapes, shard boundaries) is planned up front; the data then streams through in source order and each
output shard is saved as soon as its last tensor arrives. Memory holds at most the shard being filled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from gqaify.errors import UserError

LOG = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
OUTPUT_PATTERN = "model{suffix}.safetensors"  # the names save_pretrained writes

# safetensors' dtype codes (the header's "dtype" field)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


class TensorSource(Protocol):
    """Tensors of a checkpoint: their metadata up front, their data streamed in the same order."""

    files: list[Path]  # the files the tensors come from (for provenance)

    def metadata(self) -> dict[str, TensorMeta]: ...

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class SafetensorsSource:
    """Safetensors shards, read with `safe_open`: one file open at a time, tensors in file offset order."""

    def __init__(self, files: list[Path]):
        self.files = files
        self._order: list[tuple[Path, list[str]]] = []
        self._meta: dict[str, TensorMeta] = {}
        for path in files:
            try:
                with safe_open(path, framework="pt") as f:
                    names = list(f.offset_keys())
                    for name in names:
                        info = f.get_slice(name)
                        self._meta[name] = TensorMeta(tuple(info.get_shape()), _SAFETENSORS_DTYPES[info.get_dtype()])
            except (SafetensorError, OSError) as exc:
                raise UserError(f"corrupt shard {path}: {exc}; re-download or re-save the checkpoint") from exc
            self._order.append((path, names))

    def metadata(self) -> dict[str, TensorMeta]:
        return self._meta

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path, names in self._order:
            try:
                with safe_open(path, framework="pt") as f:
                    for name in names:
                        yield name, f.get_tensor(name)
            except SafetensorError as exc:
                raise UserError(f"corrupt shard {path}: {exc}; re-download or re-save the checkpoint") from exc


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

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path, names in self._order:
            state = self._load(path)
            for name in names:
                yield name, state[name]


class StateDictSource:
    """Tensors already in memory (a dequantized GGUF). Tensors sharing storage (tied weights) are kept once."""

    def __init__(self, state_dict: dict[str, torch.Tensor], files: list[Path]):
        self.files = files
        seen: set[int] = set()
        self._tensors: dict[str, torch.Tensor] = {}
        for name, t in state_dict.items():
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                self._tensors[name] = t

    def metadata(self) -> dict[str, TensorMeta]:
        return {n: TensorMeta(tuple(t.shape), t.dtype) for n, t in self._tensors.items()}

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._tensors.items()


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


def weight_files(directory: Path) -> set[str]:
    """Names of the files in `directory` that hold weights or index them (not carried over as side files)."""
    names = {SAFETENSORS_INDEX, SAFETENSORS_SINGLE, BIN_INDEX, BIN_SINGLE}
    for index in (SAFETENSORS_INDEX, BIN_INDEX):
        if (directory / index).is_file():
            with contextlib.suppress(ValueError, KeyError):  # open_checkpoint reports a corrupt index
                names.update(json.loads((directory / index).read_text())["weight_map"].values())
    return names


class ShardWriter:
    """Saves tensors into the safetensors shards planned for them, each shard once it is complete.

    The plan is `huggingface_hub`'s (what `save_pretrained` does): tensors in the given order, a new shard
    when the next tensor would pass `max_shard_size`, a tensor larger than that alone in its own shard.
    """

    def __init__(self, directory: Path, plan: dict[str, TensorMeta], max_shard_size: int):
        self.directory = directory
        self.plan = plan
        self.split = split_state_dict_into_shards_factory(
            plan, get_storage_size=lambda meta: meta.nbytes, filename_pattern=OUTPUT_PATTERN,
            max_shard_size=max_shard_size,
        )  # fmt: skip
        self._pending: dict[str, dict[str, torch.Tensor]] = {f: {} for f in self.split.filename_to_tensors}
        self.bytes_written = 0

    @property
    def num_shards(self) -> int:
        return len(self.split.filename_to_tensors)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        meta = self.plan[name]
        if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
            raise RuntimeError(f"{name}: planned {meta}, got {tuple(tensor.shape)} {tensor.dtype}")
        filename = self.split.tensor_to_filename[name]
        shard = self._pending[filename]
        shard[name] = tensor.contiguous()
        if len(shard) == len(self.split.filename_to_tensors[filename]):
            save_file(shard, self.directory / filename, metadata={"format": "pt"})
            self.bytes_written += sum(t.nbytes for t in shard.values())
            del self._pending[filename]

    def close(self) -> None:
        """Check every planned tensor was written; write the index when there are several shards."""
        if self._pending:
            raise RuntimeError(f"shards never completed: {sorted(self._pending)}")
        if self.split.is_sharded:
            index = {"metadata": self.split.metadata, "weight_map": self.split.tensor_to_filename}
            (self.directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    """Hex SHA-256 of a file, read in 16 MiB chunks (hashlib releases the GIL, so threads overlap I/O)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def is_writable_location(path: Path) -> bool:
    """Whether `path` could be created: its nearest existing ancestor is a writable directory."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)
