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
import logging
import math
import os
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
from tqdm.auto import tqdm

from gqaify.errors import PEER_STOPPED, ResourceError, UserError, as_interrupt, peer_lost, raise_if_problems
from gqaify.eval.tasks import Harness
from gqaify.model.loading import load_config, load_model, load_tokenizer
from gqaify.output.claims import claimed
from gqaify.output.whole import is_full_disk
from gqaify.records import RunRecord
from gqaify.settings import recorded
from gqaify.uptrain.checks import check_inputs
from gqaify.uptrain.curve import PLOT_FILE, Forecast, draw_curve, eval_steps, read_forecast
from gqaify.uptrain.data import training_loader
from gqaify.uptrain.evaluation import curve_title, eval_texts, evaluator
from gqaify.uptrain.lora import merged
from gqaify.uptrain.report import (
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
    Progress,
    Trained,
    claim_output_dir,
    latest_checkpoint,
    run_files,
    save_checkpoint,
    save_final,
    undo_claim,
    what_is_left,
)
from gqaify.uptrain.settings import UptrainSettings
from gqaify.uptrain.sharding import fsdp_problem, shard_on_cpus
from gqaify.uptrain.state import LoopState, RunState
from gqaify.uptrain.student import load_teacher, optimizer_and_schedule, student_loss, trainable_student

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
    s = settings
    check_inputs(s)
    out = Path(s.output_dir)
    accelerator = make_accelerator(s, out)
    # run.json records the precision the launcher chose, so that a resume under another one is refused
    s = replace(s, mixed_precision=accelerator.mixed_precision)
    # Everything that can be wrong with the data is found before output_dir is touched.
    tokenizer = load_tokenizer(s.model, option="model")
    loader, steps, data_sha256 = training_loader(s, tokenizer, accelerator)
    texts = eval_texts(s, tokenizer)
    request = s.task_request()
    harness = Harness(request) if request.names else None  # reads the tasks' datasets
    with claimed_by_launch(out, accelerator):  # a second run into output_dir is refused here, writing nothing
        result = _claimed_run(s, out, accelerator, tokenizer, loader, steps, data_sha256, texts, harness)
    return _pushed(s, result, accelerator)


def _claimed_run(s: UptrainSettings, out: Path, accelerator, tokenizer, loader, steps, data_sha256, texts, harness):
    """The run in output_dir, claimed: its record, the run, and what a failure before training leaves (output_dir as
    it was found: only what this run wrote there is removed, never what it reads)."""
    existed = out.exists()
    found = run_files(out)
    try:
        record = claim_output_dir(out, s, accelerator.num_processes, accelerator, data_sha256)
    except OSError as exc:
        if not is_full_disk(exc):
            raise
        if not existed:  # run.json is written whole or not at all: the folder made for it is empty
            with contextlib.suppress(OSError):
                out.rmdir()
        raise ResourceError(f"no space left on the disk of output_dir {out}; nothing was written") from exc
    if record.completed and (out / FINAL).is_dir():
        if accelerator.is_main_process:
            _forecast_for(s, out, record)
        return _result_of_finished_run(out, record)
    this = RunState(s, out, accelerator, record, steps)  # its record changes as the run goes (`RunState.save_record`)
    try:
        return _run(this, tokenizer, loader, texts, harness)
    except BaseException as exc:
        lost = peer_lost(exc)  # the launcher may stop this process too (SIGTERM): the peer's stop came first
        stop = None if lost else as_interrupt(exc)
        full = f"no space left on the disk of output_dir {out}" if is_full_disk(exc) else None
        if not this.record.started:  # nothing trained yet: leave output_dir as it was found
            if accelerator.is_main_process:
                undo_claim(out, found, existed, s)
            if lost:
                raise ResourceError(f"{PEER_STOPPED}; nothing was written: rerun the same command") from exc
            if stop is not None:
                raise stop.with_message("nothing was written") from None
            if full is not None:
                raise ResourceError(f"{full}; nothing was written: free some space and rerun") from exc
            raise
        if lost:
            raise ResourceError(f"{PEER_STOPPED}; {what_is_left(out, steps)}") from exc
        if stop is not None:
            raise stop.with_message(what_is_left(out, steps)) from None
        if full is not None:  # what was being written was removed (`written_whole`): what is left is whole
            raise ResourceError(f"{full}; {what_is_left(out, steps)}, once space is freed") from exc
        raise


def _forecast_for(s: UptrainSettings, out: Path, record: RunRecord) -> None:
    """A finished run asked again with another target_kl: its forecast made anew for that target (from its
    metrics.jsonl, no model loaded), and said."""
    had = read_forecast(out)
    if had is None or had.target_kl == s.target_kl:
        return
    found = draw_curve(out, s.target_kl, record.parent_perplexities, curve_title(s))
    print(f"the run in {out} is finished; its forecast for target_kl {s.target_kl:g}: {found.sentence()}")


@contextlib.contextmanager
def claimed_by_launch(out: Path, accelerator):
    """`claims.claimed` on output_dir, held by the launch's main process for the whole run; where another run holds
    it, every process of this launch is refused with the same line.

    Raises:
        UserError: another gqaify run (its pid named) is writing output_dir, or its claim's name holds something
            else.
    """
    from accelerate.utils import broadcast_object_list

    with contextlib.ExitStack() as held:
        said, failed = [None], None  # (refused: True for a UserError, its line), as every rank learns it
        if accelerator.is_main_process:
            try:
                held.enter_context(claimed(out, "gqaify uptrain", option="output_dir", inside=True))
            except BaseException as exc:  # every rank hears of it: none waits for a main process that stopped
                said = [(isinstance(exc, UserError), str(exc))]
                failed = exc
        if accelerator.num_processes > 1:
            broadcast_object_list(said)
        if failed is not None:
            raise failed
        if said[0] is not None:
            refused, line = said[0]
            raise UserError(line) if refused else ResourceError(f"{PEER_STOPPED}; nothing was written: rerun it")
        yield


def _pushed(s: UptrainSettings, result: UptrainResult, accelerator) -> UptrainResult:
    """`result`, its final/ pushed to `push_to_hub` first where that is set (by the main process, in one commit).

    Raises:
        UserError: the hub refused; final/ is complete and the message says how to push it.
    """
    if s.push_to_hub is not None and accelerator.is_main_process:
        from gqaify._version import __version__
        from gqaify.model.hub import push_folder

        after = f", eval perplexity {result.eval_perplexity:.2f}" if result.eval_perplexity is not None else ""
        push_folder(result.final, s.push_to_hub, f"uptrained by gqaify {__version__}: {result.tokens:,} tokens{after}")
    return result


def _run(run: RunState, tokenizer, loader, texts, harness) -> UptrainResult:
    """The run in a claimed output_dir: model, optimizer, resume, the loop, the final save."""
    from accelerate.utils import set_seed

    s, out, accelerator = run.s, run.out, run.accelerator
    set_seed(s.seed)

    model_path = _model_to_train(s, out, accelerator)
    trust = s.trust_remote_code
    model, _ = load_model(model_path, torch.float32, "cpu", option="model", trust_remote_code=trust)
    saved_dtype = load_config(model_path, option="model", trust_remote_code=trust).dtype or torch.float32
    model, params = trainable_student(model, s)
    optimizer, scheduler = optimizer_and_schedule(s, params, run.steps, accelerator)
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
    teacher = load_teacher(s, accelerator, accelerator.unwrap_model(model).config.vocab_size)
    loop = LoopState(model, teacher, loader, optimizer, scheduler, progress)
    evaluate = evaluator(run, loop, texts, harness, tokenizer)

    if accelerator.is_main_process:
        truncate_metrics(out, progress.step if latest is not None else -1)
    accelerator.wait_for_everyone()
    accelerator.init_trackers("gqaify-uptrain", config=_loggable(s))
    # FSDP where the launch shards
    run.save_record(started=True, distributed_type=accelerator.distributed_type.value)
    if evaluate and progress.step == 0:
        evaluate()
    _train(run, loop, evaluate)

    final = merged(accelerator.unwrap_model(model)) if s.trainable == "lora" else model  # a plain checkpoint
    save_final(accelerator, final, tokenizer, Trained(model_path, saved_dtype), out, s, progress, run.record)
    run.save_record(completed=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # last: it also ends the process group
    return _result_of_finished_run(out, run.record)


def _train(run: RunState, loop: LoopState, evaluate) -> None:
    """The loop: from `loop.progress` to `run.steps` optimizer steps, logging, evaluating and checkpointing.

    Raises:
        UserError: the loss became NaN or infinite (a diverged run): nothing more is saved, final/ is not written.
    """
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
    clock = started  # progress.seconds counts training alone: the clock restarts after an evaluation or a save
    saved = started  # the last checkpoint (or the start): a default run writes one at least every few minutes
    at = set(eval_steps(steps, s.evaluations()))
    step_loss = torch.zeros(2, device=accelerator.device)  # (loss, LM loss) summed over micro-batches
    window = 0  # micro-batches since the last optimizer step: grad_accum, or fewer where an epoch ends
    while progress.step < steps:
        loader.set_epoch(progress.epoch)
        skip = progress.batches_in_epoch  # batches a resumed run already consumed in this epoch
        for batch in accelerator.skip_first_batches(loader, skip) if skip else loader:
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
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            progress.tokens += tokens_per_step // s.grad_accum * window
            progress.seconds += time.perf_counter() - clock
            # the micro-batch means, and the seconds since the last checkpoint as the processes' mean (each process
            # has its own clock; a checkpoint is written by all of them or none)
            means = accelerator.reduce(
                torch.cat([step_loss, step_loss.new_tensor([time.perf_counter() - saved])]), "mean"
            )
            loss, lm_loss = (means[:2] / window).tolist()
            if not math.isfinite(loss):  # every process reads the same mean: all stop here, none waits
                bar.close()
                kept = latest_checkpoint(run.out / CHECKPOINTS)
                cause = (
                    f"the stored log-probabilities of data {s.data[0]}, streamed and so checked only as read, may "
                    "hold a value that is not finite (train once without --streaming to check them), or lr "
                    f"{s.lr:g} is too high"
                    if s.streaming and s.distill_from_data
                    else f"the run diverged, likely lr {s.lr:g} is too high"
                )
                raise UserError(
                    f"the training loss became {loss} at step {progress.step}: {cause}; lower lr and start again "
                    "in a new output_dir" + (f" ({run.out} keeps its checkpoints up to {kept.name})" if kept else "")
                )
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
                    "lr": lr,
                    "tokens_per_s": rate,
                    "time": time.time(),
                }
                accelerator.log(row, step=progress.step)
            if evaluate and (progress.step in at or s.eval_every and progress.step % s.eval_every == 0):
                evaluate()  # before the checkpoint, so that a resumed run does not evaluate this step again
            if s.checkpoint_due(progress.step, steps, seconds_since=means[2].item()):
                save_checkpoint(accelerator, run.out / CHECKPOINTS, progress, s.save_total_limit)
                saved = time.perf_counter()
            clock = time.perf_counter()
            if progress.step == steps:
                break
        else:  # the epoch's batches are used up
            progress.epoch += 1
            progress.batches_in_epoch = 0
    bar.close()


# -- pieces of the loop --------------------------------------------------------------------------------------


def make_accelerator(s: UptrainSettings, out: Path):
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
