"""The settings of an uptraining run: one dataclass, read from a recipe YAML and overridden on the command line.

    accelerate launch -m gqaify.uptrain --recipe recipes/smollm2-135m-mqa.yaml --lr 1e-4 --max_tokens 50000

Every field is a recipe key and a `--key value` option, read as every stage's settings are (`gqaify.settings`);
`--recipe` is uptrain's name for `--config`. The recipe sets defaults; the command line wins.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gqaify.conversion.options import METHOD_INFO, CalibMode, ConvertSettings, GroupingName, MethodName
from gqaify.errors import raise_if_problems
from gqaify.eval.tasks import TaskRequest
from gqaify.hub import repo_id_problem
from gqaify.settings import Stage, read_config, setting, type_problems
from gqaify.settings import parse as parse_settings

TRACKERS = ("csv", "tensorboard", "wandb")
TASK_FLAGS = {"names": "eval_tasks", "num_fewshot": "eval_num_fewshot", "limit": "eval_limit",
              "include_path": "eval_include_path"}  # fmt: skip


@dataclass
class UptrainSettings:
    # -- the model
    model: str = setting("", "a converted checkpoint, or a source to convert when kv_heads is set")
    kv_heads: int | None = setting(None, "convert `model` to this many K/V heads first")
    method: MethodName = setting("mean", "conversion method when kv_heads is set")
    grouping: GroupingName = setting(
        "contiguous", "which heads share a K/V head; similarity needs calib_data"
    )
    calib_data: str | None = setting(
        None, "calibration text for the conversion (aligned, lsq, similarity); not eval text"
    )
    calib_tokens: int = setting(ConvertSettings.calib_tokens, "calibration tokens read from calib_data")
    calib_split: str | None = setting(None, "split of calib_data (default: split)")
    calib_mode: CalibMode = setting(
        "sequential", "calibration layer by layer (sequential) or on the parent's activations"
    )
    refine_steps: int = setting(0, "Adam steps refining each layer during calibration")
    output_dir: str = setting("", "folder for checkpoints, metrics, plot and final/")
    # -- the data
    data: str = setting("", "training text: file/folder (.txt .jsonl .parquet .csv) or hub name[:config]")
    split: str = setting("train", "split of `data`")
    text_column: str = setting("text", "column holding the text (data and eval_data)")
    streaming: bool = setting(False, "read `data` lazily (datasets streaming) instead of tokenizing it all first")
    seq_len: int = setting(256, "tokens per packed training block")
    # -- the budget and batch
    max_tokens: int | None = setting(None, "training tokens in all (the budget)")
    budget_fraction: float | None = setting(None, "budget as a fraction of pretraining_tokens (instead of max_tokens)")
    pretraining_tokens: int | None = setting(None, "the parent's pre-training tokens, for budget_fraction")
    micro_batch_size: int = setting(4, "blocks per forward pass, per process")
    grad_accum: int = setting(1, "micro-batches per optimizer step")
    # -- the optimizer
    lr: float = setting(3e-4, "peak learning rate (AdamW)")
    warmup: float = setting(0.05, "linear warm-up: a fraction of the steps if < 1, else steps")
    schedule: Literal["cosine", "linear", "constant"] = setting("cosine", "decay after warm-up")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    max_grad_norm: float = setting(1.0, "gradient clipping norm (0: none)")
    seed: int = setting(0, "seed for the data order and the run")
    mixed_precision: Literal["no", "bf16", "fp16"] | None = setting(
        None, "autocast dtype (default: what accelerate launch was given, e.g. its config file; else no)"
    )
    gradient_checkpointing: bool = setting(False, "recompute activations in backward")
    trainable: Literal["all", "attention", "kv-only", "lora"] = setting(
        "all", "which weights train (lora: low-rank adapters on the attention projections, merged at the end)"
    )
    lora_rank: int = setting(16, "rank of the adapters, for trainable lora")
    lora_alpha: float = setting(32.0, "scale of the adapters (alpha / rank multiplies them), for trainable lora")
    # -- distillation
    distill_from: str | None = setting(None, "teacher (the parent): adds KL to its next-token distribution")
    distill_from_data: bool = setting(
        False, "distil from the parent's top-k log-probabilities stored with `data` (gqaify generate "
        "--top-logprobs K) instead of running distill_from: no teacher in memory"
    )  # fmt: skip
    distill_weight: float = setting(0.5, "loss = (1 - w) * LM loss + w * KL")
    temperature: float = setting(1.0, "softmax temperature of the KL term")
    # -- evaluation, checkpoints, logging
    eval_data: str | None = setting(None, "held-out text for perplexity, same loaders as gqaify eval")
    eval_split: str = setting("test", "split of eval_data")
    eval_tokens: int = setting(16384, "evaluate on the first N tokens of eval_data")
    eval_seq_len: int | None = setting(None, "perplexity window (default seq_len)")
    eval_every: int = setting(0, "evaluate every N steps (0: at start and end only)")
    eval_tasks: list[str] = setting(
        [], "lm-evaluation-harness tasks scored at each evaluation, logged to metrics (needs gqaify[tasks])"
    )
    eval_num_fewshot: int | None = setting(None, "few-shot examples per eval task (default: each task's own)")
    eval_limit: float | None = setting(None, "score only the first N items of each eval task (or a fraction below 1)")
    eval_include_path: str | None = setting(None, "folder of local task YAMLs, for eval_tasks")
    parent: str | None = setting(
        None, "model whose perplexity the plot shows as a line (default distill_from, or the converted source)"
    )
    save_every: int = setting(100, "checkpoint every N steps (0: none; resume needs them)")
    save_total_limit: int = setting(2, "checkpoints kept")
    log_every: int = setting(1, "write metrics every N steps")
    log_to: list[str] = setting([], f"extra trackers: {', '.join(TRACKERS)}")
    push_to_hub: str | None = setting(None, "upload final/, once complete, to this hub repository (owner/name)")
    progress: bool = setting(True, "show a progress bar")
    trust_remote_code: bool = setting(
        False, "run the modeling code a model folder carries (gqaify writes it for GPT-2, GPT-NeoX, OPT)"
    )
    dist_timeout: int = setting(
        3600,
        "seconds processes wait for each other (the main one converts the model first; raise it for a large "
        "calibrated conversion, or convert beforehand with gqaify convert)",
    )

    @property
    def tokens_per_step_per_process(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.seq_len

    def task_request(self) -> TaskRequest:
        """The lm-evaluation-harness tasks scored at each evaluation (no names: none)."""
        return TaskRequest.of(self.eval_tasks, num_fewshot=self.eval_num_fewshot, limit=self.eval_limit,
                              include_path=self.eval_include_path, flags=TASK_FLAGS)  # fmt: skip

    def budget(self) -> int:
        """The token budget: max_tokens, else budget_fraction × pretraining_tokens."""
        if self.max_tokens is not None:
            return self.max_tokens
        return math.floor(self.budget_fraction * self.pretraining_tokens)


# Settings that may change between a run and its resumption without changing what is trained.
RESUMABLE_CHANGES = frozenset(
    {"eval_every", "save_every", "save_total_limit", "log_every", "log_to", "progress", "dist_timeout", "push_to_hub",
     "eval_tasks", "eval_num_fewshot", "eval_limit", "eval_include_path"}
)  # fmt: skip

# Names users bring from transformers' TrainingArguments and TRL, and what gqaify calls them (with a note where
# the meaning differs): an unknown key or option that is one of these is answered with its gqaify name.
FOREIGN_NAMES = {
    "learning_rate": ("lr", ""),
    "warmup_ratio": ("warmup", "a fraction of the steps when below 1"),
    "warmup_steps": ("warmup", "a number of steps when 1 or more"),
    "per_device_train_batch_size": ("micro_batch_size", ""),
    "train_batch_size": ("micro_batch_size", ""),
    "gradient_accumulation_steps": ("grad_accum", ""),
    "lr_scheduler_type": ("schedule", ""),
    "num_train_epochs": ("max_tokens", "gqaify budgets training tokens, not epochs"),
    "max_steps": ("max_tokens", "gqaify budgets tokens: steps x micro_batch_size x grad_accum x processes x seq_len"),
    "logging_steps": ("log_every", ""),
    "save_steps": ("save_every", ""),
    "eval_steps": ("eval_every", ""),
    "report_to": ("log_to", ""),
    "bf16": ("mixed_precision", "mixed_precision: bf16"),
    "fp16": ("mixed_precision", "mixed_precision: fp16"),
    "max_seq_length": ("seq_len", ""),
    "max_length": ("seq_len", ""),
    "block_size": ("seq_len", ""),
    "dataset_text_field": ("text_column", ""),
    "model_name_or_path": ("model", ""),
    "dataset_name": ("data", ""),
    "ddp_timeout": ("dist_timeout", ""),
    "hub_model_id": ("push_to_hub", "the repository id itself"),
}


def check(s: UptrainSettings) -> None:
    """Every problem with `s` in one `UserError` (values only; files are checked where they are opened)."""
    problems = type_problems(s)
    if problems:  # the value checks below assume the types are right
        raise_if_problems(problems)
    for key in ("model", "output_dir", "data"):
        if not getattr(s, key):
            problems.append(f"{key} is required; set it in the recipe or pass --{key}")
    positive = ("seq_len", "micro_batch_size", "grad_accum", "eval_tokens", "log_every", "save_total_limit",
                "dist_timeout")  # fmt: skip
    problems += [f"{k} must be a positive integer, got {getattr(s, k)}; fix it" for k in positive if getattr(s, k) < 1]
    problems += [
        f"{k} must be >= 0, got {getattr(s, k)}; fix it" for k in ("eval_every", "save_every") if getattr(s, k) < 0
    ]
    if s.kv_heads is not None and not s.calib_data and (METHOD_INFO[s.method].calibrated or s.grouping == "similarity"):
        problems.append(f"method {s.method} with grouping {s.grouping} fits on calibration text; set calib_data")
    if s.refine_steps < 0 or (s.refine_steps and s.calib_mode != "sequential"):
        problems.append(f"refine_steps {s.refine_steps} must be 0 or more, and needs calib_mode sequential")
    if s.kv_heads is not None and s.kv_heads < 1:
        problems.append(f"kv_heads must be a positive integer, got {s.kv_heads}; fix it")
    if s.max_tokens is not None and s.budget_fraction is not None:
        problems.append("give max_tokens or budget_fraction, not both")
    elif s.max_tokens is None and s.budget_fraction is None:
        problems.append("no token budget; set max_tokens (or budget_fraction with pretraining_tokens)")
    elif s.max_tokens is not None and s.max_tokens <= 0:
        problems.append(f"max_tokens must be > 0, got {s.max_tokens}; give the number of training tokens")
    elif s.budget_fraction is not None:
        if not 0 < s.budget_fraction <= 1:
            problems.append(
                f"budget_fraction must be in (0, 1], got {s.budget_fraction}; e.g. 0.05 as in the GQA paper"
            )
        if not s.pretraining_tokens or s.pretraining_tokens <= 0:
            problems.append("budget_fraction needs pretraining_tokens, the parent's pre-training token count")
    if s.trainable == "lora" and importlib.util.find_spec("peft") is None:
        problems.append("trainable lora needs peft; pip install 'gqaify[lora]'")
    if s.lora_rank < 1 or not 0 < s.lora_alpha < math.inf:
        problems.append(f"lora_rank must be >= 1 and lora_alpha > 0, got {s.lora_rank}, {s.lora_alpha}; fix it")
    if s.lr <= 0 or s.warmup < 0 or s.weight_decay < 0 or s.max_grad_norm < 0:
        problems.append("lr must be > 0 and warmup, weight_decay, max_grad_norm >= 0; fix the negative value")
    if not 0 <= s.distill_weight <= 1 or s.temperature <= 0:
        problems.append(f"need 0 <= distill_weight <= 1 and temperature > 0, got {s.distill_weight}, {s.temperature}")
    if s.distill_from_data and s.distill_from:
        problems.append("distill_from_data and distill_from name two teachers; keep one")
    elif s.distill_from_data and s.temperature != 1:
        problems.append(f"temperature {s.temperature} with distill_from_data: the stored log-probabilities are the "
                        "parent's at temperature 1 and cannot be rescaled; drop temperature")  # fmt: skip
    elif (s.distill_from is None and not s.distill_from_data and s.distill_weight > 0
          and s.distill_weight != UptrainSettings.distill_weight):  # fmt: skip
        problems.append("distill_weight is set but distill_from is not; name the teacher with distill_from")
    if s.push_to_hub is not None and (problem := repo_id_problem(s.push_to_hub, "push_to_hub")):
        problems.append(problem)
    problems += s.task_request().problems()
    unknown = [t for t in s.log_to if t not in TRACKERS]
    if unknown:
        problems.append(f"log_to {unknown[0]!r} is not a tracker gqaify knows; use {', '.join(TRACKERS)}")
    raise_if_problems(problems)


UPTRAIN = Stage(
    command="uptrain",
    settings=UptrainSettings,
    description="Uptrain a converted GQA/MQA model to recover its parent's quality. Settings come from --recipe "
    "(a YAML file of the fields below) and are overridden by --field value.\n\n"
    "  gqaify uptrain --recipe recipes/smollm2-135m-mqa.yaml --lr 1e-4\n"
    "  accelerate launch -m gqaify.uptrain --recipe recipes/smollm2-135m-mqa.yaml   (several processes)",
    foreign_names=FOREIGN_NAMES,
    config_flags=("--recipe", "--config"),
    record_kind="an uptraining run's record",
)


def parse(argv: list[str] | None = None, prog: str = "gqaify uptrain") -> UptrainSettings:
    """Settings from `--recipe FILE` and `--key value` overrides in `argv`.

    Raises:
        UserError: the recipe is missing, is not a mapping, or has unknown keys; an override is unknown;
            a value is out of range.
        SystemExit: --help, or a malformed value (argparse's own one-line error, status 2).
    """
    settings = parse_settings(UPTRAIN, argv, prog)
    check(settings)
    return settings


def load_recipe(path: str | Path) -> dict:
    """The settings a recipe file holds, as a dict of known keys.

    Raises:
        UserError: no such file, not YAML, not a mapping, or an unknown key (named with the nearest valid one).
    """
    return read_config(UPTRAIN, path)
