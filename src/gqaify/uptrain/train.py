"""The uptraining loop, through accelerate: the same code on a CPU, one GPU, or several with DDP or FSDP.

A run is a pipeline of typed values: the checked inputs (`checks.Inputs`), the run once launched (`state.Launched`),
what it reads before it claims output_dir (`state.RunData`), the claimed run (`state.RunState`) and what its loop
moves (`state.LoopState`). The loop is one optimizer step (`_step`, a `Step`) and what follows it (`_after_step`).
A failure ends in the line `command.raise_as_said` makes of it, with what the run leaves
(`run_folder.left_after_failure`).

    output_dir/
        run.json, checkpoints/, final/   the run's identity, its checkpoints and its model (`run_folder.py`)
        converted/             the converted model, when the run starts from a source and kv_heads
        metrics.jsonl          step, tokens, loss, lr, tokens/s, eval perplexity
        recovery.png           eval perplexity vs tokens, the parent as a line

Each optimizer step consumes `micro_batch_size x grad_accum x processes` blocks of `seq_len` tokens; the run
takes `training tokens // that` steps. A run killed at any moment resumes from its last complete checkpoint and ends
as an uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch

from gqaify.command import raise_as_said
from gqaify.errors import UserError
from gqaify.logs import muted
from gqaify.model.loading import load_config, load_model
from gqaify.progress import announce, progress_bar
from gqaify.records import RunRecord
from gqaify.settings import recorded
from gqaify.uptrain.batch_size import with_batch_chosen
from gqaify.uptrain.checkpoint_files import (
    Progress,
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    resume_point,
    rotate,
    save_checkpoint,
)
from gqaify.uptrain.checks import Inputs, check_inputs
from gqaify.uptrain.curve import PLOT_FILE, Forecast, draw_curve, eval_steps, read_forecast
from gqaify.uptrain.data import training_loader
from gqaify.uptrain.evaluation import curve_title, eval_texts, evaluator
from gqaify.uptrain.lora import merged
from gqaify.uptrain.metrics import (
    METRICS,
    METRICS_CSV,
    CsvTracker,
    JsonlTracker,
    eval_curve,
    read_metrics,
    truncate_metrics,
)
from gqaify.uptrain.run_folder import (
    CHECKPOINTS,
    FINAL,
    Found,
    Trained,
    claim_output_dir,
    claimed_by_launch,
    left_after_failure,
    save_final,
)
from gqaify.uptrain.settings import UptrainSettings
from gqaify.uptrain.sharding import shard_on_cpus, wrap_problem
from gqaify.uptrain.state import Launched, LoopState, RunData, RunState
from gqaify.uptrain.student import (
    compile_layers,
    load_teacher,
    optimizer_and_schedule,
    student_loss,
    trainable_student,
)

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
    forecast: Forecast | None = None  # where the recovery curve says the run stands (recovery.json)


def run(settings: UptrainSettings) -> UptrainResult:
    """Run (or resume) the uptraining `settings` describe. Call it in every process of a launch.

    Raises:
        UserError: bad settings or data, or an output_dir that belongs to another run, cannot be written or has a
            name the file system refuses; nothing is written.
        ResourceError: the disk filled up, or another process of the launch stopped; what was being written is
            removed, and the message says what is left.
        Interrupted: Ctrl-C or SIGTERM; its message says what is on disk and how to go on.
    """
    s = with_batch_chosen(settings)  # micro_batch_size auto: chosen (or kept from the run it resumes) first
    inputs = check_inputs(s)
    out = Path(s.output_dir)
    accelerator = make_accelerator(s, out)
    # run.json records the precision the launcher chose, so that a resume under another one is refused
    launched = Launched(replace(s, mixed_precision=accelerator.mixed_precision), out, accelerator, inputs)
    data = _read_data(launched)  # all of it, before output_dir is touched
    with claimed_by_launch(out, accelerator):  # a second run into output_dir is refused here, writing nothing
        result = _claimed_run(launched, data)
    _end_launch(accelerator)
    return _pushed(launched, result)


def _end_launch(accelerator) -> None:
    """End the launch's process group, once nothing of the run holds it any more.

    DDP's reducer holds a reference to the group. Where the reducer drops the last one (the model freed after
    `destroy_process_group`), gloo's destructor joins its worker threads while holding the GIL, and one of them may
    need the GIL to free the barrier it has just finished: the process then never exits (a rank hung once in eight
    two-process runs on a loaded CPU). So the run's model, optimizer and loader are freed first, garbage collection
    included, and the group goes last: its last reference is then Python's, whose destructor releases the GIL. A
    launch of one process has no group, and skips the collection (a whole pass over the heap)."""
    if accelerator.num_processes > 1:
        accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()


def _read_data(launched: Launched) -> RunData:
    """What the run reads before it claims output_dir (`RunData`): its training batches and its eval texts."""
    s, tokenizer = launched.s, launched.inputs.tokenizer
    _say(launched.accelerator, s, "reading the training and evaluation texts")
    loader, steps, data_sha256 = training_loader(s, tokenizer, launched.inputs.vocab_size, launched.accelerator)
    return RunData(loader, steps, data_sha256, eval_texts(s, tokenizer))


def _claimed_run(launched: Launched, data: RunData) -> UptrainResult:
    """The run in output_dir, claimed: its record, the run, and the line a failure ends with, saying what it leaves
    (`run_folder.left_after_failure`: where it never trained, output_dir as it was found)."""
    s, out, accelerator = launched.s, launched.out, launched.accelerator
    found = Found.of(out, s)
    record = claim_output_dir(out, s, accelerator.num_processes, accelerator, data.data_sha256)
    if record.completed and (out / FINAL).is_dir():
        if accelerator.is_main_process:
            _forecast_for(s, out, record)
        return _result_of_finished_run(out, record)
    this = RunState(s, out, accelerator, record, data.steps)  # its record changes as the run goes (`save_record`)
    try:
        return _run(this, launched.inputs, data)
    except BaseException as exc:
        raise_as_said(exc, left_after_failure(found, data.steps, this.record, accelerator.is_main_process))
        raise


def _forecast_for(s: UptrainSettings, out: Path, record: RunRecord) -> None:
    """A finished run asked again with another target_kl: its forecast made anew for that target (from its
    metrics.jsonl, no model loaded), and said."""
    had = read_forecast(out)
    if had is None or had.target_kl == s.target_kl:
        return
    found = draw_curve(out, s.target_kl, record.parent_perplexities, curve_title(s))
    print(f"the run in {out} is finished; its forecast for target_kl {s.target_kl:g}: {found.sentence()}")


def _pushed(launched: Launched, result: UptrainResult) -> UptrainResult:
    """`result`, its final/ pushed to `push_to_hub` first where that is set (by the main process, in one commit).

    Raises:
        UserError: the hub refused; final/ is complete and the message says how to push it.
    """
    repo = launched.s.push_to_hub
    if repo is not None and launched.accelerator.is_main_process:
        from gqaify._version import __version__
        from gqaify.model.hub import push_folder

        after = f", eval perplexity {result.eval_perplexity:.2f}" if result.eval_perplexity is not None else ""
        push_folder(result.final, repo, f"uptrained by gqaify {__version__}: {result.tokens:,} tokens{after}")
    return result


def _run(run: RunState, inputs: Inputs, data: RunData) -> UptrainResult:
    """The run in a claimed output_dir: model, optimizer, resume, the loop, the final save."""
    from accelerate.utils import set_seed

    s, out, accelerator = run.s, run.out, run.accelerator
    set_seed(s.seed)
    # what it resumes from: the latest of the checkpoints run.json lists; anything else there is left alone
    latest = resume_point(out / CHECKPOINTS, run.record.checkpoints, run.steps, accelerator.is_main_process)

    model_path = _model_to_train(s, out, accelerator)
    _say(accelerator, s, f"loading the model to train ({model_path})" + (" and its teacher" if s.distill_from else ""))
    trust = s.trust_remote_code
    model, _ = load_model(model_path, torch.float32, "cpu", option="model", trust_remote_code=trust)
    saved_dtype = load_config(model_path, option="model", trust_remote_code=trust).dtype or torch.float32
    if problem := wrap_problem(accelerator, model):
        raise UserError(problem)
    model, params = trainable_student(model, s)
    optimizer, scheduler = optimizer_and_schedule(s, params, run.steps, accelerator)
    del params  # FSDP swaps its shards into the optimizer: no reference here may keep the whole weights alive
    # The scheduler is stepped once per optimizer step, not prepared: accelerate would step it once per
    # process, which makes the schedule depend on the number of processes.
    model, optimizer, loader = accelerator.prepare(model, optimizer, data.loader)
    teacher = load_teacher(s, accelerator, accelerator.unwrap_model(model).config.vocab_size)
    if s.compile:  # the layers as prepared (wrapped where FSDP shards them), then each compiled where it is
        compile_layers(accelerator.unwrap_model(model))
        if teacher is not None:
            compile_layers(teacher)
    loop = LoopState(model, teacher, loader, optimizer, scheduler, Progress())
    progress = loop.progress
    if latest is not None:
        load_checkpoint(latest, accelerator, loop, run.steps)
        if accelerator.is_main_process:
            print(f"resuming from {latest} (step {progress.step} of {run.steps})")
    evaluate = evaluator(run, loop, data.texts, inputs.harness, inputs.tokenizer)

    if accelerator.is_main_process:
        truncate_metrics(out, progress.step if latest is not None else -1)
    accelerator.wait_for_everyone()
    accelerator.init_trackers("gqaify-uptrain", config=_loggable(s))
    # FSDP where the launch shards
    run.save_record(started=True, distributed_type=accelerator.distributed_type.value)
    if evaluate and progress.step == 0:
        _say(accelerator, s, "evaluating the start beside the parent, before the first step")
        evaluate()
    _train(run, loop, evaluate)

    final = merged(accelerator.unwrap_model(model)) if s.trainable == "lora" else model  # a plain checkpoint
    save_final(accelerator, final, inputs.tokenizer, Trained(model_path, saved_dtype), out, s, progress, run.record)
    run.save_record(completed=True)
    accelerator.wait_for_everyone()  # every process reads the finished run (`_end_launch` ends the group)
    return _result_of_finished_run(out, run.record)


def _say(accelerator, s, text: str) -> None:
    """`text` on standard error from the main process, before work that shows no bar of its own."""
    announce(text, shown=s.progress and accelerator.is_main_process)


# -- the loop: one optimizer step, then what follows it --------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """What one optimizer step gave: its loss and LM loss (the means over its micro-batches and the processes), the lr
    it stepped at, and the seconds since the last checkpoint (the processes' mean: each process has its own clock,
    and a checkpoint is written by all of them or none)."""

    loss: float
    lm_loss: float
    lr: float
    since_saved: float


@dataclass
class Watch:
    """What the loop keeps between its steps besides `Progress`: the bar, the steps that evaluate, and its clocks
    (`time.perf_counter` seconds): its start and the tokens done then (the bar's rate), when training last resumed
    (`Progress.seconds` counts training alone: the clock restarts after an evaluation or a checkpoint), and the last
    checkpoint (or the start: a default run writes one at least every few minutes)."""

    bar: object  # the tqdm bar (`progress.progress_bar`)
    evaluations: set[int]
    started: float
    tokens_at_start: int
    resumed: float
    saved: float


def _train(run: RunState, loop: LoopState, evaluate) -> None:
    """The loop: from `loop.progress` to `run.steps` optimizer steps (`_step`), each followed by its logging,
    evaluation and checkpoint (`_after_step`).

    Raises:
        UserError: the loss became NaN or infinite (a diverged run): nothing more is saved, final/ is not written.
    """
    s, accelerator, progress = run.s, run.accelerator, loop.progress
    now = time.perf_counter()
    bar = progress_bar(
        total=run.steps,
        initial=progress.step,
        unit="step",
        desc="uptrain",
        shown=s.progress and accelerator.is_main_process,
    )
    watch = Watch(bar, set(eval_steps(run.steps, s.evaluations())), now, progress.tokens, now, now)
    batches = _micro_batches(accelerator, loop)
    while progress.step < run.steps:
        step = _step(run, loop, batches, watch)
        _after_step(run, loop, step, watch, evaluate)
    bar.close()


def _micro_batches(accelerator, loop: LoopState) -> Iterator[dict]:
    """The micro-batches from where `loop.progress` stands, epoch after epoch: the batches a resumed run consumed in
    its epoch are skipped, and each epoch is drawn in its own order (`data.EpochSampler`)."""
    progress, loader = loop.progress, loop.loader
    while True:
        loader.set_epoch(progress.epoch)
        skip = progress.batches_in_epoch  # batches a resumed run already consumed in this epoch
        yield from accelerator.skip_first_batches(loader, skip) if skip else loader
        progress.epoch += 1  # the epoch's batches are used up
        progress.batches_in_epoch = 0


def _step(run: RunState, loop: LoopState, batches: Iterator[dict], watch: Watch) -> Step:
    """One optimizer step: the forward and backward passes of `batches`' micro-batches up to it (grad_accum, or fewer
    where an epoch ends), the clipping, the optimizer's step and the schedule's; `loop.progress` counts it."""
    s, accelerator, progress = run.s, run.accelerator, loop.progress
    model, optimizer, scheduler = loop.model, loop.optimizer, loop.scheduler
    step_loss = torch.zeros(2, device=accelerator.device)  # (loss, LM loss) summed over micro-batches
    window = 0  # micro-batches in this step
    for batch in batches:
        with accelerator.accumulate(model):
            loss, lm_loss = student_loss(model, loop.teacher, batch, s, accelerator)
            accelerator.backward(loss)
            step_loss += torch.stack([loss.detach(), lm_loss])
            window += 1
            if accelerator.sync_gradients:
                if s.max_grad_norm > 0:  # the prepared model's parameters: FSDP replaces the originals
                    accelerator.clip_grad_norm_(model.parameters(), s.max_grad_norm)
                lr = scheduler.get_last_lr()[0]  # the step's: the schedule moves on after it
                optimizer.step()
                if not accelerator.optimizer_step_was_skipped:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        progress.batches_in_epoch += 1
        if accelerator.sync_gradients:
            break
    tokens_per_step = s.tokens_per_step_per_process * accelerator.num_processes
    progress.step += 1
    progress.tokens += tokens_per_step // s.grad_accum * window
    progress.seconds += time.perf_counter() - watch.resumed
    # the micro-batch means, and the seconds since the last checkpoint as the processes' mean
    means = accelerator.reduce(
        torch.cat([step_loss, step_loss.new_tensor([time.perf_counter() - watch.saved])]), "mean"
    )
    loss, lm_loss = (means[:2] / window).tolist()
    return Step(loss, lm_loss, lr, means[2].item())


def _after_step(run: RunState, loop: LoopState, step: Step, watch: Watch, evaluate) -> None:
    """What follows an optimizer step: a loss that is not finite stops the run; the bar moves; the metrics are
    logged, the model evaluated and a checkpoint written where each is due."""
    s, accelerator, progress = run.s, run.accelerator, loop.progress
    if not math.isfinite(step.loss):  # every process reads the same mean: all stop here, none waits
        watch.bar.close()
        raise _diverged(run, progress.step, step.loss)
    rate = (progress.tokens - watch.tokens_at_start) / (time.perf_counter() - watch.started)
    watch.bar.update(1)
    watch.bar.set_postfix(loss=f"{step.loss:.4f}", tok_s=f"{rate:,.0f}")
    if progress.step % s.log_every == 0 or progress.step == run.steps:
        row = {"tokens": progress.tokens, "loss": step.loss, "lm_loss": step.lm_loss, "lr": step.lr}
        accelerator.log(row | {"tokens_per_s": rate, "time": time.time()}, step=progress.step)
    if evaluate and (progress.step in watch.evaluations or s.eval_every and progress.step % s.eval_every == 0):
        evaluate()  # before the checkpoint, so that a resumed run does not evaluate this step again
    if s.checkpoint_due(progress.step, run.steps, seconds_since=step.since_saved):
        _checkpoint(run, loop)
        watch.saved = time.perf_counter()
    watch.resumed = time.perf_counter()


def _checkpoint(run: RunState, loop: LoopState) -> None:
    """A checkpoint of `loop`, listed in run.json before it is written (a run resumes from and removes only the
    checkpoints run.json lists: `checkpoint_files.Checkpoints`), then the run's oldest beyond save_total_limit
    removed, and unlisted."""
    root, name = run.out / CHECKPOINTS, checkpoint_name(loop.progress.step)
    run.save_record(checkpoints=[*(n for n in run.record.checkpoints if n != name), name])
    save_checkpoint(run.accelerator, root / name, loop)
    if run.accelerator.is_main_process:
        removed = rotate(root, run.s.save_total_limit, run.record.checkpoints)
        if removed:  # the main process's record alone: it is the one written
            run.save_record(checkpoints=[n for n in run.record.checkpoints if n not in removed])
    run.accelerator.wait_for_everyone()


def _diverged(run: RunState, step: int, loss: float) -> UserError:
    """The refusal of a run whose loss became `loss` (NaN or infinite) at `step`: the likely cause, and what is kept."""
    s = run.s
    kept = latest_checkpoint(run.out / CHECKPOINTS, run.record.checkpoints)
    cause = (
        f"the stored log-probabilities of data {s.data[0]}, streamed and so checked only as read, may hold a value "
        f"that is not finite (train once without --streaming to check them), or lr {s.lr:g} is too high"
        if s.streaming and s.distill_from_data
        else f"the run diverged, likely lr {s.lr:g} is too high"
    )
    return UserError(
        f"the training loss became {loss} at step {step}: {cause}; lower lr and start again in a new output_dir"
        + (f" ({run.out} keeps its checkpoints up to {kept.name})" if kept else "")
    )


# -- pieces of the run -----------------------------------------------------------------------------------------


def make_accelerator(s: UptrainSettings, out: Path):
    """The Accelerator, with metrics.jsonl (and .csv) trackers; refuses processes that did not join one group. The
    launch's other problems (a tracker not installed, FSDP1 on CPUs) are found with the inputs' (`check_inputs`).

    Raises:
        UserError: the launcher started N processes but accelerate sees fewer (torchrun on a CPU machine
            without ACCELERATE_USE_CPU: every process would train alone).
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    trackers = [JsonlTracker(out / METRICS)]
    if "csv" in s.log_to:
        trackers.append(CsvTracker(out / METRICS_CSV, ("tokens", "loss", "lr", "eval_perplexity")))
    accelerator = Accelerator(
        gradient_accumulation_steps=s.grad_accum,
        mixed_precision=s.mixed_precision,
        log_with=trackers + [t for t in s.log_to if t != "csv"],
        project_dir=out,
        # the other processes wait while the main one converts the model: give them longer than torch's default
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=s.dist_timeout))],
    )
    shard_on_cpus(accelerator)
    if accelerator.device.type == "cuda":  # TF32 for the float32 matrix products left (a run without bf16 above all)
        torch.set_float32_matmul_precision("high")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise UserError(
            f"the launcher started {launched} processes but accelerate joined {accelerator.num_processes}: "
            "without a GPU, launch with ACCELERATE_USE_CPU=1 (accelerate launch --cpu starts a single process "
            "unless MPI is set up)"
        )
    return accelerator


def _model_to_train(s: UptrainSettings, out: Path, accelerator) -> str:
    """`model` itself, or its conversion to `kv_heads` in output_dir/converted (converted once, atomically). A run
    that evaluates measures what a method that reads no text cost (its first evaluation, beside the parent's), so it
    does not also predict that cost in convert's warning, which would speak against a recipe that converts so on
    purpose (ref-mha-6L-gqa2: the GQA paper's start, to recover from)."""
    if not s.converts:
        return s.model
    converted = out / "converted"
    if accelerator.is_main_process and not converted.is_dir():
        from gqaify.conversion.core import convert_with
        from gqaify.conversion.settings import UNCALIBRATED_LOG

        with muted(UNCALIBRATED_LOG) if s.eval_data else contextlib.nullcontext():
            convert_with(s.conversion(converted))
    accelerator.wait_for_everyone()
    return str(converted)


def _result_of_finished_run(out: Path, record: RunRecord) -> UptrainResult:
    rows = read_metrics(out / METRICS)
    losses = [r for r in rows if "loss" in r]
    _, ppl = eval_curve(rows)
    plot = out / PLOT_FILE
    return UptrainResult(
        final=out / "final",
        steps=losses[-1]["step"] if losses else 0,
        tokens=losses[-1]["tokens"] if losses else 0,
        loss=losses[-1]["loss"] if losses else None,
        eval_perplexity=ppl[-1] if ppl else None,
        parent_perplexity=record.parent_perplexity,
        metrics=out / METRICS,
        plot=plot if plot.exists() else None,
        forecast=read_forecast(out),
    )


def _loggable(s: UptrainSettings) -> dict:
    return {k: (v if isinstance(v, (bool, int, float, str)) or v is None else str(v)) for k, v in recorded(s).items()}
