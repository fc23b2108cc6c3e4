"""The student as a run trains it and the loss it trains on: the parameters that train (all, attention, kv-only
or LoRA adapters), the optimizer and its schedule, the teacher, and one step's loss (LM loss mixed with the KL to
the parent, live or stored). The memory plan (`plan.py`) sets up and steps its student through the same functions.
"""

from __future__ import annotations

import logging
import math
import re
import weakref

import torch

from gqaify.auto import AUTO
from gqaify.conversion.shapes import held_parameters, trained_attention
from gqaify.errors import UserError
from gqaify.model.loading import load_model
from gqaify.uptrain.distill import distillation_kl, stored_kl
from gqaify.uptrain.head_loss import IGNORE, Teacher, fused_loss, head_skipped, returns_head_output
from gqaify.uptrain.lora import with_adapters
from gqaify.uptrain.settings import UptrainSettings
from gqaify.uptrain.sharding import decoder_layers, sharded_teacher

LOG = logging.getLogger(__name__)


def student_loss(model, teacher, batch: dict, s: UptrainSettings, accelerator) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to train on, the LM loss alone): transformers' LM loss over every next token, mixed with the
    KL to the parent: the teacher's, or from the top-k stored with the data (distill_from_data). Where the models
    allow (`fused`), the head is applied with the loss a chunk of tokens at a time (`head_loss`): the same loss,
    without the whole batch's logits."""
    ids = batch["input_ids"]
    distills = s.distill_weight > 0 and (teacher is not None or s.distill_from_data)
    if fused(model, teacher if distills and not s.distill_from_data else None, s, accelerator):
        return _fused_student_loss(model, teacher, batch, s, accelerator, distills)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    if not distills:
        return out.loss, out.loss.detach()
    if s.distill_from_data:
        kl = stored_kl(out.logits, batch["top_ids"], batch["top_logprobs"])
    else:
        with torch.no_grad(), accelerator.autocast():
            target = teacher(input_ids=ids, use_cache=False).logits
        kl = distillation_kl(out.logits, target, s.temperature)
    return (1 - s.distill_weight) * out.loss + s.distill_weight * kl, out.loss.detach()


def _fused_student_loss(model, teacher, batch: dict, s: UptrainSettings, accelerator, distills: bool):
    """`student_loss` from the models' last hidden states, the head applied chunk by chunk (`head_loss.fused_loss`)."""
    ids = batch["input_ids"]
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)  # each position's next token
    with head_skipped(_unwrapped(model)) as head:
        hidden = model(input_ids=ids, use_cache=False).logits
    parent = None
    if distills and s.distill_from_data:
        k = batch["top_ids"].shape[-1]
        parent = Teacher(top_ids=batch["top_ids"].reshape(-1, k), top_logprobs=batch["top_logprobs"].reshape(-1, k))
    elif distills:
        with torch.no_grad(), accelerator.autocast(), head_skipped(_unwrapped(teacher)) as teacher_head:
            parent_hidden = teacher(input_ids=ids, use_cache=False).logits
        parent = Teacher(hidden=parent_hidden.reshape(-1, parent_hidden.shape[-1]), weight=teacher_head.weight)
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(getattr(accelerator, "mixed_precision", "no")))
    return fused_loss(
        hidden, head.weight, labels, parent, s.distill_weight if distills else 0.0, s.temperature, compute
    )


_FUSABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> `returns_head_output`, asked once


def fused(model, teacher, s: UptrainSettings, accelerator) -> bool:
    """Whether the step fuses the head with the loss: fused_loss is on, the launch does not shard with FSDP (whose
    gathered head weights live inside the model's own forward pass), and the student and a live teacher each return
    their head's output untouched (`head_loss.returns_head_output`)."""
    from accelerate.utils import DistributedType

    if not s.fused_loss or getattr(accelerator, "distributed_type", None) == DistributedType.FSDP:
        return False
    for m in (model, teacher):  # the student asked by `trainable_student`; a teacher, which no wrapper casts, here
        if m is not None:
            m = _unwrapped(m)
            if m not in _FUSABLE:
                _FUSABLE[m] = returns_head_output(m)
            if not _FUSABLE[m]:
                return False
    return True


def _unwrapped(model):
    """The transformers model inside DDP's wrapper (`module`), or `model`."""
    return getattr(model, "module", model)


def trainable_student(model, s: UptrainSettings) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """(`model` set up to train as `s` says: train mode, gradient checkpointing, LoRA adapters or the parameters
    that train (`_trainable`); the parameters that train). The memory plan sets up its student here too."""
    model.train()
    if s.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, params = _trainable(model, s)
    if s.fused_loss:  # asked here, before accelerate wraps its forward (mixed precision's casts make new tensors)
        _FUSABLE[model] = returns_head_output(model)
    return model, params


def _trainable(model, s: UptrainSettings) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """(the model to train: with LoRA adapters for trainable lora, else `model`; the parameters that train)."""
    if s.trainable != "lora":
        return model, _select_trainable(model, s.trainable)
    model = with_adapters(model, s.lora_rank, s.lora_alpha)
    return model, [p for p in model.parameters() if p.requires_grad]


def _select_trainable(model, trainable: str) -> list[torch.nn.Parameter]:
    """The parameters that train; the others get requires_grad False.

    Raises:
        UserError: `trainable` needs the architecture table and the model is not in it, or kv-only on a
            fused QKV projection (one tensor holds Q, K and V).
    """
    names = {n for n, _ in model.named_parameters()}
    if trainable != "all":
        trained = trained_attention(model.config.model_type, f"trainable {trainable}")
        if trainable == "attention":
            pattern = rf"{trained.pattern}\."
        else:
            if trained.fused:
                raise UserError(
                    f"trainable kv-only: {model.config.model_type} fuses Q, K and V in one tensor; "
                    "use trainable attention"
                )
            pattern = rf"{trained.pattern}\.({'|'.join(re.escape(k) for k in trained.kv)})\."
        names = {n for n in names if re.match(pattern, n)}
    if held := held_parameters(model):  # what the model's shape keeps as converted (`Shape.held`)
        LOG.info("%d parameters stay as converted, as the model's attention shape needs: %s", len(held), held[0])
        names -= set(held)
    for name, param in model.named_parameters():
        param.requires_grad_(name in names)
    return [p for n, p in model.named_parameters() if n in names]


# the decay after warm-up, as a factor of lr at p, the fraction of the decay's steps gone (transformers' schedules)
DECAY = {
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "linear": lambda p: 1 - p,
    "constant": lambda p: 1.0,
}


def optimizer_and_schedule(s: UptrainSettings, params: list[torch.nn.Parameter], steps: int, accelerator):
    """AdamW over `params` (matrices decay; norms and biases do not) and its warm-up + decay schedule
    (`lr_factor`)."""
    from accelerate.utils import DistributedType

    decay = [p for p in params if p.ndim >= 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": [p for p in params if p.ndim < 2]}]
    # torch's fused AdamW (one kernel for all tensors: 7x faster than the default on this CPU); not with FSDP,
    # whose sharded parameters accelerate swaps into the optimizer after prepare.
    fused = accelerator.distributed_type != DistributedType.FSDP
    optimizer = torch.optim.AdamW(groups, lr=s.lr, weight_decay=0.0, fused=fused)
    warmup = min(math.ceil(s.warmup * steps) if s.warmup < 1 else int(s.warmup), steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup, steps, s.schedule))
    return optimizer, schedule


def lr_factor(step: int, warmup: int, steps: int, schedule: str) -> float:
    """The factor of lr that optimizer step `step` (from 0) of `steps` uses: a linear warm-up over the first `warmup`
    steps that starts above 0 (step k of it at (k + 1) / (warmup + 1): no step is taken at lr 0), then the decay
    `schedule` names (`DECAY`) from lr down over the steps left."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return max(0.0, DECAY[schedule]((step - warmup) / max(1, steps - warmup)))


def load_teacher(s: UptrainSettings, accelerator, vocab_size: int):
    """The distillation teacher in eval mode on this process's device, or None.

    Raises:
        UserError: its vocabulary differs from the student's.
    """
    if not s.distill_from:
        return None
    teacher, _ = load_model(
        s.distill_from, AUTO, accelerator.device, option="distill_from", trust_remote_code=s.trust_remote_code
    )
    teacher.requires_grad_(False)
    if teacher.config.vocab_size != vocab_size:
        raise UserError(
            f"distill_from {s.distill_from} has a vocabulary of {teacher.config.vocab_size}, the model "
            f"{vocab_size}; distil from the model's parent"
        )
    return sharded_teacher(teacher, accelerator) if s.shard_teacher else teacher


def compile_layers(model) -> int:
    """Each decoder layer of `model` (`sharding.decoder_layers`) compiled in place (`nn.Module.compile`: its state
    dict, and so checkpoints, unchanged); the number compiled.

    Raises:
        UserError: the model declares no such class, or none of its modules is of one.
    """
    layers = decoder_layers(model)
    if not layers:
        raise UserError(
            f"compile: {type(model).__name__} names no decoder layer class (_no_split_modules) gqaify can compile; "
            "set compile: false"
        )
    for layer in layers:
        layer.compile()
    return len(layers)
