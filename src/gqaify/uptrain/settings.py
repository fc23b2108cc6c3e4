"""The settings of an uptraining run: one dataclass, read from a recipe YAML and overridden on the command line.

    accelerate launch -m gqaify.uptrain --recipe recipes/smollm2-135m-mqa.yaml --lr 1e-4 --max_tokens 50000

Every field is a recipe key and a `--key value` option, read as every stage's settings are (`gqaify.settings`);
`--recipe` is uptrain's name for `--config`. The recipe sets defaults; the command line wins. With kv_heads, the
model is converted first, by the conversion's own fields (`MethodSettings`: method, grouping, calib_*, refine_*,
repair; `ShapeSettings`: attention, kv_rank, rope_dims), which uptrain's settings are made of.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gqaify.auto import AUTO, Auto, is_auto
from gqaify.conversion.registry import ATTENTION_INFO, METHOD_INFO, STREAM_SHAPE, shape_titles
from gqaify.conversion.settings import ConvertSettings, MethodSettings, ShapeSettings
from gqaify.errors import UserError, raise_if_problems
from gqaify.eval.tasks import TaskRequest
from gqaify.model.locations import local_positions
from gqaify.packaged import launch_config, recipe_by_name
from gqaify.settings import (
    QUIET,
    CountOr,
    Excludes,
    Limit,
    Needs,
    Option,
    Range,
    Stage,
    override,
    parse_command,
    read_config,
    setting,
)
from gqaify.settings.files import is_accelerate_config
from gqaify.settings.groups import Hub, Progress, Seed, TrustRemoteCode
from gqaify.text.settings import Texts

TRACKERS = ("csv", "tensorboard", "wandb")
Tracker = Literal[TRACKERS]
TASK_FLAGS = {
    "names": "eval_tasks",
    "num_fewshot": "eval_num_fewshot",
    "limit": "eval_limit",
    "include_path": "eval_include_path",
}
POSITIVE = Range(1, says="a positive integer")
# eval_points and save_every when not given (`evaluations`, `checkpoint_due`)
EVAL_POINTS = 8
CHECKPOINTS_PER_RUN = 10  # a checkpoint every tenth of the run at least...
CHECKPOINT_SECONDS = 600  # ...and after every 10 minutes without one, whichever comes first
# The fields of the conversion: checked only when there is one to run (kv_heads or kv_cut set)
CONVERSION_FIELDS = frozenset(f.name for cls in (MethodSettings, ShapeSettings) for f in dataclasses.fields(cls))


def _peft_problem(trainable: str, name: str) -> str | None:
    if trainable != "lora" or importlib.util.find_spec("peft") is not None:
        return None
    return f"{name} lora needs peft; pip install 'gqaify[lora]'"


@dataclass(frozen=True)
class UptrainSettings(MethodSettings, ShapeSettings, Seed, Hub, TrustRemoteCode, Progress):
    """What an uptraining run trains, on what, for how long, and how it is watched: a recipe's keys, the command
    line's options, and the fields of `gqaify.uptrain.run`'s settings. With kv_heads, `model` is converted first,
    by the fields of `MethodSettings`."""

    renamed = {"budget_fraction": "pretraining_fraction"}  # "budget" is the cache's (eval's --memory-budget)

    # -- the model
    model: str | None = setting(
        None, "a converted checkpoint, or a source to convert when kv_heads or kv_cut is set", required=True
    )
    kv_heads = override(help="convert `model` to this many K/V heads first, by the method and calibration below")
    # calibration text is read as the training data is, unless these say otherwise
    calib_split = override(None, "split of calib_data (default: split)")
    calib_text_column = override(None, "column of calib_data holding the text (default: text_column)")
    output_dir: str | None = setting(None, "folder for checkpoints, metrics, plot and final/", required=True)
    # -- the data
    data = Texts(  # data, data_weights, split, text_column
        "training text",
        "a mixture, each block drawn from a source by data_weights",
        weighs="the chance that a block comes from it",
        required=True,
        column_of="data and eval_data",
    )
    streaming: bool = setting(False, "read `data` lazily (datasets streaming) instead of tokenizing it all first")
    seq_len: int = setting(
        256,
        "tokens per packed training block",
        check=Range(2, fix="a block of one token has no next token to train on"),
    )
    # -- the training tokens and batch
    max_tokens: int | None = setting(
        None,
        "training tokens in all",
        check=(
            Range(0, low_open=True, says="> 0", fix="give the number of training tokens"),
            Excludes("pretraining_fraction", "both set the training tokens"),
        ),
    )
    pretraining_fraction: float | None = setting(
        None,
        "training tokens as a fraction of pretraining_tokens (instead of max_tokens)",
        check=(
            Range(0, 1, low_open=True, fix="e.g. 0.05 as in the GQA paper"),
            Needs("pretraining_tokens", "is a fraction of the parent's pre-training tokens"),
        ),
    )
    pretraining_tokens: int | None = setting(
        None, "the parent's pre-training tokens, for pretraining_fraction", check=POSITIVE
    )
    micro_batch_size: int | Auto = setting(  # auto: `batch_size.with_batch_chosen`
        4, "blocks per forward pass, per process; auto: the most the device's memory fits", check=CountOr(AUTO)
    )
    grad_accum: int = setting(1, "micro-batches per optimizer step", check=POSITIVE)
    # -- the optimizer
    lr: float = setting(3e-4, "peak learning rate (AdamW)", check=Range(0, low_open=True))
    warmup: float = setting(0.05, "linear warm-up: a fraction of the steps if < 1, else steps", check=Range(0))
    schedule: Literal["cosine", "linear", "constant"] = setting("cosine", "decay after warm-up")
    weight_decay: float = setting(0.0, "AdamW weight decay", check=Range(0))
    max_grad_norm: float = setting(1.0, "gradient clipping norm (0: none)", check=Range(0))
    seed = override(help="seed for the data order and the run")
    mixed_precision: Literal["no", "bf16", "fp16"] | None = setting(
        None, "autocast dtype (default: what accelerate launch was given, e.g. its config file; else no)"
    )
    gradient_checkpointing: bool = setting(False, "recompute activations in backward")
    fused_loss: bool = setting(True, "the head applied with the loss a chunk of tokens at a time (not under FSDP)")
    compile: bool = setting(False, "torch.compile each decoder layer, the student's and the teacher's (docs/gpu.md)")
    trainable: Literal["all", "attention", "kv-only", "lora"] = setting(
        "all",
        "which weights train (lora: low-rank adapters on the attention projections, merged at the end)",
        check=_peft_problem,
    )
    lora_rank: int = setting(
        16, "rank of the adapters, for trainable lora (at most the model's hidden size)", check=POSITIVE
    )
    lora_alpha: float = setting(
        32.0, "scale of the adapters (alpha / rank multiplies them), for trainable lora", check=Range(0, low_open=True)
    )
    # -- distillation
    distill_from: str | None = setting(None, "teacher (the parent): adds KL to its next-token distribution")
    distill_from_data: bool = setting(
        False,
        "distil from the parent's top-k log-probabilities stored with `data` (gqaify generate "
        "--top-logprobs K) instead of running distill_from: no teacher in memory",
        check=Excludes("distill_from", "name two teachers"),
    )
    shard_teacher: bool = setting(
        True,
        "under FSDP, shard the teacher like the model (1/N of it per process, each layer gathered for its forward "
        "pass); false keeps a whole copy in every process",
    )
    distill_weight: float = setting(0.5, "loss = (1 - w) * LM loss + w * KL", check=Range(0, 1))
    temperature: float = setting(1.0, "softmax temperature of the KL term", check=Range(0, low_open=True))
    # -- evaluation, checkpoints, logging
    eval_data = Texts(  # eval_data, eval_split (its text in text_column)
        "held-out text for perplexity (and the KL from the teacher), same loaders as gqaify eval",
        "a panel: each logged, with the mean KL and the worst ratio to the parent",
        default=None,
        split="test",
        column=False,
    )
    eval_tokens: int = setting(
        16384, "evaluate on the first N tokens of each eval_data text (a shorter text: all of it)", check=POSITIVE
    )
    eval_seq_len: int | None = setting(
        None, "perplexity window (default seq_len; at most the model's positions)", check=POSITIVE
    )
    eval_every: int = setting(
        0,
        "also evaluate every N steps (0, or more than the run's steps: only at the start and the eval_points)",
        check=Range(0),
    )
    eval_points: int | None = setting(
        None,
        "evaluations after the start, at steps spaced evenly in log(tokens), the last at the end: the recovery curve "
        f"(recovery.png, recovery.md) and its forecast (0: the end only; at most the run's steps; default: "
        f"{EVAL_POINTS}, fewer in a shorter run)",
        check=Range(0),
    )
    target_kl: float = setting(
        0.15,
        "mean KL to the parent (nats/token over eval_data) the recovery forecast says how many more tokens reach",
        check=Range(0, low_open=True),
    )
    eval_tasks: list[str] = setting(
        [], "lm-evaluation-harness tasks scored at each evaluation, logged to metrics (needs gqaify[tasks])"
    )
    eval_num_fewshot: int | None = setting(None, "few-shot examples per eval task (default: each task's own)")
    eval_limit: float | None = setting(None, "score only the first N items of each eval task (or a fraction below 1)")
    eval_include_path: str | None = setting(None, "folder of local task YAMLs, for eval_tasks")
    parent: str | None = setting(
        None, "model whose perplexity the plot shows as a line (default distill_from, or the converted source)"
    )
    save_every: int | None = setting(
        None,
        "checkpoint every N steps and at the end (0: none; resume needs them; more than the run's steps: the end "
        f"only; default: every tenth of the run, and after {CHECKPOINT_SECONDS // 60} minutes without one)",
        check=Range(0),
    )
    save_total_limit: int = setting(2, "checkpoints kept (more than the run writes: all)", check=POSITIVE)
    log_every: int = setting(
        1, "write metrics every N steps and at the end (more than the run's steps: the end only)", check=POSITIVE
    )
    log_to: list[Tracker] = setting([], f"extra trackers: {', '.join(TRACKERS)}")
    push_to_hub = override(help="upload final/, once complete, to this hub repository (owner/name)")
    dist_timeout: int = setting(
        3600,
        "seconds processes wait for each other (the main one converts the model first; raise it for a large "
        "calibrated conversion, or convert beforehand with gqaify convert; at most a week)",
        check=(
            POSITIVE,
            Limit(7 * 24 * 3600, "a week, longer than any conversion takes; far more overflows torch's timer"),
        ),
    )

    def problems(self) -> list[str]:
        """Everything wrong with the values, at once (files are checked where they are opened): the fields'
        declarations (the conversion's only where it converts: there is none to run without), training tokens of
        one step at least (`step_problem`), a teacher for distill_weight, and the eval task knobs (`TaskRequest`)."""
        converts = self.converts
        checked = self.calibrated_on_data() if converts else self
        problems = UPTRAIN.declared_problems(checked, leave_out=frozenset() if converts else CONVERSION_FIELDS)
        if not converts and self.attention != STREAM_SHAPE:  # it would be recorded as a shape the model does not have
            problems.append(
                f"attention {self.attention} shapes a conversion, and this run converts nothing (no kv_heads or "
                "kv_cut); add kv_heads (or kv_cut) to convert the model first, or drop attention to train it as it is"
            )
        if self.max_tokens is None and self.pretraining_fraction is None:
            problems.append("no training tokens; set max_tokens (or pretraining_fraction with pretraining_tokens)")
        elif problem := self.step_problem(processes=1):
            problems.append(problem)
        if (
            self.distill_from is None
            and not self.distill_from_data
            and self.distill_weight > 0
            and self.distill_weight != UptrainSettings.distill_weight
        ):
            problems.append("distill_weight is set but distill_from is not; name the teacher with distill_from")
        if self.distill_from_data and len(self.data) > 1:
            problems.append(
                "distill_from_data reads the log-probabilities stored with one corpus; give data one "
                "source, or name the teacher with distill_from to train on a mixture"
            )
        if self.distill_from_data and self.temperature != 1:
            problems.append(
                f"temperature {self.temperature} with distill_from_data: the stored log-probabilities are "
                "the parent's at temperature 1 and cannot be rescaled; drop temperature"
            )
        return problems + self.task_request().problems()

    @property
    def converts(self) -> bool:
        """Whether the run converts `model` first (kv_heads or kv_cut given), or trains it as it is."""
        return self.kv_heads is not None or self.kv_cut is not None

    def calibrated_on_data(self) -> UptrainSettings:
        """These settings with calib_data (and calib_weights) the training data's where calib_data is not given and
        the method is calibrated: a conversion fitted on what the model will train on."""
        from gqaify.conversion.shapes import shape

        info = METHOD_INFO.get(self.method)
        shaped = self.attention in ATTENTION_INFO and shape(self.attention).reads_text(self)  # `Shape.reads_text`
        needs_text = (info is not None and info.calibrated) or self.grouping == "similarity" or shaped
        if self.calib_data is not None or not self.data or not needs_text:
            return self
        weights = self.calib_weights if self.calib_weights is not None else self.data_weights
        return dataclasses.replace(self, calib_data=list(self.data), calib_weights=weights)

    def conversion(self, out: str | Path) -> ConvertSettings:
        """The conversion of `model` to kv_heads into `out` that these settings ask for: the conversion's fields as
        they are here (calib_data the training data where not given: `calibrated_on_data`), calibration text read
        as the training data is unless calib_split or calib_text_column say otherwise (its dtype, seed and shards
        are the conversion's defaults)."""
        method = {f.name: getattr(self.calibrated_on_data(), f.name) for f in dataclasses.fields(MethodSettings)}
        method.update({f.name: getattr(self, f.name) for f in dataclasses.fields(ShapeSettings)})
        method.update(
            calib_split=self.calib_split or self.split, calib_text_column=self.calib_text_column or self.text_column
        )
        return ConvertSettings(src=self.model, out=str(out), progress=self.progress, **method)

    @property
    def tokens_per_step_per_process(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.seq_len

    def window_problems(self, positions: int | None) -> list[str]:
        """seq_len and eval_seq_len past the model's `positions` (None: not known), each named with them."""
        return [
            f"{key} {n} exceeds the {positions} positions of {self.model}; lower {key}"
            for key, n in (("seq_len", self.seq_len), ("eval_seq_len", self.eval_seq_len))
            if positions and isinstance(n, int) and n > positions
        ]

    def step_problem(self, processes: int) -> str | None:
        """Training tokens fewer than one optimizer step of `processes` processes (it trains nothing: refused before
        anything is planned, loaded or read), or more eval_points than the run's steps (one evaluation per step at
        most). Unknown or broken token counts are other problems."""
        if is_auto(self.micro_batch_size):  # chosen from the tokens when the run begins: a step at least
            return None
        try:
            tokens = self.training_tokens()
        except (TypeError, ValueError, OverflowError):  # pretraining_fraction without pretraining_tokens, or not finite
            return None
        step = self.tokens_per_step_per_process * processes
        if tokens <= 0 or step <= 0:  # a batch or length below 1 is its field's own problem
            return None
        if tokens < step:
            return (
                f"the {tokens:,} training tokens are fewer than one optimizer step of {step:,} "
                "(micro_batch_size x grad_accum x processes x seq_len); raise max_tokens or shrink the batch"
            )
        steps = tokens // step
        if self.eval_points is not None and self.eval_points > steps:
            return (
                f"eval_points {self.eval_points:,} is more than the {steps:,} optimizer steps of this run (its tokens "
                f"over micro_batch_size x grad_accum x processes x seq_len); give at most {steps:,}"
            )
        return None

    def evaluations(self) -> int:
        """eval_points, by default `EVAL_POINTS` (steps that round alike merge: a short run has fewer)."""
        return EVAL_POINTS if self.eval_points is None else self.eval_points

    def checkpoint_due(self, step: int, steps: int, seconds_since: float) -> bool:
        """Whether a run of `steps` checkpoints after `step`, `seconds_since` its last one (or its start): every
        save_every steps and at the end; by default every tenth of the run, or sooner once `CHECKPOINT_SECONDS`
        have passed (a launch's processes must agree on the seconds: each has its own clock)."""
        every = max(1, steps // CHECKPOINTS_PER_RUN) if self.save_every is None else self.save_every
        by_time = self.save_every is None and seconds_since >= CHECKPOINT_SECONDS
        return every > 0 and (step % every == 0 or step == steps or by_time)

    def task_request(self) -> TaskRequest:
        """The lm-evaluation-harness tasks scored at each evaluation (no names: none)."""
        return TaskRequest.of(
            self.eval_tasks,
            num_fewshot=self.eval_num_fewshot,
            limit=self.eval_limit,
            include_path=self.eval_include_path,
            flags=TASK_FLAGS,
        )

    def training_tokens(self) -> int:
        """The tokens the run trains on: max_tokens, else pretraining_fraction × pretraining_tokens."""
        if self.max_tokens is not None:
            return self.max_tokens
        return math.floor(self.pretraining_fraction * self.pretraining_tokens)


# Settings that may change between a run and its resumption without changing what is trained.
RESUMABLE_CHANGES = frozenset(
    {
        "eval_every",
        "eval_points",
        "target_kl",
        "save_every",
        "save_total_limit",
        "log_every",
        "log_to",
        "progress",
        "dist_timeout",
        "shard_teacher",
        "fused_loss",  # the same loss, computed chunk by chunk
        "compile",  # the same layers, compiled
        "push_to_hub",
        "eval_tasks",
        "eval_num_fewshot",
        "eval_limit",
        "eval_include_path",
    }
)

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
    "num_train_epochs": ("max_tokens", "gqaify counts training tokens, not epochs"),
    "max_steps": ("max_tokens", "gqaify counts tokens: steps x micro_batch_size x grad_accum x processes x seq_len"),
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

# `--plan CONFIG`: the memory plan of the run under that accelerate config instead of the run (`plan.py`)
PLAN = Option(
    "--plan",
    "CONFIG",
    "print the bytes each process holds at a step's peak under this accelerate config (a path, or a packaged one "
    "such as accelerate/fsdp), and train nothing",
    missing="--plan needs the accelerate config of the launch, e.g. --plan accelerate/fsdp",
)


def _accelerate_config(values: dict, where: str) -> str | None:
    """The refusal of an accelerate config given as a recipe (`settings.files.is_accelerate_config`), or None."""
    if not is_accelerate_config(values):
        return None
    path = shlex.quote(where.split(" ", 1)[-1])
    return (
        f"{where} is an accelerate config, not a recipe; pass it to `accelerate launch --config_file {path} -m "
        f"gqaify.uptrain --recipe RECIPE`, or to --plan {path} for the memory a run needs under it"
    )


UPTRAIN = Stage(
    settings=UptrainSettings,
    description=f"Uptrain a converted model ({shape_titles()}) to recover its parent's quality. Settings "
    "come from "
    "--recipe (a YAML file of the fields below) and are overridden by --field value.\n\n"
    "  gqaify uptrain --recipe smollm2-135m-mqa --lr 1e-4           (a packaged recipe: gqaify recipes lists them)\n"
    "  gqaify uptrain --recipe recipes/smollm2-135m-mqa.yaml --lr 1e-4\n"
    "  accelerate launch -m gqaify.uptrain --recipe recipes/smollm2-135m-mqa.yaml   (several processes)\n"
    "  gqaify uptrain --recipe llama2-7b-gqa8 --plan accelerate/fsdp   (memory per process under that accelerate "
    "config, before renting GPUs; trains nothing)",
    foreign_names=FOREIGN_NAMES,
    config_flags=("--recipe", "--config"),
    packaged=recipe_by_name,
    foreign_file=_accelerate_config,
    named_by="keys",
    switches=(QUIET,),
    options=(PLAN,),
)


def parse(
    argv: list[str] | None = None, prog: str | None = None, stages: tuple[Stage, ...] | None = None
) -> UptrainSettings:
    """Settings from `--recipe FILE` and `--key value` overrides in `argv`, checked (`UptrainSettings.problems`);
    `stages`, the commands' whose settings files are named as such (default: every declared one,
    `settings.registry`).

    Raises:
        UserError: the recipe is missing, is not a mapping, or has unknown keys; an override is unknown;
            a value is out of range; `--plan`, which asks for a memory plan, not settings to train with.
        SystemExit: --help, or a malformed value (argparse's own one-line error, status 2).
    """
    settings, options = parse_command(UPTRAIN, argv, prog, stages)
    if options[PLAN.flag] is not None:
        raise UserError(
            "--plan asks for a memory plan, which gqaify.uptrain.parse does not give (it returns settings to train "
            "with); call gqaify.uptrain.settings.parse_command_line, or run `gqaify uptrain ... --plan CONFIG`"
        )
    raise_if_problems(settings.problems())
    return settings


def parse_command_line(
    argv: list[str] | None, prog: str, stages: tuple[Stage, ...] | None = None
) -> tuple[UptrainSettings, Path | None]:
    """The settings (`parse`) and the accelerate config `--plan CONFIG` names (None: train, not plan).

    Raises:
        UserError: what `parse` raises but --plan; --plan without a config, or one that is neither a file nor
            packaged (said before the values' problems).
    """
    settings, options = parse_command(UPTRAIN, argv, prog, stages)
    plan = None if options[PLAN.flag] is None else launch_config(options[PLAN.flag])
    problems = settings.problems()  # a recipe's values, before accelerate starts; a local model's positions first
    raise_if_problems(problems and settings.window_problems(local_positions(settings.model)), problems)
    return settings, plan


def load_recipe(path: str | Path, stages: tuple[Stage, ...] | None = None) -> dict:
    """The settings a recipe file holds, as a dict of known keys.

    Raises:
        UserError: no such file, not YAML, not a mapping, or an unknown key (named with the nearest valid one).
    """
    return read_config(UPTRAIN, path, stages)
