"""Loading models named on the command line: a local folder, a `.gguf` file, or a hub id; and a checkpoint's weights
read lazily (`open_checkpoint`: what a conversion streams, and `check_weights`: the headers every stage reads of a
local model before it loads any model)."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import struct
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open

from gqaify.auto import AUTO, is_auto
from gqaify.errors import UserError
from gqaify.model.dtypes import torch_dtype
from gqaify.model.locations import locate
from gqaify.records import CORPUS, REPORT, RUN, read_provenance
from gqaify.shipped import SHIPPED_MODULE


def model_location(name: str, option: str = "MODEL") -> tuple[str, dict]:
    """from_pretrained's first argument and keyword arguments for `name` (folder, hub id or .gguf).

    Raises:
        UserError: `name` looks like a path and does not exist (`locations.locate`).
    """
    where = locate(name, option)
    if where.kind == "gguf":
        return str(where.path.parent), {"gguf_file": where.path.name}
    return (str(where.path) if where.kind == "local" else name), {}


@contextlib.contextmanager
def _from_hub_or_cache(name: str, option: str) -> Iterator[None]:
    """Within: a load of `name`. For a hub id, the hub is asked once whether it answers, before anything is
    fetched (`hub.offline_unless_reachable`, as for hub datasets); where it does not, the load reads huggingface_hub's
    cache alone, with no request and no retry, and a model that is not in the cache is refused at once.

    Raises:
        UserError: `name` is a hub id, the hub does not answer, and the model is not in the cache.
    """
    if locate(name, option).kind != "hub":
        yield
        return
    from huggingface_hub import try_to_load_from_cache

    from gqaify.model.hub import offline_unless_reachable

    with offline_unless_reachable() as why:
        if why is not None and not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise UserError(
                f"{option} {name} is not a local path and the Hugging Face hub could not be reached ({why}); "
                "check the network (or HF_ENDPOINT, HF_HUB_OFFLINE), or give a local folder; a model read once "
                "is kept in huggingface_hub's cache"
            )
        yield


def load_config(name: str, option: str = "MODEL", trust_remote_code: bool = False):
    """The transformers config of `name`.

    Raises:
        UserError: it cannot be found or read; it needs gqaify's shipped modeling code and `trust_remote_code`
            is not set.
    """
    from transformers import AutoConfig

    where, kwargs = model_location(name, option)
    try:
        with _from_hub_or_cache(name, option):
            config = AutoConfig.from_pretrained(where, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        said = f"{option} {name} could not be read ({type(exc).__name__}); check the path or hub id"
        raise UserError(not_a_model(name, option) or said) from exc
    shipped = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM", "")
    if shipped.startswith(f"{SHIPPED_MODULE}.") and not trust_remote_code:
        # transformers would load its MHA class, which cannot hold the G-head weights
        raise UserError(untrusted_problem(f"{option} {name} has {config.num_key_value_heads} K/V heads, which"))
    return config


# What a folder gqaify wrote that is no model is, by the kind of its record, and where the model is instead
_NO_MODEL = {
    CORPUS: ("a corpus gqaify generate wrote (text for --data or --calib-data)", "name the model folder or hub id"),
    RUN: ("an uptraining run's output_dir", "name final/ inside it, the model the run saves when it is done"),
    REPORT: ("an evaluation's report folder", "name the model folder or hub id"),
}


def not_a_model(name: str, option: str = "MODEL") -> str | None:
    """What the local folder `name` is where it holds no config.json but the record of something else gqaify wrote
    (a corpus, an uptraining run's output_dir, an evaluation's report): "MODEL x is a corpus gqaify generate wrote
    ..., not a model". None for anything else (no folder, a model, a folder gqaify did not write)."""
    folder = Path(name).expanduser()
    try:
        if not folder.is_dir() or (folder / "config.json").exists():
            return None
    except OSError:  # a name the file system refuses: `locations.lookup_problem` says why
        return None
    header = read_provenance(folder)
    if header is None or header.kind not in _NO_MODEL:
        return None
    what, fix = _NO_MODEL[header.kind]
    return f"{option} {name} is {what}, not a model (it has no config.json); {fix}"


def untrusted_problem(subject: str) -> str:
    """Why a model with gqaify's shipped modeling code is not loaded without trust_remote_code, and the fix."""
    return (
        f"{subject} only the modeling code gqaify ships with it ({SHIPPED_MODULE}.py) implements; pass "
        "--trust-remote-code to run that code"
    )


def load_model(
    name: str,
    dtype: str | torch.dtype = AUTO,
    device: torch.device | str = "cpu",
    option: str = "MODEL",
    trust_remote_code: bool = False,
):
    """(model in eval mode on `device`, tokenizer) of `name`. GGUF weights are dequantized to float32.

    Args:
        trust_remote_code: run the modeling code a model folder carries (gqaify's, for GPT-2, GPT-NeoX and OPT).

    Raises:
        UserError: weights or tokenizer files are missing, the model class is unknown, or the model needs its
            own modeling code and `trust_remote_code` is not set.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = load_config(name, option, trust_remote_code)  # read once, checked, and handed on
    where, kwargs = model_location(name, option)
    chosen = (torch_dtype(dtype) or AUTO) if isinstance(dtype, str) else dtype
    if "gguf_file" in kwargs and is_auto(chosen):
        chosen = torch.float32
    try:
        with _from_hub_or_cache(name, option):
            model = AutoModelForCausalLM.from_pretrained(
                where, config=config, dtype=chosen, trust_remote_code=trust_remote_code, **kwargs
            )
            tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        return model.to(device).eval(), tokenizer
    except (OSError, ValueError) as exc:  # missing weights or tokenizer files, unknown model class
        raise UserError(f"{option} {name} could not be loaded ({type(exc).__name__}: {exc}); check its files") from exc


def load_tokenizer(name: str, option: str = "MODEL"):
    """The tokenizer of `name` (folder, hub id or .gguf), without the model.

    Raises:
        UserError: it has no tokenizer files, or they cannot be read.
    """
    from transformers import AutoTokenizer

    where, kwargs = model_location(name, option)
    try:
        with _from_hub_or_cache(name, option):
            return AutoTokenizer.from_pretrained(where, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        problem = f"{option} {name} has no tokenizer that could be loaded ({type(exc).__name__})"
        raise UserError(f"{problem}; check its files") from exc


def check_weights(name: str, option: str = "MODEL") -> None:
    """Read the headers of a local folder's weights (a hub model's are fetched, and checked, as it loads; a .gguf
    file's header was read by `locate`): a damaged one is found before any model is loaded or anything written.

    Raises:
        UserError: a shard is missing, cut short or damaged.
    """
    where = locate(name, option)
    if where.kind != "local":
        return
    try:
        open_checkpoint(where.path)
    except UserError as exc:
        raise UserError(f"{option} {name}: {exc}") from None


def device_problem(name: str) -> str | None:
    """Why `name` (auto, cpu, cuda, cuda:N) cannot be used here, or None."""
    if not is_auto(name) and not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        return f"unknown --device {name!r}; choose auto, cpu, cuda or cuda:N"
    if name.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {name}, but no CUDA GPU is available; use --device cpu"
    count = torch.cuda.device_count() if name.startswith("cuda:") else 0
    if count and int(name[5:]) >= count:
        return f"--device {name}, but this machine has {count} CUDA GPU(s); choose cuda:0 to cuda:{count - 1}"
    return None


def resolve_device(name: str) -> torch.device:
    """The device `name` stands for (auto: the GPU when there is one); check it with `device_problem` first."""
    if is_auto(name):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# -- a model's weights, read lazily -------------------------------------------------------------------------

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

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
