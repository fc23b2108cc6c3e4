"""The state of one uptraining run, as its pieces receive it (evaluation, checkpoints, logging): the run in its claimed
output_dir (`RunState`: settings, folder, launcher, run.json's record, steps) and what the loop moves (`LoopState`:
the prepared model, teacher, data, optimizer, schedule and `Progress`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gqaify.records import RunRecord
from gqaify.uptrain.run_folder import Progress, save_run
from gqaify.uptrain.settings import UptrainSettings


@dataclass
class RunState:
    """One run in its claimed output_dir: the settings (as resolved), the folder, the launcher (accelerate's
    `Accelerator`), run.json's record, and the number of optimizer steps."""

    s: UptrainSettings
    out: Path
    accelerator: object
    record: RunRecord
    steps: int

    def save_record(self, **changes) -> None:
        """run.json with `changes` to its record's fields (`RunRecord`), in every process's `record`; written by
        the main one."""
        self.record = replace(self.record, **changes)
        if self.accelerator.is_main_process:
            save_run(self.out, self.record)


@dataclass
class LoopState:
    """What the loop moves, as accelerate prepared it: the model, its teacher (None without distill_from), the
    data, the optimizer and its schedule, and where the run stands (`Progress`, saved with every checkpoint)."""

    model: torch.nn.Module
    teacher: torch.nn.Module | None
    loader: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    progress: Progress
