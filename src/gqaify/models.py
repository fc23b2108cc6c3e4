"""Loading models named on the command line: a local folder, a `.gguf` file, or a hub id."""

from __future__ import annotations

from pathlib import Path

import torch

from gqaify.dtypes import torch_dtype
from gqaify.errors import UserError


def model_location(name: str, option: str = "MODEL") -> tuple[str, dict]:
    """from_pretrained's first argument and keyword arguments for `name` (folder, hub id or .gguf).

    Raises:
        UserError: `name` looks like a path and does not exist.
    """
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        return str(path), {}
    if path.suffix == ".gguf" or name.startswith((".", "/", "~")) or path.exists():
        raise UserError(f"{option} {name} not found; check the path")
    return name, {}  # a hub id


def load_config(name: str, option: str = "MODEL"):
    """The transformers config of `name`.

    Raises:
        UserError: it cannot be found or read.
    """
    from transformers import AutoConfig

    where, kwargs = model_location(name, option)
    try:
        return AutoConfig.from_pretrained(where, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{option} {name} could not be read ({type(exc).__name__}); check the path or hub id") from exc


def load_model(name: str, dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu", option: str = "MODEL"):
    """(model in eval mode on `device`, tokenizer) of `name`. GGUF weights are dequantized to float32.

    Raises:
        UserError: weights or tokenizer files are missing, or the model class is unknown.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, kwargs = model_location(name, option)
    chosen = (torch_dtype(dtype) or "auto") if isinstance(dtype, str) else dtype
    if "gguf_file" in kwargs and chosen == "auto":
        chosen = torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=chosen, **kwargs).to(device).eval()
        return model, AutoTokenizer.from_pretrained(where, **kwargs)
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
        return AutoTokenizer.from_pretrained(where, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        problem = f"{option} {name} has no tokenizer that could be loaded ({type(exc).__name__})"
        raise UserError(f"{problem}; check its files") from exc
