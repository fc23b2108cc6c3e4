"""micro_batch_size auto: the largest micro-batch whose memory plan (`plan.py`) fits in the device's memory, less a
margin; chosen once, before anything is read or written, recorded in run.json and kept when the run resumes.

The plan of a step grows about linearly with the micro-batch (the activations and the loss's transients; the
weights, gradients and optimizer state do not), so two plans, at 1 and 2 blocks, give the slope, and a third checks
the micro-batch they point to. That micro-batch is rounded down to a multiple of 8 (GPU kernels tile by 8 and 16), and
capped so that the run keeps at least one optimizer step per evaluation. Where the line overshoots (the plan grows
faster once the loss's chunks, rather than the model's activations, make the peak), the choice steps down a block
at a time (8 from 16 up) to the largest that fits.

The memory it fits in: on a GPU the free memory of this process's device (`torch.cuda.mem_get_info`) when the
launch has one process, and the device's whole memory when it has several (each process then reads the same
figure, so every process chooses the same micro-batch on identical GPUs); on a CPU the memory the system has
available. Of that, `MARGIN` is planned for: the plan leaves out the CUDA context, allocator slack and libraries.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from gqaify.auto import is_auto
from gqaify.errors import UserError

MARGIN = 0.85  # of the memory found, what the plan may fill
GIB = 2**30


@dataclass(frozen=True)
class Choice:
    """What micro_batch_size auto chose: the micro-batch, the plan's total at it and the bytes it was fitted in (both
    None where it was kept from the run it resumes)."""

    micro_batch_size: int
    planned: int | None = None
    fitted_in: int | None = None

    def sentence(self, s) -> str:
        step = self.micro_batch_size * s.grad_accum * s.seq_len
        said = f"micro_batch_size auto: {self.micro_batch_size} blocks of {s.seq_len} tokens ({step:,} tokens per "
        if self.planned is None:
            return said + "optimizer step and process), kept from the run it resumes"
        return (
            said + f"optimizer step and process); the memory plan's {self.planned / GIB:.2f} GiB of the "
            f"{self.fitted_in / GIB:.2f} GiB it may use ({MARGIN:.0%} of what the device has)"
        )


def with_batch_chosen(s):
    """`s` (UptrainSettings) with micro_batch_size a number: `s` itself where it is one; for auto, the micro-batch the
    run in output_dir already recorded, else the largest one whose plan fits (`choose`). The main process says which.

    Raises:
        UserError: even one block does not fit; or a problem the plan finds in the settings.
    """
    if not is_auto(s.micro_batch_size):
        return s
    choice = _recorded(s) or choose(s, _launch(s), _memory(_processes()))
    if int(os.environ.get("RANK", "0")) == 0:
        print(choice.sentence(s), flush=True)
    return dataclasses.replace(s, micro_batch_size=choice.micro_batch_size)


def choose(s, launch, memory: int) -> Choice:
    """The largest micro-batch whose plan under `launch` fits in `MARGIN` of `memory` bytes (see the module)."""
    from gqaify.uptrain.plan import plan

    def total(blocks: int) -> int:
        return plan(dataclasses.replace(s, micro_batch_size=blocks), launch).total

    room = int(MARGIN * memory)
    one = total(1)
    if one > room:
        raise UserError(
            f"micro_batch_size auto: one block of {s.seq_len} tokens plans {one / GIB:.2f} GiB, more than the "
            f"{room / GIB:.2f} GiB it may use; lower seq_len, train less (trainable attention or lora), or shard "
            "with FSDP"
        )
    most = _most(s, launch.processes)
    if most == 1:
        return Choice(1, one, room)
    slope = max(total(2) - one, 1)
    blocks = min(most, 1 + (room - one) // slope)
    if blocks >= 8:
        blocks -= blocks % 8
    planned = total(blocks)
    while planned > room and blocks > 1:  # the line overshot: the plan bends up where the loss makes its peak
        blocks -= 8 if blocks > 8 else 1
        planned = total(blocks)
    return Choice(blocks, planned, room)


def _most(s, processes: int) -> int:
    """The largest micro-batch the training tokens allow: one optimizer step per evaluation at least (one step without
    eval_data)."""
    steps = s.evaluations() if s.eval_data else 1
    return max(1, s.training_tokens() // (s.seq_len * s.grad_accum * processes * max(steps, 1)))


def _recorded(s) -> Choice | None:
    """The micro-batch the run in output_dir recorded (auto chose it when the run began), or None."""
    from gqaify.records import RUN_FILE, RunRecord, read_record_file

    file = Path(s.output_dir) / RUN_FILE if s.output_dir else None
    if file is None or not file.is_file():
        return None
    try:
        record = read_record_file(file)
    except (OSError, ValueError):
        return None  # the run's own checks say what is wrong with it
    blocks = record.settings.get("micro_batch_size") if isinstance(record, RunRecord) else None
    return Choice(blocks) if isinstance(blocks, int) and not isinstance(blocks, bool) and blocks > 0 else None


def _processes() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _launch(s):
    """The launch this process is part of, as the plan describes one (accelerate's environment)."""
    from gqaify.uptrain.plan import Launch

    processes = _processes()
    sharded = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and processes > 1
    precision = s.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    return Launch(processes, sharded, precision)


def _memory(processes: int) -> int:
    """Bytes the plan is fitted in: see the module."""
    import torch

    if torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true"):
        device = int(os.environ.get("LOCAL_RANK", "0"))
        if processes > 1:
            return torch.cuda.get_device_properties(device).total_memory
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available
