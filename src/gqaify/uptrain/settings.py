"""The settings of an uptraining run: one dataclass, read from a recipe YAML and overridden on the command line.

    accelerate launch -m gqaify.uptrain --recipe recipes/smollm2-135m-mqa.yaml --lr 1e-4 --max_tokens 50000

Every field is a recipe key and a `--key value` option (HfArgumentParser builds both from the dataclass, so
`--help` lists each field with its default and help). The recipe sets defaults; the command line wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from gqaify.conversion.options import METHOD_INFO
from gqaify.errors import UserError, raise_if_problems

TRACKERS = ("csv", "tensorboard", "wandb")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class UptrainSettings:
    # -- the model
    model: str = field(
        default="", metadata=_help("a converted checkpoint, or a source to convert when kv_heads is set")
    )
    kv_heads: int | None = field(default=None, metadata=_help("convert `model` to this many K/V heads first"))
    method: str = field(default="mean", metadata=_help("conversion method when kv_heads is set"))
    grouping: Literal["contiguous", "similarity"] = field(
        default="contiguous", metadata=_help("which heads share a K/V head; similarity needs calib_data")
    )
    calib_data: str | None = field(
        default=None, metadata=_help("calibration text for the conversion (aligned, lsq, similarity); not eval text")
    )
    calib_tokens: int = field(default=32768, metadata=_help("calibration tokens read from calib_data"))
    calib_split: str | None = field(default=None, metadata=_help("split of calib_data (default: split)"))
    calib_mode: Literal["sequential", "parallel"] = field(
        default="sequential", metadata=_help("calibration layer by layer (sequential) or on the parent's activations")
    )
    refine_steps: int = field(default=0, metadata=_help("Adam steps refining each layer during calibration"))
    output_dir: str = field(default="", metadata=_help("folder for checkpoints, metrics, plot and final/"))
    # -- the data
    data: str = field(
        default="", metadata=_help("training text: file/folder (.txt .jsonl .parquet .csv) or hub name[:config]")
    )
    split: str = field(default="train", metadata=_help("split of `data`"))
    text_column: str = field(default="text", metadata=_help("column holding the text (data and eval_data)"))
    streaming: bool = field(
        default=False, metadata=_help("read `data` lazily (datasets streaming) instead of tokenizing it all first")
    )
    seq_len: int = field(default=256, metadata=_help("tokens per packed training block"))
    # -- the budget and batch
    max_tokens: int | None = field(default=None, metadata=_help("training tokens in all (the budget)"))
    budget_fraction: float | None = field(
        default=None, metadata=_help("budget as a fraction of pretraining_tokens (instead of max_tokens)")
    )
    pretraining_tokens: int | None = field(
        default=None, metadata=_help("the parent's pre-training tokens, for budget_fraction")
    )
    micro_batch_size: int = field(default=4, metadata=_help("blocks per forward pass, per process"))
    grad_accum: int = field(default=1, metadata=_help("micro-batches per optimizer step"))
    # -- the optimizer
    lr: float = field(default=3e-4, metadata=_help("peak learning rate (AdamW)"))
    warmup: float = field(default=0.05, metadata=_help("linear warm-up: a fraction of the steps if < 1, else steps"))
    schedule: Literal["cosine", "linear", "constant"] = field(default="cosine", metadata=_help("decay after warm-up"))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay"))
    max_grad_norm: float = field(default=1.0, metadata=_help("gradient clipping norm (0: none)"))
    seed: int = field(default=0, metadata=_help("seed for the data order and the run"))
    mixed_precision: Literal["no", "bf16", "fp16"] | None = field(
        default=None,
        metadata=_help("autocast dtype (default: what accelerate launch was given, e.g. its config file; else no)"),
    )
    gradient_checkpointing: bool = field(default=False, metadata=_help("recompute activations in backward"))
    trainable: Literal["all", "attention", "kv-only"] = field(default="all", metadata=_help("which weights train"))
    # -- distillation
    distill_from: str | None = field(
        default=None, metadata=_help("teacher (the parent): adds KL to its next-token distribution")
    )
    distill_weight: float = field(default=0.5, metadata=_help("loss = (1 - w) * LM loss + w * KL"))
    temperature: float = field(default=1.0, metadata=_help("softmax temperature of the KL term"))
    # -- evaluation, checkpoints, logging
    eval_data: str | None = field(
        default=None, metadata=_help("held-out text for perplexity, same loaders as gqaify eval")
    )
    eval_split: str = field(default="test", metadata=_help("split of eval_data"))
    eval_tokens: int = field(default=16384, metadata=_help("evaluate on the first N tokens of eval_data"))
    eval_seq_len: int | None = field(default=None, metadata=_help("perplexity window (default seq_len)"))
    eval_every: int = field(default=0, metadata=_help("evaluate every N steps (0: at start and end only)"))
    parent: str | None = field(
        default=None,
        metadata=_help(
            "model whose perplexity the plot shows as a line (default distill_from, or the converted source)"
        ),
    )
    save_every: int = field(default=100, metadata=_help("checkpoint every N steps (0: none; resume needs them)"))
    save_total_limit: int = field(default=2, metadata=_help("checkpoints kept"))
    log_every: int = field(default=1, metadata=_help("write metrics every N steps"))
    log_to: list[str] = field(default_factory=list, metadata=_help(f"extra trackers: {', '.join(TRACKERS)}"))
    progress: bool = field(default=True, metadata=_help("show a progress bar"))
    trust_remote_code: bool = field(
        default=False,
        metadata=_help("run the modeling code a model folder carries (gqaify writes it for GPT-2, GPT-NeoX, OPT)"),
    )
    dist_timeout: int = field(
        default=3600,
        metadata=_help("seconds processes wait for each other (the main one converts the model first; raise it "
                       "for a large calibrated conversion, or convert beforehand with gqaify convert)"),
    )  # fmt: skip

    @property
    def tokens_per_step_per_process(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.seq_len

    def budget(self) -> int:
        """The token budget: max_tokens, else budget_fraction × pretraining_tokens."""
        if self.max_tokens is not None:
            return self.max_tokens
        return math.floor(self.budget_fraction * self.pretraining_tokens)


_HINTS = typing.get_type_hints(UptrainSettings)

# Settings that may change between a run and its resumption without changing what is trained.
RESUMABLE_CHANGES = frozenset(
    {"eval_every", "save_every", "save_total_limit", "log_every", "log_to", "progress", "dist_timeout"}
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
}


def check(s: UptrainSettings) -> None:
    """Every problem with `s` in one `UserError` (values only; files are checked where they are opened)."""
    problems = _type_problems(s)
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
    if s.method not in METHOD_INFO:
        problems.append(f"method {s.method!r} is not a conversion method; use one of {', '.join(METHOD_INFO)}")
    elif s.kv_heads is not None and not s.calib_data and (
        METHOD_INFO[s.method].calibrated or s.grouping == "similarity"
    ):
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
    if s.lr <= 0 or s.warmup < 0 or s.weight_decay < 0 or s.max_grad_norm < 0:
        problems.append("lr must be > 0 and warmup, weight_decay, max_grad_norm >= 0; fix the negative value")
    if not 0 <= s.distill_weight <= 1 or s.temperature <= 0:
        problems.append(f"need 0 <= distill_weight <= 1 and temperature > 0, got {s.distill_weight}, {s.temperature}")
    if s.distill_from is None and s.distill_weight > 0 and s.distill_weight != UptrainSettings.distill_weight:
        problems.append("distill_weight is set but distill_from is not; name the teacher with distill_from")
    unknown = [t for t in s.log_to if t not in TRACKERS]
    if unknown:
        problems.append(f"log_to {unknown[0]!r} is not a tracker gqaify knows; use {', '.join(TRACKERS)}")
    raise_if_problems(problems)


def _type_problems(s: UptrainSettings) -> list[str]:
    """Values of the wrong type or outside a field's choices (recipe values bypass argparse's conversion)."""
    problems = []
    for f in dataclasses.fields(s):
        value, hint = getattr(s, f.name), _HINTS[f.name]
        if not _is_a(value, hint):
            problems.append(f"{f.name} {value!r} is not {_describe(hint)}; fix the recipe or the option")
    return problems


def _is_a(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_is_a(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0])}"
    names = {int: "a whole number", float: "a number", str: "text", bool: "true or false", type(None): "empty"}
    return names.get(hint, str(hint))


def build_parser(prog: str = "gqaify uptrain"):
    """transformers' HfArgumentParser over `UptrainSettings`, plus --recipe; usage errors are one line."""
    from transformers.hf_argparser import HfArgumentParser  # the module alone: transformers' top level is slower

    class _Parser(HfArgumentParser):
        def error(self, message: str):
            self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")

    parser = _Parser(
        UptrainSettings,
        prog=prog,
        allow_abbrev=False,  # --max_token must not quietly mean --max_tokens
        description="Uptrain a converted GQA/MQA model to recover its parent's quality. Settings come from "
        "--recipe (a YAML file of the fields below) and are overridden by --field value.",
    )
    parser.add_argument("--recipe", help="YAML file of settings; its keys are the options below")
    return parser


def parse(argv: list[str] | None = None, prog: str = "gqaify uptrain") -> UptrainSettings:
    """Settings from `--recipe FILE` and `--key value` overrides in `argv`.

    Raises:
        UserError: the recipe is missing, is not a mapping, or has unknown keys; an override is unknown;
            a value is out of range.
        SystemExit: --help, or a malformed value (argparse's own one-line error, status 2).
    """
    parser = build_parser(prog)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe")
    recipe, _ = pre.parse_known_args(argv)
    if recipe.recipe:
        parser.set_defaults(**load_recipe(recipe.recipe))
    settings, _recipe, unused = parser.parse_args_into_dataclasses(
        argv, return_remaining_strings=True, look_for_args_file=False
    )
    if unused:
        flags = [a for a in unused if a.startswith("--")] or unused[:1]
        raise_if_problems(
            [f"unknown option {flag}{_nearest(flag.lstrip('-').replace('-', '_'), '--')}" for flag in flags]
        )
    check(settings)
    return settings


def load_recipe(path: str | Path) -> dict:
    """The settings a recipe file holds, as a dict of known keys.

    Raises:
        UserError: no such file, not YAML, not a mapping, or an unknown key (named with the nearest valid one).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist; check the path (recipes/ holds the shipped ones)")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        raise UserError(
            f"recipe {path} is not valid YAML{f' (line {where.line + 1})' if where else ''}; fix it"
        ) from exc
    if not isinstance(values, dict):
        raise UserError(f"recipe {path} must be a mapping of setting: value; see --help for the settings")
    known = {f.name for f in dataclasses.fields(UptrainSettings)}
    raise_if_problems(
        [f"recipe {path}: unknown key {key!r}{_nearest(str(key))}" for key in values if key not in known]
    )
    return values


def _nearest(key: str, prefix: str = "") -> str:
    """" (did you mean lr?)": gqaify's name for a TrainingArguments name, else the closest field name."""
    if key in FOREIGN_NAMES:
        name, note = FOREIGN_NAMES[key]
        return f" (did you mean {prefix}{name}?{' ' + note if note else ''})"
    names = [f.name for f in dataclasses.fields(UptrainSettings)] + ["recipe"]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""
