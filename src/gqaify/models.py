"""Loading models named on the command line: a local folder, a `.gguf` file, or a hub id."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

from gqaify.dtypes import torch_dtype
from gqaify.errors import UserError
from gqaify.locations import locate
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

    from gqaify.hub import offline_unless_reachable

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
        raise UserError(f"{option} {name} could not be read ({type(exc).__name__}); check the path or hub id") from exc
    shipped = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM", "")
    if shipped.startswith(f"{SHIPPED_MODULE}.") and not trust_remote_code:
        # transformers would load its MHA class, which cannot hold the G-head weights
        raise UserError(untrusted_problem(f"{option} {name} has {config.num_key_value_heads} K/V heads, which"))
    return config


def untrusted_problem(subject: str) -> str:
    """Why a model with gqaify's shipped modeling code is not loaded without trust_remote_code, and the fix."""
    return (
        f"{subject} only the modeling code gqaify ships with it ({SHIPPED_MODULE}.py) implements; pass "
        "--trust-remote-code to run that code"
    )


def load_model(
    name: str,
    dtype: str | torch.dtype = "auto",
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
    chosen = (torch_dtype(dtype) or "auto") if isinstance(dtype, str) else dtype
    if "gguf_file" in kwargs and chosen == "auto":
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


def device_problem(name: str) -> str | None:
    """Why `name` (auto, cpu, cuda, cuda:N) cannot be used here, or None."""
    if name != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        return f"unknown --device {name!r}; choose auto, cpu, cuda or cuda:N"
    if name.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {name}, but no CUDA GPU is available; use --device cpu"
    count = torch.cuda.device_count() if name.startswith("cuda:") else 0
    if count and int(name[5:]) >= count:
        return f"--device {name}, but this machine has {count} CUDA GPU(s); choose cuda:0 to cuda:{count - 1}"
    return None


def resolve_device(name: str) -> torch.device:
    """The device `name` stands for (auto: the GPU when there is one); check it with `device_problem` first."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
