"""transformers' own decoder layers, run one at a time, each holding only its own weights.

A model skeleton is built from the config with every parameter on the meta device (no memory), by the
model's own class: the walk never re-implements a layer. Then

    capture   the weights outside the layers (embeddings) are loaded and each calibration window is run
              through the skeleton; every decoder layer's forward is swapped for one that records what the
              model passes it (the hidden states for layer 0, and for every layer its keyword inputs:
              position embeddings, the mask of its attention type, position ids) and hands the hidden
              states on unchanged; the pass stops after the last layer
    layers    a layer's weights are loaded from the source by name (`TensorSource.load`) into the skeleton's
              layer (`load_state_dict(assign=True)`), used, and sent back to the meta device

Memory is one or two decoder layers (the parent's and the converted one) plus the activations, whatever the
depth of the model.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from gqaify.errors import UserError
from gqaify.model.archs import ArchSpec

Window = tuple[torch.Tensor, dict]  # (hidden states (1, T, hidden), the layer's keyword inputs)


def skeleton(config: dict, num_kv_heads: int | None = None):
    """The transformers model of `config` (with `num_kv_heads` K/V heads if given), parameters on meta.

    Raises:
        UserError: transformers cannot build the class from the config.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {k: v for k, v in config.items() if k != "model_type"}
    if num_kv_heads is not None:
        values["num_key_value_heads"] = num_kv_heads
    try:
        transformers_config = AutoConfig.for_model(config["model_type"], **values)
        with init_empty_weights(include_buffers=False):  # buffers (RoPE frequencies) are real
            return AutoModelForCausalLM.from_config(transformers_config).eval()
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"calibration builds {config.get('model_type')} with transformers, which failed ({exc}); "
            "convert without --calib-data"
        ) from exc


def output_weights(model) -> set[str]:
    """Names of the LM head's parameters (none when tied to the embeddings: the checkpoint stores those once)."""
    head = model.get_output_embeddings()
    if head is None or head.weight is model.get_input_embeddings().weight:
        return set()
    return {name for name, p in model.named_parameters() if p is head.weight}


class _StopForward(Exception):
    """Raised by a hook to end a forward pass once what was wanted has been seen."""


def capture(
    model, spec: ArchSpec, outside: dict[str, torch.Tensor], windows: list[torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], list[list[dict]]]:
    """(layer 0's hidden states per window, every layer's keyword inputs per window), on the CPU.

    Args:
        model: a skeleton; `outside` (the weights outside the decoder layers) are loaded into it here.
        windows: token ids (T,) per window.
    """
    model.load_state_dict({name: t.to(device, torch.float32) for name, t in outside.items()}, strict=False, assign=True)
    for module in model.modules():  # buffers (RoPE frequencies) to the device too; the layers stay on meta
        for name, buffer in module.named_buffers(recurse=False):
            if not buffer.is_meta:
                module._buffers[name] = buffer.to(device)
    layers = [model.get_submodule(spec.decoder_layer.format(layer=i)) for i in range(_num_layers(model, spec))]
    hidden: list[torch.Tensor] = []
    inputs: list[list[dict]] = [[] for _ in layers]
    moved: dict = {}  # this window's tensors already on the CPU: the layers share one copy

    def recorder(index: int):
        def forward(self, hidden_states, *args, **kwargs):
            if args:
                raise RuntimeError(f"{type(self).__name__} was called with positional inputs beyond the hidden states")
            if index == 0:
                hidden.append(hidden_states.detach().cpu())
                moved.clear()
            inputs[index].append(to_device(kwargs, "cpu", moved))
            if index == len(layers) - 1:
                raise _StopForward
            return hidden_states

        return forward

    for index, layer in enumerate(layers):
        layer.forward = types.MethodType(recorder(index), layer)
    try:
        with torch.no_grad():
            for ids in windows:
                with contextlib.suppress(_StopForward):
                    model.base_model(input_ids=ids[None].to(device), use_cache=False)
    finally:
        for layer in layers:
            del layer.forward
        model.to("meta")
    return hidden, inputs


def _num_layers(model, spec: ArchSpec) -> int:
    count = 0
    while True:
        try:
            model.get_submodule(spec.decoder_layer.format(layer=count))
        except AttributeError:
            return count
        count += 1


@contextmanager
def loaded(layer: torch.nn.Module, state: dict[str, torch.Tensor], device: torch.device, what: str):
    """`layer` holding `state` (float32, on `device`) for the duration of the block, then back on meta.

    Raises:
        UserError: the tensors do not match the layer's parameters (names or shapes).
    """
    state = {name: t.to(device=device, dtype=torch.float32) for name, t in state.items()}
    try:
        missing, unexpected = layer.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:  # shape mismatch
        raise UserError(f"the weights of {what} do not fit transformers' {type(layer).__name__} ({exc})") from exc
    if missing or unexpected:
        raise UserError(
            f"the weights of {what} do not match transformers' {type(layer).__name__} (missing {missing[:2]}, "
            f"unexpected {unexpected[:2]}); check the checkpoint, or convert without --calib-data"
        )
    layer.eval().requires_grad_(False)
    try:
        yield layer
    finally:
        layer.to("meta")


def forward(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict, device: torch.device) -> torch.Tensor:
    """The layer's output for one window, on `device`, the window and its inputs moved there."""
    return layer(hidden.to(device), **to_device(kwargs, device))


def run(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict, device: torch.device) -> torch.Tensor:
    """The layer's output for one window, on the CPU (`forward`, brought back)."""
    return forward(layer, hidden, kwargs, device).cpu()


def run_until(
    layer: torch.nn.Module,
    module: torch.nn.Module,
    hidden: torch.Tensor,
    kwargs: dict,
    device: torch.device,
    output: bool = False,
) -> torch.Tensor:
    """What `module` (inside `layer`) receives (or, with `output`, returns) for one window; the rest of the
    layer is not run."""
    with watching(module, output, stop=True) as seen:
        with contextlib.suppress(_StopForward):
            forward(layer, hidden, kwargs, device)
        return seen()


@contextmanager
def watching(module: torch.nn.Module, output: bool = False, stop: bool = False) -> Iterator[Callable[[], torch.Tensor]]:
    """While the block runs, the last input (or output) of `module`: a function returning it. With `stop`, the
    forward pass ends there (`_StopForward`, for the caller to catch)."""
    got = {}

    def seen(_module, args, result=None):
        got["value"] = (result[0] if isinstance(result, tuple) else result) if output else args[0]
        if stop:
            raise _StopForward

    handle = module.register_forward_hook(seen) if output else module.register_forward_pre_hook(seen)
    try:
        yield lambda: got["value"]
    finally:
        handle.remove()


def to_device(value, device, moved: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
    """`value` with every tensor inside it (dicts, tuples, lists) moved to `device`; with `moved`, a tensor
    already moved (the same object) is not copied twice. `moved` holds the originals too, so an id cannot be
    reused by another tensor while it is kept."""
    if isinstance(value, torch.Tensor):
        if moved is None:
            return value.to(device)
        if id(value) not in moved:
            moved[id(value)] = (value, value.to(device))
        return moved[id(value)][1]
    if isinstance(value, dict):
        return {k: to_device(v, device, moved) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device, moved) for v in value)
    return value
