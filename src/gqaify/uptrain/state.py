"""The state of one uptraining run, as its pieces receive it (the data's reading, the claim, evaluation, checkpoints,
logging): the run once launched (`Launched`: settings, folder, launcher, what the checks read), what it reads before
it claims output_dir (`RunData`: training batches, eval texts), the run in its claimed output_dir (`RunState`:
settings, folder, launcher, run.json's record, steps) and what the loop moves (`LoopState`: the prepared model,
teacher, data, optimizer, schedule and `Progress`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from gqaify.eval.results import EvalText
from gqaify.records import RunRecord
from gqaify.uptrain.checkpoint_files import Progress
from gqaify.uptrain.checks import Inputs
from gqaify.uptrain.run_folder import save_run
from gqaify.uptrain.settings import UptrainSettings


@dataclass(frozen=True)
class Launched:
    """A run once its inputs are checked and its launcher made: the settings as resolved (mixed_precision the
    launcher's), output_dir, the launcher (accelerate's `Accelerator`) and what the checks read (`checks.Inputs`:
    the models' configs, the tokenizer, the tasks). Every step from there to the push receives it."""

    s: UptrainSettings
    out: Path
    accelerator: Any
    inputs: Inputs


@dataclass(frozen=True)
class RunData:
    """What a run reads before it claims output_dir, so that everything wrong with it is found before output_dir is
    touched: the training batches (a DataLoader), the optimizer steps they make of its tokens and the SHA-256 of
    their tokens (`data.training_loader`), and the eval texts (None without eval_data)."""

    loader: Any
    steps: int
    data_sha256: str
    texts: dict[str, EvalText] | None


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
