"""The uptraining loop, through accelerate: the same code on a CPU, one GPU, or several with DDP or FSDP.

    output_dir/
        run.json, checkpoints/, final/   the run's identity, its checkpoints and its model (`run_folder.py`)
        converted/             the converted model, when the run starts from a source and kv_heads
        metrics.jsonl          step, tokens, loss, lr, tokens/s, eval perplexity
        recovery.png           eval perplexity vs tokens, the parent as a line

Each optimizer step consumes `micro_batch_size x grad_accum x processes` blocks of `seq_len` tokens; the run
takes `budget // that` steps. A run killed at any moment resumes from its last complete checkpoint and ends
as an uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import math
import os
import re
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
from tqdm.auto import tqdm

from gqaify.archs import ARCHITECTURES, attention_pattern
from gqaify.data import load_text, named_texts, tokenize
from gqaify.errors import ResourceError, UserError, as_interrupt, problems_in, raise_if_problems
from gqaify.eval.perplexity import perplexity
from gqaify.eval.tasks import Harness
from gqaify.models import load_config, load_model, load_tokenizer, untrusted_problem
from gqaify.outputs import is_full_disk, name_problem, resolve_out, writable_problem
from gqaify.uptrain.data import EpochSampler, mixed, packed_blocks, packed_stored_blocks
from gqaify.uptrain.distill import distillation_kl, stored_kl
from gqaify.uptrain.lora import merged, with_adapters
from gqaify.uptrain.report import (
    METRICS,
    METRICS_CSV,
    CsvTracker,
    JsonlTracker,
    eval_curve,
    plot_recovery,
    read_metrics,
    truncate_metrics,
)
from gqaify.uptrain.run_folder import (
    CHECKPOINTS,
    RUN_FILE,
    Progress,
    Trained,
    claim_output_dir,
    latest_checkpoint,
    save_checkpoint,
    save_final,
    undo_claim,
    what_is_left,
    write_json,
)
from gqaify.uptrain.settings import UptrainSettings
from gqaify.uptrain.sharding import fsdp_problem, shard_on_cpus, sharded_teacher

LOG = logging.getLogger(__name__)
# accelerate warns on every checkpoint that tied weights (lm_head = embed_tokens) are stored once: expected.
logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)


@dataclass(frozen=True)
class UptrainResult:
    final: Path
    steps: int
    tokens: int
    loss: float | None  # the last step's training loss
    eval_perplexity: float | None
    parent_perplexity: float | None
    metrics: Path
    plot: Path | None


def run(settings: UptrainSettings) -> UptrainResult:
    """Run (or resume) the uptraining `settings` describe. Call it in every process of a launch.

    Raises:
        UserError: bad settings or data, or an output_dir that belongs to another run, cannot be written or has a
            name the file system refuses; nothing is written.
        ResourceError: the disk filled up; what was being written is removed, and the message says what is left.
        Interrupted: Ctrl-C or SIGTERM; its message says what is on disk and how to go on.
    """
    s = settings
    _check_inputs(s)
    out = Path(s.output_dir)
    accelerator = _accelerator(s, out)
    # run.json records the precision the launcher chose, so that a resume under another one is refused
    s = replace(s, mixed_precision=accelerator.mixed_precision)
    # Everything that can be wrong with the data is found before output_dir is touched.
    tokenizer = load_tokenizer(s.model, option="model")
    loader, steps, data_sha256 = _data(s, tokenizer, accelerator)
    eval_texts = _eval_texts(s, tokenizer)
    request = s.task_request()
    harness = Harness(request) if request.names else None  # reads the tasks' datasets
    existed = out.exists()
    try:
        record = claim_output_dir(out, s, accelerator.num_processes, accelerator, data_sha256)
    except OSError as exc:
        if not is_full_disk(exc):
            raise
        if not existed:  # run.json is written whole or not at all: the folder made for it is empty
            with contextlib.suppress(OSError):
                out.rmdir()
        raise ResourceError(f"no space left on the disk of output_dir {out}; nothing was written") from exc
    if record.get("completed") and (out / "final").is_dir():
        return _pushed(s, _result_of_finished_run(out, record), accelerator)
    try:
        result = _run(_Run(s, out, accelerator, record, steps), tokenizer, loader, eval_texts, harness)
    except BaseException as exc:
        stop = as_interrupt(exc)
        full = f"no space left on the disk of output_dir {out}" if is_full_disk(exc) else None
        if "started" not in record:  # nothing trained yet: leave output_dir as it was found
            if accelerator.is_main_process:
                undo_claim(out, existed)
            if stop is not None:
                raise stop.with_message("nothing was written") from None
            if full is not None:
                raise ResourceError(f"{full}; nothing was written: free some space and rerun") from exc
            raise
        if stop is not None:
            raise stop.with_message(what_is_left(out, steps)) from None
        if full is not None:  # what was being written was removed (`written_whole`): what is left is whole
            raise ResourceError(f"{full}; {what_is_left(out, steps)}, once space is freed") from exc
        raise
    return _pushed(s, result, accelerator)


def _pushed(s: UptrainSettings, result: UptrainResult, accelerator) -> UptrainResult:
    """`result`, its final/ pushed to `push_to_hub` first where that is set (by the main process, in one commit).

    Raises:
        UserError: the hub refused; final/ is complete and the message says how to push it.
    """
    if s.push_to_hub is not None and accelerator.is_main_process:
        from gqaify._version import __version__
        from gqaify.hub import push_folder

        after = f", eval perplexity {result.eval_perplexity:.2f}" if result.eval_perplexity is not None else ""
        push_folder(result.final, s.push_to_hub, f"uptrained by gqaify {__version__}: {result.tokens:,} tokens{after}")
    return result


@dataclass
class _Run:
    """One run in its claimed output_dir: the settings (as resolved), the folder, the launcher (accelerate's
    `Accelerator`), run.json's record, and the number of optimizer steps."""

    s: UptrainSettings
    out: Path
    accelerator: object
    record: dict
    steps: int

    def save_record(self) -> None:
        if self.accelerator.is_main_process:
            write_json(self.out / RUN_FILE, self.record)


@dataclass
class _Loop:
    """What the loop moves, as accelerate prepared it: the model, its teacher (None without distill_from), the
    data, the optimizer and its schedule, and where the run stands (`Progress`, saved with every checkpoint)."""

    model: torch.nn.Module
    teacher: torch.nn.Module | None
    loader: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    progress: Progress


def _run(run: _Run, tokenizer, loader, eval_texts, harness) -> UptrainResult:
    """The run in a claimed output_dir: model, optimizer, resume, the loop, the final save."""
    from accelerate.utils import set_seed

    s, out, accelerator = run.s, run.out, run.accelerator
    set_seed(s.seed)

    model_path = _model_to_train(s, out, accelerator)
    trust = s.trust_remote_code
    model, _ = load_model(model_path, torch.float32, "cpu", option="model", trust_remote_code=trust)
    saved_dtype = load_config(model_path, option="model", trust_remote_code=trust).dtype or torch.float32
    model, params = trainable_student(model, s)
    optimizer, scheduler = _optimizer(s, params, run.steps, accelerator)
    del params  # FSDP swaps its shards into the optimizer: no reference here may keep the whole weights alive
    # The scheduler is stepped once per optimizer step, not prepared: accelerate would step it once per
    # process, which makes the schedule depend on the number of processes.
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress, scheduler)
    latest = latest_checkpoint(out / CHECKPOINTS)
    if latest is not None:
        accelerator.load_state(str(latest))
        if accelerator.is_main_process:
            print(f"resuming from {latest} (step {progress.step} of {run.steps})")
    teacher = _teacher(s, accelerator, accelerator.unwrap_model(model).config.vocab_size)
    loop = _Loop(model, teacher, loader, optimizer, scheduler, progress)
    evaluate = _evaluator(run, loop, eval_texts, harness, tokenizer)

    if accelerator.is_main_process:
        truncate_metrics(out, progress.step if latest is not None else -1)
    accelerator.wait_for_everyone()
    accelerator.init_trackers("gqaify-uptrain", config=_loggable(s))
    run.record["started"] = True
    run.record["distributed_type"] = accelerator.distributed_type.value  # FSDP where the launch shards
    run.save_record()
    if evaluate and progress.step == 0:
        evaluate()
    _train(run, loop, evaluate)

    if accelerator.is_main_process:
        _plot(out, run.record, s)
    final = merged(accelerator.unwrap_model(model)) if s.trainable == "lora" else model  # a plain checkpoint
    save_final(accelerator, final, tokenizer, Trained(model_path, saved_dtype), out, s, progress, run.record)
    run.record["completed"] = True
    run.save_record()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # last: it also ends the process group
    return _result_of_finished_run(out, run.record)


def _train(run: _Run, loop: _Loop, evaluate) -> None:
    """The loop: from `loop.progress` to `run.steps` optimizer steps, logging, evaluating and checkpointing."""
    s, accelerator, steps, progress = run.s, run.accelerator, run.steps, loop.progress
    model, loader, optimizer, scheduler = loop.model, loop.loader, loop.optimizer, loop.scheduler
    tokens_per_step = s.tokens_per_step_per_process * accelerator.num_processes
    bar = tqdm(
        total=steps,
        initial=progress.step,
        unit="step",
        desc="uptrain",
        disable=not (s.progress and accelerator.is_main_process) or None,
    )
    started, tokens_at_start = time.perf_counter(), progress.tokens
    step_loss = torch.zeros(2, device=accelerator.device)  # (loss, LM loss) summed over micro-batches
    window = 0  # micro-batches since the last optimizer step: grad_accum, or fewer where an epoch ends
    while progress.step < steps:
        loader.set_epoch(progress.epoch)
        skip = progress.batches_in_epoch  # batches a resumed run already consumed in this epoch
        for batch in accelerator.skip_first_batches(loader, skip) if skip else loader:
            with accelerator.accumulate(model):
                loss, lm_loss = _loss(model, loop.teacher, batch, s, accelerator)
                accelerator.backward(loss)
                step_loss += torch.stack([loss.detach(), lm_loss])
                window += 1
                if accelerator.sync_gradients:
                    if s.max_grad_norm > 0:  # the prepared model's parameters: FSDP replaces the originals
                        accelerator.clip_grad_norm_(model.parameters(), s.max_grad_norm)
                    optimizer.step()
                    if not accelerator.optimizer_step_was_skipped:
                        scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
            progress.batches_in_epoch += 1
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            progress.tokens += tokens_per_step // s.grad_accum * window
            loss, lm_loss = (accelerator.reduce(step_loss, "mean") / window).tolist()  # micro-batch means
            step_loss.zero_()
            window = 0
            rate = (progress.tokens - tokens_at_start) / (time.perf_counter() - started)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}")
            if progress.step % s.log_every == 0 or progress.step == steps:
                row = {
                    "tokens": progress.tokens,
                    "loss": loss,
                    "lm_loss": lm_loss,
                    "lr": scheduler.get_last_lr()[0],
                    "tokens_per_s": rate,
                    "time": time.time(),
                }
                accelerator.log(row, step=progress.step)
            if evaluate and (progress.step == steps or s.eval_every and progress.step % s.eval_every == 0):
                evaluate()  # before the checkpoint, so that a resumed run does not evaluate this step again
            if s.save_every and (progress.step % s.save_every == 0 or progress.step == steps):
                save_checkpoint(accelerator, run.out / CHECKPOINTS, progress, s.save_total_limit)
            if progress.step == steps:
                break
        else:  # the epoch's batches are used up
            progress.epoch += 1
            progress.batches_in_epoch = 0
    bar.close()


# -- pieces of the loop --------------------------------------------------------------------------------------


def _accelerator(s: UptrainSettings, out: Path):
    """The Accelerator, with metrics.jsonl (and .csv) trackers; refuses processes that did not join one group.

    Raises:
        UserError: a tracker in log_to is not installed.
        UserError: the launcher started N processes but accelerate sees fewer (torchrun on a CPU machine
            without ACCELERATE_USE_CPU: every process would train alone).
    """
    from accelerate import Accelerator
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import InitProcessGroupKwargs

    available = {str(t) for t in get_available_trackers()} | {"csv"}
    missing = [t for t in s.log_to if t not in available]  # accelerate would drop them without a word
    if missing:
        raise UserError(f"log_to {missing[0]} needs its package; pip install {missing[0]}")
    trackers = [JsonlTracker(out / METRICS)]
    if "csv" in s.log_to:
        trackers.append(CsvTracker(out / METRICS_CSV, ("tokens", "loss", "lr", "eval_perplexity")))
    raise_if_problems(fsdp_problem())
    accelerator = Accelerator(
        gradient_accumulation_steps=s.grad_accum,
        mixed_precision=s.mixed_precision,
        log_with=trackers + [t for t in s.log_to if t != "csv"],
        project_dir=out,
        # the other processes wait while the main one converts the model: give them longer than torch's default
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=s.dist_timeout))],
    )
    shard_on_cpus(accelerator)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise UserError(
            f"the launcher started {launched} processes but accelerate joined {accelerator.num_processes}: "
            "without a GPU, launch with ACCELERATE_USE_CPU=1 (accelerate launch --cpu starts a single process "
            "unless MPI is set up)"
        )
    return accelerator


def _data(s: UptrainSettings, tokenizer, accelerator):
    """(DataLoader of packed blocks, optimizer steps in the budget, SHA-256 of the blocks' tokens: all of them, or
    when streaming the first step's, which are all that is read before training).

    Raises:
        UserError: the budget is less than one step, or the data packs into fewer blocks than one step needs.
    """
    from torch.utils.data import DataLoader

    sources = named_texts(s.data)
    with accelerator.main_process_first():  # the main process tokenizes; the others read datasets' cache
        if s.distill_from_data:
            vocab = load_config(s.model, option="model", trust_remote_code=s.trust_remote_code).vocab_size
            blocks = [packed_stored_blocks(t.source, s.split, s.seq_len, s.streaming, vocab) for t in sources]
        else:
            blocks = [
                packed_blocks(t.source, s.split, s.text_column, tokenizer, s.seq_len, s.streaming) for t in sources
            ]
        if len(blocks) == 1:
            blocks = blocks[0]
        else:
            blocks, counts = mixed(blocks, s.data_weights, s.seed)
            if counts is not None:
                LOG.info("data: %s", ", ".join(f"{t.name} {n:,} blocks" for t, n in zip(sources, counts, strict=True)))
    tokens_per_step = s.tokens_per_step_per_process * accelerator.num_processes
    steps = s.budget() // tokens_per_step
    if steps < 1:
        raise UserError(
            f"the budget of {s.budget():,} tokens is less than one optimizer step of {tokens_per_step:,} "
            "(micro_batch_size x grad_accum x processes x seq_len); raise the budget or shrink the batch"
        )
    blocks_per_step = s.micro_batch_size * s.grad_accum * accelerator.num_processes
    if s.streaming:  # the size is unknown: read as far as one step needs
        head = [block["input_ids"] for block in itertools.islice(blocks, blocks_per_step)]
        if (found := len(head)) < blocks_per_step:
            raise UserError(
                f"data {' '.join(s.data)} packs into {found} blocks of {s.seq_len} tokens, fewer than one step's "
                f"{blocks_per_step}; give more text, or lower seq_len or the batch"
            )
        shuffled = blocks.shuffle(seed=s.seed, buffer_size=10_000)
        return DataLoader(shuffled, batch_size=s.micro_batch_size, drop_last=True), steps, _tokens_sha256(head)
    if len(blocks) < blocks_per_step:
        raise UserError(
            f"data {' '.join(s.data)} packs into {len(blocks)} blocks of {s.seq_len} tokens, fewer than one step's "
            f"{blocks_per_step}; give more text, or lower seq_len or the batch"
        )
    sampler = EpochSampler(len(blocks), s.seed, blocks_per_step)
    loader = DataLoader(blocks, batch_size=s.micro_batch_size, sampler=sampler, drop_last=True)
    return loader, steps, _tokens_sha256(batch["input_ids"] for batch in blocks.iter(batch_size=1024))


def _tokens_sha256(ids) -> str:
    """SHA-256 of token ids (tensors of them, in order, as int64): what run.json records of the data."""
    digest = hashlib.sha256()
    for t in ids:
        digest.update(t.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()


def _optimizer(s: UptrainSettings, params: list[torch.nn.Parameter], steps: int, accelerator):
    """AdamW over `params` (matrices decay; norms and biases do not) and its warm-up + decay schedule."""
    from accelerate.utils import DistributedType
    from transformers import get_scheduler

    decay = [p for p in params if p.ndim >= 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": [p for p in params if p.ndim < 2]}]
    # torch's fused AdamW (one kernel for all tensors: 7x faster than the default on this CPU); not with FSDP,
    # whose sharded parameters accelerate swaps into the optimizer after prepare.
    fused = accelerator.distributed_type != DistributedType.FSDP
    optimizer = torch.optim.AdamW(groups, lr=s.lr, weight_decay=0.0, fused=fused)
    warmup = math.ceil(s.warmup * steps) if s.warmup < 1 else int(s.warmup)
    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[s.schedule]
    return optimizer, get_scheduler(name, optimizer, num_warmup_steps=min(warmup, steps), num_training_steps=steps)


def _teacher(s: UptrainSettings, accelerator, vocab_size: int):
    """The distillation teacher in eval mode on this process's device, or None.

    Raises:
        UserError: its vocabulary differs from the student's.
    """
    if not s.distill_from:
        return None
    teacher, _ = load_model(
        s.distill_from, "auto", accelerator.device, option="distill_from", trust_remote_code=s.trust_remote_code
    )
    teacher.requires_grad_(False)
    if teacher.config.vocab_size != vocab_size:
        raise UserError(
            f"distill_from {s.distill_from} has a vocabulary of {teacher.config.vocab_size}, the model "
            f"{vocab_size}; distil from the model's parent"
        )
    return sharded_teacher(teacher, accelerator) if s.shard_teacher else teacher


def _evaluator(run: _Run, loop: _Loop, texts: dict[str, torch.Tensor] | None, harness, tokenizer):
    """A function that logs the eval perplexity and KL (with eval_data, on the tokens of each of its `texts`:
    `_panel_row`) and task scores (with eval_tasks, through `harness`) at the current step, or None without either.

    The parent's perplexity on the same tokens is measured once per run and kept in run.json. Every process
    scores the tasks on its model (under FSDP each forward pass needs them all); the main one logs them as
    "task/metric" (`TaskScore.name`).
    """
    if texts is None and harness is None:
        return None
    s, accelerator, model, teacher = run.s, run.accelerator, loop.model, loop.teacher
    seq_len = s.eval_seq_len or s.seq_len
    if texts is not None and "parent_perplexity" not in run.record:
        parents = _parent_perplexities(s, teacher, texts, seq_len, accelerator)
        run.record["parent_perplexity"] = None if parents is None else next(iter(parents.values()))
        run.record["parent_perplexities"] = parents
        run.save_record()

    def evaluate() -> None:
        row: dict = {"tokens": loop.progress.tokens}
        model.eval()
        if texts is not None:
            row |= _panel_row(model, teacher, texts, seq_len, run.record.get("parent_perplexities"))
        if harness is not None:
            row |= {score.name: score.value for score in harness.score(accelerator.unwrap_model(model), tokenizer)}
        model.train()
        accelerator.log(row, step=loop.progress.step)

    return evaluate


def _loss(model, teacher, batch: dict, s: UptrainSettings, accelerator) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to train on, the LM loss alone): transformers' LM loss over every next token, mixed with the
    KL to the parent: the teacher's, or from the top-k stored with the data (distill_from_data)."""
    ids = batch["input_ids"]
    out = model(input_ids=ids, labels=ids, use_cache=False)
    if s.distill_weight == 0 or (teacher is None and not s.distill_from_data):
        return out.loss, out.loss.detach()
    if s.distill_from_data:
        kl = stored_kl(out.logits, batch["top_ids"], batch["top_logprobs"])
    else:
        with torch.no_grad(), accelerator.autocast():
            target = teacher(input_ids=ids, use_cache=False).logits
        kl = distillation_kl(out.logits, target, s.temperature)
    return (1 - s.distill_weight) * out.loss + s.distill_weight * kl, out.loss.detach()


def trainable_student(model, s: UptrainSettings) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """(`model` set up to train as `s` says: train mode, gradient checkpointing, LoRA adapters or the parameters
    that train (`_trainable`); the parameters that train). The memory plan sets up its student here too."""
    model.train()
    if s.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return _trainable(model, s)


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
        attention = attention_pattern(model.config.model_type, f"trainable {trainable}")
        spec = ARCHITECTURES[model.config.model_type]
        if trainable == "attention":
            pattern = rf"{attention}\."
        else:
            if spec.qkv_proj:
                raise UserError(
                    f"trainable kv-only: {model.config.model_type} fuses Q, K and V in one tensor; "
                    "use trainable attention"
                )
            pattern = rf"{attention}\.({'|'.join(re.escape(k) for k in spec.kv_modules())})\."
        names = {n for n in names if re.match(pattern, n)}
    for name, param in model.named_parameters():
        param.requires_grad_(name in names)
    return [p for n, p in model.named_parameters() if n in names]


def _panel_row(model, teacher, texts: dict[str, torch.Tensor], seq_len: int, parents: dict | None) -> dict:
    """The eval metrics of one evaluation: the first text's perplexity and KL from the teacher (eval_perplexity,
    eval_kl); with several texts, each text's (eval_perplexity/NAME, eval_kl/NAME), the mean KL (eval_kl_mean) and
    the worst ratio to the parent's perplexity (eval_ratio_worst)."""
    scores = {
        name: perplexity(model, ids, seq_len, seq_len, progress=False, parent=teacher) for name, ids in texts.items()
    }
    first = next(iter(scores.values()))
    row = {"eval_perplexity": first.perplexity} | ({} if teacher is None else {"eval_kl": first.kl})
    if len(scores) == 1:
        return row
    for name, found in scores.items():
        row[f"eval_perplexity/{name}"] = found.perplexity
        if teacher is not None:
            row[f"eval_kl/{name}"] = found.kl
    if teacher is not None:
        row["eval_kl_mean"] = sum(found.kl for found in scores.values()) / len(scores)
    if parents:
        row["eval_ratio_worst"] = max(found.perplexity / parents[name] for name, found in scores.items())
    return row


def _eval_texts(s: UptrainSettings, tokenizer) -> dict[str, torch.Tensor] | None:
    """The tokens of each eval_data text, by name (None without eval_data)."""
    if not s.eval_data:
        return None
    texts = {}
    for named in named_texts(s.eval_data):
        text = load_text(named.source, s.eval_split, s.text_column, option="eval_data").text
        texts[named.name] = tokenize(tokenizer, text, s.eval_tokens, f"eval_data {named.source}").ids
    return texts


def _parent_perplexities(s, teacher, texts: dict[str, torch.Tensor], seq_len: int, accelerator) -> dict | None:
    """The parent's perplexity on each eval text, by name, for the ratios and the plot's reference line (computed
    once per run)."""
    parent = s.parent or s.distill_from or (s.model if s.kv_heads is not None else None)
    if parent is None:
        return None
    model = teacher if parent == s.distill_from and teacher is not None else None
    if model is None:
        model, _ = load_model(
            parent, "auto", accelerator.device, option="parent", trust_remote_code=s.trust_remote_code
        )
    found = {name: perplexity(model, ids, seq_len, seq_len, progress=False).perplexity for name, ids in texts.items()}
    del model
    return found


def _check_inputs(s: UptrainSettings) -> None:
    """Every problem at once: the settings' (`UptrainSettings.problems`); output_dir is a folder or absent; the models
    exist; the windows fit in the model's positions."""
    problems = s.problems()
    if s.output_dir:
        problems += problems_in(_output_dir_problem(s.output_dir))
    configs = {}
    for key in ("model", "distill_from", "parent"):
        if value := getattr(s, key):
            try:
                # exists and is a model
                configs[key] = load_config(value, option=key, trust_remote_code=s.trust_remote_code)
            except UserError as exc:
                problems.append(str(exc))
    model_type = getattr(configs.get("model"), "model_type", None)
    spec = ARCHITECTURES.get(model_type)
    if s.trainable != "all" and model_type is not None:  # before the model is loaded
        try:
            attention_pattern(model_type, f"trainable {s.trainable}")
        except UserError as exc:
            problems.append(str(exc))
    if s.kv_heads is not None and spec is not None and spec.shipped_class and not s.trust_remote_code:
        problems.append(untrusted_problem(f"model {s.model} converted to {s.kv_heads} K/V heads is a class that"))
    positions = getattr(configs.get("model"), "max_position_embeddings", None)
    for key, length in (("seq_len", s.seq_len), ("eval_seq_len", s.eval_seq_len)):
        if positions and length and length > positions:
            problems.append(f"{key} {length} exceeds the {positions} positions of {s.model}; lower {key}")
    raise_if_problems(problems)


def _output_dir_problem(output_dir: str) -> str | None:
    """Why output_dir cannot hold the run: a name the file system refuses, a file, a folder that cannot be written."""
    if problem := name_problem(output_dir, "output_dir", beside=False):  # nothing beside it: no room to leave
        return problem
    out = resolve_out(output_dir)
    if out.exists() and not out.is_dir():
        return f"output_dir {out} is a file; choose a folder"
    return writable_problem(out, "output_dir")


def _model_to_train(s: UptrainSettings, out: Path, accelerator) -> str:
    """`model` itself, or its conversion to `kv_heads` in output_dir/converted (converted once, atomically)."""
    if s.kv_heads is None:
        return s.model
    converted = out / "converted"
    if accelerator.is_main_process and not converted.is_dir():
        from gqaify.conversion.core import convert_with

        convert_with(s.conversion(converted))
    accelerator.wait_for_everyone()
    return str(converted)


def _plot(out: Path, record: dict, s: UptrainSettings) -> None:
    curve = eval_curve(read_metrics(out / METRICS))
    if curve[0]:
        distilled = ", distilled" if s.distill_from and s.distill_weight > 0 else ""
        label = f"{Path(s.model).name} ({s.trainable}{distilled})"
        plot_recovery({label: curve}, record.get("parent_perplexity"), out / "recovery.png", "uptraining recovery")


def _result_of_finished_run(out: Path, record: dict) -> UptrainResult:
    rows = read_metrics(out / METRICS)
    losses = [r for r in rows if "loss" in r]
    _, ppl = eval_curve(rows)
    plot = out / "recovery.png"
    return UptrainResult(
        final=out / "final",
        steps=losses[-1]["step"] if losses else 0,
        tokens=losses[-1]["tokens"] if losses else 0,
        loss=losses[-1]["loss"] if losses else None,
        eval_perplexity=ppl[-1] if ppl else None,
        parent_perplexity=record.get("parent_perplexity"),
        metrics=out / METRICS,
        plot=plot if plot.exists() else None,
    )


def _loggable(s: UptrainSettings) -> dict:
    return {k: (v if isinstance(v, (bool, int, float, str)) or v is None else str(v)) for k, v in asdict(s).items()}
