"""FSDP2 wherever torch runs it: on GPUs as accelerate sets it up, and on CPU processes (gloo), which accelerate
leaves unsharded; and the distillation teacher sharded like the student.

accelerate turns an FSDP launch into `DistributedType.FSDP` only on accelerators; a CPU launch of the same config
(`ACCELERATE_USE_CPU=1 accelerate launch --config_file fsdp.yaml ...`) runs as MULTI_CPU, plain data parallelism,
although torch's `fully_shard` runs on gloo. `shard_on_cpus` finishes accelerate's own set-up there (the state it
would have set on GPUs: the distributed type and the FSDP plugin read from the launcher's environment), so a CPU
launch shards, checkpoints and gathers as the GPU launch it rehearses does. Only FSDP2: FSDP1 needs a device
(`fsdp_problem` refuses it on CPUs).

The teacher under FSDP is sharded too (`sharded_teacher`): each process keeps 1/N of its weights, and every
decoder layer gathers its whole weights for its forward pass and frees them after; without sharding each process
holds the whole teacher (a 7B parent is 13.5 GB in bf16 on every GPU). `shard_teacher: false` keeps whole copies,
which saves the all-gathers where memory allows.
"""

from __future__ import annotations

import logging
import os

import torch

LOG = logging.getLogger(__name__)


def fsdp_requested() -> bool:
    """The launcher asked for FSDP (accelerate launch --config_file with distributed_type FSDP, or --use_fsdp)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_problem() -> str | None:
    """Why this launch cannot run: it asks for FSDP1 on a machine without an accelerator (FSDP1 needs a device)."""
    if fsdp_requested() and os.environ.get("FSDP_VERSION", "1") != "2" and not torch.accelerator.is_available():
        return (
            "the launch asks for FSDP version 1, which needs GPUs; set fsdp_version: 2 in its accelerate config "
            "(FSDP2 shards on CPU processes too)"
        )
    return None


def shard_on_cpus(accelerator) -> bool:
    """Make a CPU launch that asked for FSDP2 shard as it would on GPUs; True if it now does. Call it right after
    the Accelerator is made, before anything is prepared.

    accelerate keeps its distributed type in two shared states (`PartialState`, `AcceleratorState`); both are set,
    as accelerate itself sets them on GPUs, so that no later `AcceleratorState()` reads the old type back.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if not fsdp_requested() or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* environment, as accelerate reads it
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state = accelerator.state
    state.fsdp_plugin = plugin
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    LOG.info("FSDP2 on %d CPU processes (gloo): weights, gradients and optimizer state sharded", state.num_processes)
    return True


def wrap_problem(accelerator, model: torch.nn.Module) -> str | None:
    """Why FSDP cannot wrap `model` as the launch's config asks: its fsdp_transformer_layer_cls_to_wrap names a
    class the model does not have (accelerate's own error is a traceback). None where it can, or without FSDP."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return missing_wrap_problem(getattr(plugin, "transformer_cls_names_to_wrap", None) or [], model)


def missing_wrap_problem(names, model: torch.nn.Module) -> str | None:
    """Why FSDP cannot wrap `model` in the classes `names` (an accelerate config's fsdp_transformer_layer_cls_to_wrap):
    one the model does not have, named with the model's own decoder layer; None where it can. The run asks it of the
    launch's plugin (`wrap_problem`), `--plan` of the config file, before any process starts."""
    have = {type(m).__name__ for m in model.modules()}
    if missing := [name for name in names if name not in have]:
        layers = ", ".join(getattr(model, "_no_split_modules", None) or ()) or "none named"
        return (
            f"the accelerate config's fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which "
            f"{type(model).__name__} does not have (its decoder layer: {layers}); remove the key (FSDP then wraps "
            "the model's own decoder layer) or name that class"
        )
    return None


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of the classes `model` names as never split (`_no_split_modules`): its decoder layers, the units
    the teacher is sharded in and the memory plan counts gathered."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def sharded_teacher(teacher: torch.nn.Module, accelerator) -> torch.nn.Module:
    """`teacher` sharded across the processes under FSDP2, `teacher` itself otherwise.

    Each decoder layer (`decoder_layers`) is one unit, the rest
    (embeddings, final norm, head) the root's: a unit's weights are gathered for its forward pass and freed after
    it (`reshard_after_forward`), in the teacher's own dtype. It is not registered with the accelerator, so
    checkpoints do not hold it.
    """
    if not getattr(accelerator, "is_fsdp2", False):
        return teacher
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(teacher):
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(teacher, reshard_after_forward=True)
    return teacher
