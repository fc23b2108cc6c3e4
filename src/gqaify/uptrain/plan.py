"""A memory plan before renting GPUs: the bytes each process holds at the peak of a training step.

    gqaify uptrain --recipe llama2-7b-gqa8 --plan accelerate/fsdp      (the launch's accelerate config)

What is counted, and how:

- the student's weights, float32 (gqaify trains a float32 master copy; mixed precision computes in bf16/fp16),
  its gradients and AdamW's two moments for what trains (`trainable`), and the teacher's weights in their saved
  dtype: exact, from the parameters' shapes. Under FSDP2 each process holds 1/N of each (every tensor split on
  its first dimension, the first process the rounded-up share), the teacher too unless `shard_teacher: false`;
  under DDP whole, with DDP's gradient buckets (a second copy of the gradients).
- FSDP's gathered weights: the units whose whole weights a process holds while they run (the embeddings and
  head, kept for the step, and two decoder layers, the running one and the prefetched one, of the student and
  of the teacher), in the compute dtype, and one layer's whole gradients: exact, from the shapes.
- the peak of the forward and backward passes: what autograd keeps for the backward pass, the transients (the
  logits, the LM loss, the chunked KL, the teacher's logits) and the gradients made so far, at the micro-batch:
  found by running them on tensors that hold no memory (torch's FakeTensorMode), counting every tensor while it
  lives.
- the peak of the optimizer step: the gradients and, under FSDP, the one temporary of the multi-tensor AdamW.

The total is what is held for the run and the larger of the two peaks.

No allocator overhead, CUDA context (about 0.5 GB per GPU) or library memory is counted: they depend on the
machine. benchmarks/memory_plan.py checks the figures against the peaks measured on CPU processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import reprlib
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gqaify.errors import UserError, raise_if_problems
from gqaify.uptrain.sharding import decoder_layers, missing_wrap_problem

GIB = 2**30
# what accelerate writes into every config file, and no gqaify settings file holds: a file with either is one
ACCELERATE_KEYS = {"compute_environment", "distributed_type"}
PLANNED = ("NO", "FSDP")  # with every MULTI_* type (DDP on GPUs, CPUs or other devices)


@dataclass(frozen=True)
class Launch:
    """What a plan needs of an accelerate config: how many processes, whether FSDP2 shards, and the precision."""

    processes: int
    sharded: bool
    mixed_precision: str  # "no", "bf16" or "fp16"
    wrap: tuple[str, ...] = ()  # fsdp_transformer_layer_cls_to_wrap's classes (none: the model's decoder layer)
    on_cpus: bool = False  # several processes, launched on CPUs (MULTI_CPU, or use_cpu: true)

    @classmethod
    def read(cls, path: Path) -> Launch:
        """The launch an accelerate config file describes.

        Raises:
            UserError: the file cannot be read or is not an accelerate config; its distributed_type is one gqaify
                does not plan (DeepSpeed, Megatron-LM, XLA), or FSDP 1; num_processes is not a positive whole number.
        """
        from gqaify.settings import read_data

        config = read_data(path, f"--plan {path}")
        if not isinstance(config, dict) or not ACCELERATE_KEYS & set(config):
            raise UserError(f"--plan {path} is not an accelerate config (no distributed_type); give one")
        if "distributed_type" not in config:  # accelerate launch stops on it in a traceback of its own
            raise UserError(
                f"--plan {path} has no distributed_type, which accelerate launch requires of a config file; add "
                "distributed_type: 'NO' (one process), MULTI_GPU (DDP) or FSDP"
            )
        kind = config["distributed_type"]
        if kind not in PLANNED and not (isinstance(kind, str) and kind.startswith("MULTI_")):  # MULTI_*: DDP
            raise UserError(
                f"--plan {path}: gqaify plans one process, DDP (MULTI_GPU, MULTI_CPU, ...) and FSDP2 launches, not "
                f"distributed_type {kind}; give a DDP or FSDP config"
            )
        fsdp = kind == "FSDP"
        if fsdp and _fsdp_version(config, path) != 2:
            raise UserError(f"--plan {path}: gqaify plans FSDP2 only; set fsdp_version: 2")
        processes = 1 if config.get("num_processes") is None else config["num_processes"]
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise UserError(
                f"--plan {path}: num_processes must be a positive whole number, got {processes!r}; set it to the "
                "number of processes the launch starts"
            )
        precision = str(config.get("mixed_precision") or "no")
        if precision not in ("no", "bf16", "fp16"):  # accelerate's fp8 runs through other libraries' kernels
            raise UserError(
                f"--plan {path}: gqaify plans mixed_precision no, bf16 or fp16, not {precision}; set one of them"
            )
        wrap = (config.get("fsdp_config") or {}).get("fsdp_transformer_layer_cls_to_wrap") if fsdp else None
        names = [w.strip() for w in wrap.split(",")] if isinstance(wrap, str) else list(wrap or [])
        on_cpus = processes > 1 and (kind == "MULTI_CPU" or config.get("use_cpu") is True)
        return cls(processes, fsdp and processes > 1, precision, tuple(n for n in names if n), on_cpus)

    def here_problem(self) -> str | None:
        """What stops this launch on this machine before it trains (None: nothing seen): several processes on a
        machine with no GPU, which join no group without ACCELERATE_USE_CPU (each refuses, and torch's launcher
        then prints its ChildFailedError traceback of the processes that stopped)."""
        from accelerate.utils import parse_flag_from_env

        if self.processes < 2 or self.on_cpus or parse_flag_from_env("ACCELERATE_USE_CPU") or torch.cuda.is_available():
            return None
        return (
            f"this machine has no GPU: launched here, the {self.processes} processes would join no group; launch "
            "with ACCELERATE_USE_CPU=1 (or plan here what a GPU machine will run)"
        )


def _fsdp_version(config: dict, path: Path) -> int:
    """The FSDP version an accelerate config's fsdp_config asks for (1 where it does not say: accelerate's default).

    Raises:
        UserError: fsdp_config is no mapping, or its fsdp_version is neither 1 nor 2.
    """
    fsdp_config = config.get("fsdp_config") or {}
    if not isinstance(fsdp_config, dict):
        raise UserError(
            f"--plan {path}: fsdp_config must be a mapping of fsdp_* keys, got {reprlib.repr(fsdp_config)}; "
            "write it as `accelerate config` does (fsdp_config: then fsdp_version: 2 indented below it)"
        )
    version = fsdp_config.get("fsdp_version", 1)
    if isinstance(version, bool) or version not in (1, 2, "1", "2"):  # accelerate passes it on as text
        raise UserError(f"--plan {path}: fsdp_config's fsdp_version {version!r} is not 1 or 2; set fsdp_version: 2")
    return int(version)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one process holds at the peak of a step (the first process, which holds the rounded-up shares)."""

    launch: Launch
    student: int  # the student's weights (float32)
    optimizer: int  # AdamW's two moments of what trains
    teacher: int  # the teacher's weights (0 without distill_from)
    gathered: int  # FSDP: the whole weights (and one layer's gradients) of the units running
    buckets: int  # DDP: its gradient buckets, a second copy of the gradients, held for the run
    gradients: int  # of what trains
    activations: int  # the forward and backward passes' peak: kept activations, transients, gradients made so far
    update: int  # AdamW's step: the gradients and the temporaries of its multi-tensor update (none when fused)

    @property
    def step(self) -> int:
        """The step's own peak: the backward pass, or the optimizer's update, whichever is larger."""
        return max(self.activations, self.update)

    @property
    def total(self) -> int:
        return self.student + self.optimizer + self.teacher + self.gathered + self.buckets + self.step

    def table(self) -> str:
        """The plan as the terminal shows it."""
        how = "FSDP2, sharded" if self.launch.sharded else ("DDP" if self.launch.processes > 1 else "one process")
        rows = [
            ("student weights (float32)", self.student),
            ("optimizer state (AdamW)", self.optimizer),
            ("teacher weights", self.teacher),
            ("gathered by FSDP", self.gathered),
            ("DDP gradient buckets", self.buckets),
            ("gradients", self.gradients),
            ("peak of forward + backward", self.activations),
            ("peak of the optimizer step", self.update),
        ]
        launch = self.launch
        lines = [f"memory per process: {launch.processes} process(es), {how}, precision {launch.mixed_precision}"]
        lines += [f"  {name:<32}{size / GIB:>10.2f} GiB" for name, size in rows]
        lines.append(f"  {'total':<32}{self.total / GIB:>10.2f} GiB")
        lines.append(
            "  (total: the held memory and the larger of the two peaks, each of which includes the gradients it "
            "holds; without the CUDA context, allocator slack or libraries: leave 10-20% free)"
        )
        if problem := launch.here_problem():
            lines.append(f"note: {problem}")
        return "\n".join(lines)


def plan(s, launch: Launch) -> MemoryPlan:
    """The memory plan of the uptraining `s` (UptrainSettings) under `launch`. Reads configs only: no weights.

    Raises:
        UserError: a setting the run would refuse (every problem at once: too few tokens for one step of the launch's
            processes among them, so that a huge batch is refused, not planned); a model's config cannot be read.
    """
    student_config, teacher_config = _configs(s, launch)
    n = launch.processes if launch.sharded else 1
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(launch.mixed_precision, torch.float32)
    with torch.device("meta"):
        student = _trainable_model(student_config, s)
        teacher = _model(teacher_config, teacher_config.dtype or torch.float32) if teacher_config else None
    if problem := missing_wrap_problem(launch.wrap, student):  # the launch would stop in a traceback on every rank
        raise UserError(f"--plan: {problem}")
    params = list(student.parameters())  # a tied weight once
    trained = [p for p in params if p.requires_grad]
    grads = _bytes(trained, n, torch.float32)
    gathered = 0
    if launch.sharded:
        gathered = _gathered(student, compute) + _bytes(_largest_layer(student, trainable=True), 1, torch.float32)
        if teacher is not None and s.shard_teacher:
            gathered += _gathered(teacher, None)
    # torch's fused AdamW updates in place; under FSDP gqaify's is the multi-tensor one
    # (`student.optimizer_and_schedule`), whose update makes one temporary the size of the moments it updates
    return MemoryPlan(
        launch=launch,
        student=_bytes(params, n, torch.float32),
        optimizer=2 * grads,
        teacher=_bytes(list(teacher.parameters()), n if s.shard_teacher else 1, None) if teacher is not None else 0,
        gathered=gathered,
        buckets=grads if launch.processes > 1 and not launch.sharded else 0,
        gradients=grads,
        activations=_activations(student_config, teacher_config, s, compute, n),
        update=grads * (2 if launch.sharded else 1),
    )


def _configs(s, launch: Launch) -> tuple[object, object | None]:
    """(the config of the model that trains: `model`, or its conversion to kv_heads; the teacher's, or None), read
    once, with every problem at once: the settings' (`UptrainSettings.problems`, too few tokens for one step of the
    launch's processes), and a model's config that cannot be read.

    Raises:
        UserError: every problem found.
    """
    from gqaify.conversion.budget import planned_config
    from gqaify.model.loading import load_config

    one_process = s.step_problem(processes=1)  # among s.problems() already
    problems = s.problems()
    configs = {}
    for key in (k for k in ("model", "distill_from") if getattr(s, k)):
        try:
            configs[key] = load_config(getattr(s, key), option=key, trust_remote_code=s.trust_remote_code)
        except UserError as exc:
            problems.append(str(exc))
    raise_if_problems(problems, None if one_process else s.step_problem(launch.processes))
    student = planned_config(s.conversion("plan"), configs["model"]) if s.converts else configs["model"]
    return student, configs.get("distill_from")


def _model(config, dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _trainable_model(config, s, dtype=torch.float32) -> torch.nn.Module:
    """The student set up as the run sets it up (`student.trainable_student`)."""
    from gqaify.uptrain.student import trainable_student

    return trainable_student(_model(config, dtype), s)[0]


def _bytes(params, n: int, dtype) -> int:
    """Bytes of the first process's share of `params` split n ways on their first dimension (in `dtype`, or each
    parameter's own)."""
    total = 0
    for p in params:
        rows = math.ceil(p.shape[0] / n) if p.ndim else 1
        size = (dtype or p.dtype).itemsize
        total += rows * (p.numel() // max(p.shape[0], 1) if p.ndim else 1) * size
    return total


def _largest_layer(model, trainable: bool = False) -> list[torch.nn.Parameter]:
    layers = decoder_layers(model)
    if not layers:
        return []
    biggest = max(layers, key=lambda m: sum(p.numel() for p in m.parameters()))
    return [p for p in biggest.parameters() if p.requires_grad or not trainable]


def _gathered(model, dtype) -> int:
    """Whole weights FSDP holds at once: the parameters outside the decoder layers (embeddings, norm, head) and two
    layers (the one running and the one prefetched)."""
    inside = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
    outside = [p for p in model.parameters() if id(p) not in inside]
    return _bytes(outside, 1, dtype) + 2 * _bytes(_largest_layer(model), 1, dtype)


def _activations(student_config, teacher_config, s, compute, n: int) -> int:
    """The peak of a step's forward and backward passes on one micro-batch, less the weights: the passes run on
    tensors that hold no memory (torch's FakeTensorMode), every tensor they make counted while it lives (`_Live`),
    each gradient at 1/n of its size once it is accumulated (FSDP reduce-scatters it into its shard). With
    grad_accum above 1 it is a later micro-batch's: the gradients are held already and the pass adds into them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gqaify.uptrain.student import student_loss

    if s.trainable == "lora":  # peft cannot wrap fake tensors: the attention's own (its adapters' rank-r inputs
        s = dataclasses.replace(s, trainable="attention")  # are the projections' inputs, kept already)
    with FakeTensorMode():
        student = _trainable_model(student_config, s, compute)  # what autocast and FSDP's mixed precision use
        teacher = _model(teacher_config, teacher_config.dtype or torch.float32) if teacher_config else None
        if teacher is not None:
            teacher.requires_grad_(False)
        ids = torch.randint(0, student_config.vocab_size, (s.micro_batch_size, s.seq_len))
        batch = {"input_ids": ids}
        if s.distill_from_data:
            k = STORED_K
            batch |= {
                "top_ids": torch.randint(0, student_config.vocab_size, (*ids.shape, k)),
                "top_logprobs": torch.zeros(*ids.shape, k),
            }
        held = [*student.parameters(), *student.buffers()]
        held += [*teacher.parameters(), *teacher.buffers()] if teacher is not None else []
        with _Live(held) as live:
            for p in student.parameters():
                if p.requires_grad:
                    if s.grad_accum > 1:  # a later micro-batch's backward pass adds into the gradients held
                        p.grad = torch.zeros_like(p)
                        live.shrink(p.grad, n)
                    p.register_post_accumulate_grad_hook(lambda p: live.shrink(p.grad, n))
            loss, _ = student_loss(student, teacher, batch, s, _NoAutocast())
            loss.backward()
    return live.peak


STORED_K = 64  # top-k log-probabilities assumed stored with distill_from_data (the KL's memory barely depends on k)


class _Live(TorchDispatchMode):
    """The peak bytes of the tensors made while it is on: each new storage counted until it is freed; those of
    `held` (the weights, counted on their own) never, though ops make views of them."""

    def __init__(self, held: list[torch.Tensor]):
        super().__init__()
        self.live: dict[int, int] = {id(t.untyped_storage()): 0 for t in held}
        self.shrunk: set[int] = set()
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage())
        return out

    def _count(self, storage) -> None:
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.now += self.live[key]
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def shrink(self, tensor: torch.Tensor, n: int) -> None:
        """Count `tensor` at 1/n of its size from now on (a gradient FSDP keeps as its shard)."""
        key = id(tensor.untyped_storage())
        if key in self.live and key not in self.shrunk and n > 1:
            self.shrunk.add(key)
            kept = math.ceil(self.live[key] / n)
            self.now -= self.live[key] - kept
            self.live[key] = kept


class _NoAutocast:
    """The accelerator `student_loss` is handed on fake tensors: the compute dtype is already the model's."""

    def autocast(self):
        return contextlib.nullcontext()
