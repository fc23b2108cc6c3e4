"""Turn what the user names as a model (local folder, hub id, `.gguf` file) into a checkpoint to read.

A `Source` is a folder holding `config.json` and the side files (tokenizer, generation config, chat
template), plus the tensors. Hub ids are fetched with `huggingface_hub.snapshot_download` (weights and side
files only). A GGUF file is dequantized by transformers' GGUF support and served from memory; its config
and tokenizer are staged in a temporary folder as transformers exports them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gqaify.convert.checkpoint import StateDictSource, TensorSource, open_checkpoint
from gqaify.errors import UserError

LOG = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_HUB_SIDE_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]


@dataclass
class Source:
    name: str  # what the user passed
    kind: str  # "local", "hub" or "gguf"
    directory: Path  # config.json and side files
    tensors: TensorSource
    revision: str | None = None  # hub commit
    provenance: dict = field(default_factory=dict)
    model: object | None = None  # the transformers model, where reading the source built it already (GGUF)

    def load_tokenizer(self):
        """The source's tokenizer (for calibration text).

        Raises:
            UserError: the folder has no tokenizer.
        """
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.directory)
        except (OSError, ValueError) as exc:
            raise UserError(
                f"calibration needs the tokenizer of {self.name}, which could not be loaded ({type(exc).__name__}); "
                "add the tokenizer files to SRC, or convert without --calib-data"
            ) from exc

    def load_model(self, device: str = "cpu"):
        """The source as a float32 transformers model in eval mode on `device` (for calibration).

        Raises:
            UserError: transformers cannot build the model from the folder.
        """
        import torch
        from transformers import AutoModelForCausalLM

        if self.model is not None:  # already float32 (a GGUF, dequantized on reading)
            return self.model.to(device).eval()
        try:
            model = AutoModelForCausalLM.from_pretrained(self.directory, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise UserError(
                f"calibration runs {self.name}, which transformers could not load ({type(exc).__name__}); "
                "check its files, or convert without --calib-data"
            ) from exc
        return model.to(device).eval()


@contextlib.contextmanager
def open_source(src: str | Path, revision: str | None = None) -> Iterator[Source]:
    """Resolve `src` to a readable checkpoint; temporary files (GGUF staging) live as long as the context.

    Raises:
        UserError: `src` does not exist, is not a model, or cannot be fetched.
    """
    path = Path(src).expanduser()
    if path.exists():
        if revision is not None:
            raise UserError(f"--revision applies to hub ids, but {src} is a local path; drop --revision")
        if path.is_file() and path.suffix == ".gguf":
            with _open_gguf(path) as source:
                yield source
            return
        if path.is_file():
            raise UserError(f"{src} is a file but not a .gguf; point SRC at a model folder, hub id, or .gguf file")
        if not (path / "config.json").is_file():
            raise UserError(f"{src} has no config.json; point SRC at a Hugging Face model folder")
        yield Source(str(src), "local", path.resolve(), open_checkpoint(path))
        return
    if path.suffix == ".gguf" or not _REPO_ID.match(str(src)):
        raise UserError(f"SRC not found: {src} does not exist; check the path")
    yield _download(str(src), revision)


def _download(repo_id: str, revision: str | None) -> Source:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    def fetch(weights: list[str]) -> Path:
        try:
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_SIDE_FILES + weights))
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

    LOG.info("downloading %s from the Hugging Face hub", repo_id)
    directory = fetch(["*.safetensors"])
    if not any(directory.glob("*.safetensors")):
        directory = fetch(["*.bin"])
    commit = directory.name if re.fullmatch(r"[0-9a-f]{40}", directory.name) else revision
    if not (directory / "config.json").is_file():
        raise UserError(f"{repo_id} has no config.json; gqaify converts transformers checkpoints")
    return Source(repo_id, "hub", directory, open_checkpoint(directory), revision=commit)


@contextlib.contextmanager
def _open_gguf(path: Path) -> Iterator[Source]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    LOG.info("dequantizing %s with transformers' GGUF support", path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, OSError, KeyError, NotImplementedError) as exc:
        raise UserError(f"cannot read {path} as a GGUF model ({exc}); check the file or use the HF checkpoint") from exc
    with tempfile.TemporaryDirectory(prefix="gqaify-gguf-") as staging:
        directory = Path(staging)
        model.config.save_pretrained(directory)
        model.generation_config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        # The weights leave dequantized: the export is a plain checkpoint of the model class.
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text())
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tensors = StateDictSource(model.state_dict(), files=[path])
        yield Source(str(path), "gguf", directory, tensors, provenance={"gguf_file": path.name}, model=model)
