"""Turn what the user names as a model (local folder, hub id, `.gguf` file) into a checkpoint to read.

Opening a source is cheap: it gives `config.json` (as a dict) and a folder of side files (tokenizer, generation
config, chat template, licence), so that every problem with the request can be found before any weight is
read. The tensors come on first use of `Source.tensors`:

    local folder   safetensors (or .bin) shards read lazily where they are
    hub id         config and side files first (`snapshot_download` with the side-file patterns), then exactly
                   the weight files the index names (or the single weights file): never other weight files
                   of the repository, such as Mistral's `consolidated.safetensors`
    .gguf file     the config from the file's metadata; the weights dequantized by transformers' GGUF support
                   and served from memory, the tokenizer and generation config exported beside the config
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gqaify.conversion.checkpoint import (
    BIN_INDEX,
    BIN_SINGLE,
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    StateDictSource,
    TensorSource,
    open_checkpoint,
)
from gqaify.errors import UserError
from gqaify.model.locations import Location, locate

LOG = logging.getLogger(__name__)

# The files of a checkpoint that are not weights and that a converted copy keeps (fetched from the hub too).
SIDE_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*", "LICENSE*", "NOTICE*", "USE_POLICY*"]
# ... except these: weight indices (the output has its own), and what gqaify writes itself.
_NOT_SIDE_FILES = {SAFETENSORS_INDEX, BIN_INDEX, "config.json", "README.md", "gqaify.json"}


@dataclass
class Source:
    name: str  # what the user passed
    kind: str  # "local", "hub" or "gguf"
    directory: Path  # config.json and side files
    config: dict  # config.json
    revision: str | None = None  # hub commit
    provenance: dict = field(default_factory=dict)
    _open_tensors: object = None  # () -> TensorSource, called on first use of `tensors`
    _tensors: TensorSource | None = None

    @property
    def recorded_name(self) -> str:
        """The source as records name it: a hub id as given; a folder or .gguf file by its absolute path with links
        resolved, the same however the user reached it (a relative path, a link), so that a rerun from the record
        writes the same record, byte for byte."""
        return self.name if self.kind == "hub" else str(Path(self.name).expanduser().resolve())

    @property
    def tensors(self) -> TensorSource:
        """The checkpoint's tensors, fetched or dequantized on first use.

        Raises:
            UserError: weights missing, corrupt, or not fetchable.
        """
        if self._tensors is None:
            self._tensors = self._open_tensors()
        return self._tensors

    def side_files(self) -> list[Path]:
        """The files of `directory` that a converted checkpoint carries over unchanged."""
        return [
            path
            for path in sorted(self.directory.iterdir())
            if path.is_file()
            and path.name not in _NOT_SIDE_FILES
            and any(fnmatch.fnmatch(path.name, pattern) for pattern in SIDE_FILES)
        ]

    def load_tokenizer(self):
        """The source's tokenizer (for calibration text).

        Raises:
            UserError: the folder has no tokenizer.
        """
        from transformers import AutoTokenizer

        self.tensors  # noqa: B018 (a GGUF exports its tokenizer when its weights are read)
        try:
            return AutoTokenizer.from_pretrained(self.directory)
        except (OSError, ValueError) as exc:
            raise UserError(
                f"calibration needs the tokenizer of {self.name}, which could not be loaded ({type(exc).__name__}); "
                "add the tokenizer files to SRC, or convert without --calib-data"
            ) from exc


@contextlib.contextmanager
def open_source(src: str | Path | Location, revision: str | None = None) -> Iterator[Source]:
    """Resolve `src` (a name, or where `locate` found it) to its config and side files; temporary files (GGUF
    export) live as long as the context.

    Raises:
        UserError: `src` does not exist, is not a model, or cannot be fetched.
    """
    where = src if isinstance(src, Location) else locate(src, "SRC")
    src = where.name
    if where.kind != "hub" and revision is not None:
        raise UserError(f"--revision applies to hub ids, but {src} is a local path; drop --revision")
    if where.kind == "gguf":
        with _open_gguf(where.path) as source:
            yield source
    elif where.kind == "local":
        path = where.path
        if not (path / "config.json").is_file():
            raise UserError(f"{src} has no config.json; point SRC at a Hugging Face model folder")
        directory = path.resolve()
        yield Source(str(src), "local", directory, read_config(directory), _open_tensors=lambda: open_checkpoint(path))
    else:
        yield _open_hub(str(src), revision)


def read_config(directory: Path) -> dict:
    """config.json of `directory` as a dict.

    Raises:
        UserError: it is missing, not JSON, or not a JSON object.
    """
    try:
        config = json.loads((directory / "config.json").read_text())
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot read {directory / 'config.json'} ({exc}); check the file") from exc
    if not isinstance(config, dict):
        raise UserError(f"{directory / 'config.json'} is not a JSON object; check the file")
    return config


def _open_hub(repo_id: str, revision: str | None) -> Source:
    LOG.info("fetching the config and side files of %s from the Hugging Face hub", repo_id)
    directory = _snapshot(repo_id, revision, [*SIDE_FILES, "README.md"])  # the card: its licence goes on ours
    if not (directory / "config.json").is_file():
        raise UserError(f"{repo_id} has no config.json; gqaify converts transformers checkpoints")
    commit = directory.name if re.fullmatch(r"[0-9a-f]{40}", directory.name) else revision

    def fetch_weights() -> TensorSource:
        LOG.info("fetching the weights of %s", repo_id)
        for index, single in ((SAFETENSORS_INDEX, SAFETENSORS_SINGLE), (BIN_INDEX, BIN_SINGLE)):
            if (directory / index).is_file():
                _snapshot(repo_id, commit, sorted(_index_files(directory / index)))
                return open_checkpoint(directory)
            if (_snapshot(repo_id, commit, [single]) / single).is_file():
                return open_checkpoint(directory)
        raise UserError(
            f"{repo_id} has none of {SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE}, {BIN_INDEX}, {BIN_SINGLE}; "
            "gqaify converts transformers checkpoints"
        )

    return Source(repo_id, "hub", directory, read_config(directory), revision=commit, _open_tensors=fetch_weights)


def _index_files(index: Path) -> set[str]:
    try:
        return set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, AttributeError) as exc:
        raise UserError(f"corrupt index {index.name} in the hub repository: {exc}") from exc


def _snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except GatedRepoError as exc:
        raise UserError(f"{repo_id} is gated; accept its licence on the hub and log in (hf auth login)") from exc
    except RevisionNotFoundError as exc:
        raise UserError(f"revision {revision!r} not found in {repo_id}; check --revision") from exc
    except RepositoryNotFoundError as exc:
        raise UserError(
            f"SRC not found: {repo_id} is neither a local path nor a model on the Hugging Face hub; "
            "check the name (private repos need hf auth login)"
        ) from exc
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise UserError(
            f"SRC {repo_id} is not a local path, and fetching it from the Hugging Face hub failed "
            f"({type(exc).__name__}); check the path, or the network for a hub id"
        ) from exc


@contextlib.contextmanager
def _open_gguf(path: Path) -> Iterator[Source]:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, OSError, KeyError, NotImplementedError) as exc:
        raise UserError(_unreadable_gguf(path, exc)) from exc
    with tempfile.TemporaryDirectory(prefix="gqaify-gguf-") as staging:
        directory = Path(staging)
        source = Source(
            str(path), "gguf", directory, _export_config(config, directory), provenance={"gguf_file": path.name}
        )
        source._open_tensors = lambda: _dequantize(source, path)
        yield source


def _unreadable_gguf(path: Path, exc: BaseException) -> str:
    """The one line for a GGUF file transformers could not read (its header passed `gguf_header.problem`)."""
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "valid JSON file" in said:  # transformers' words for any text in the file that is not UTF-8
        said = "text in it that is not UTF-8"
    return f"SRC {path} is not a GGUF file gqaify can read ({said}); check the file or use the HF checkpoint"


def _export_config(config, directory: Path) -> dict:
    """Save a GGUF's config as a plain checkpoint's (the weights leave dequantized, without quantization_config)."""
    config.save_pretrained(directory)
    path = directory / "config.json"
    exported = json.loads(path.read_text())
    exported.pop("quantization_config", None)
    path.write_text(json.dumps(exported, indent=2, sort_keys=True) + "\n")
    return exported


def _dequantize(source: Source, path: Path) -> TensorSource:
    """Dequantize the GGUF's weights (float32, in memory); export its tokenizer and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    LOG.info("dequantizing %s with transformers' GGUF support", path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, OSError, KeyError, NotImplementedError) as exc:
        raise UserError(_unreadable_gguf(path, exc)) from exc
    model.generation_config.save_pretrained(source.directory)
    tokenizer.save_pretrained(source.directory)
    model.config.architectures = [type(model).__name__]
    source.config = _export_config(model.config, source.directory)  # now with the dtype it was read in
    return StateDictSource(model.state_dict(), files=[path])
