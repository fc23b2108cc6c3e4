"""What a run measures at each evaluation: perplexity and KL from the parent on each eval text (a panel, with its
mean KL and worst ratio to the parent) and lm-evaluation-harness task scores, logged to metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import torch

from gqaify.data import load_text, named_texts, tokenize
from gqaify.eval.perplexity import perplexity
from gqaify.models import load_model
from gqaify.uptrain.curve import draw_curve
from gqaify.uptrain.settings import UptrainSettings


def evaluator(run, loop, texts: dict[str, torch.Tensor] | None, harness, tokenizer):
    """For the run (`train._Run`) and its loop (`train._Loop`), a function that logs the eval perplexity and KL
    (with eval_data, on the tokens of each of its `texts`: `_panel_row`) and task scores (with eval_tasks, through
    `harness`) at the current step, or None without either; after each evaluation the main process draws the
    recovery curve (`curve.draw_curve`).

    The parent's perplexity on the same tokens is measured once per run and kept in run.json. Every process
    scores the tasks on its model (under FSDP each forward pass needs them all); the main one logs them as
    "task/metric" (`TaskScore.name`).
    """
    if texts is None and harness is None:
        return None
    s, accelerator, model = run.s, run.accelerator, loop.model
    seq_len = s.eval_seq_len or s.seq_len
    # the KL is measured from the live teacher; a run from stored log-probabilities measures it from `parent`
    reference = loop.teacher if loop.teacher is not None or texts is None else _stored_runs_parent(s, accelerator)
    reference_name = s.distill_from if loop.teacher is not None else s.parent  # the model `reference` is
    if texts is not None and "parent_perplexity" not in run.record:
        parents = _parent_perplexities(s, reference, reference_name, texts, seq_len, accelerator)
        run.record["parent_perplexity"] = None if parents is None else next(iter(parents.values()))
        run.record["parent_perplexities"] = parents
        run.save_record()
    title = f"{Path(s.model).name} ({s.trainable}{', distilled' if s.distill_weight > 0 else ''})"

    def evaluate() -> None:
        row: dict = {"tokens": loop.progress.tokens, "train_seconds": round(loop.progress.seconds, 3)}
        model.eval()
        if texts is not None:
            row |= _panel_row(model, reference, texts, seq_len, run.record.get("parent_perplexities"))
        if harness is not None:
            row |= {score.name: score.value for score in harness.score(accelerator.unwrap_model(model), tokenizer)}
        model.train()
        accelerator.log(row, step=loop.progress.step)
        if texts is not None and accelerator.is_main_process:
            draw_curve(run.out, s.target_kl, run.record.get("parent_perplexities"), title)

    return evaluate


def _stored_runs_parent(s: UptrainSettings, accelerator):
    """The parent a run from stored log-probabilities measures its eval KL from (`parent`), or None."""
    if not (s.distill_from_data and s.parent):
        return None
    model, _ = load_model(s.parent, "auto", accelerator.device, option="parent", trust_remote_code=s.trust_remote_code)
    return model.requires_grad_(False)


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
        if parents:  # the curve's worst ratio is this one text's
            row["eval_ratio_worst"] = first.perplexity / next(iter(parents.values()))
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


def eval_texts(s: UptrainSettings, tokenizer) -> dict[str, torch.Tensor] | None:
    """The tokens of each eval_data text, by name (None without eval_data)."""
    if not s.eval_data:
        return None
    texts = {}
    for named in named_texts(s.eval_data):
        text = load_text(named.source, s.eval_split, s.text_column, option="eval_data").text
        texts[named.name] = tokenize(tokenizer, text, s.eval_tokens, f"eval_data {named.source}").ids
    return texts


def _parent_perplexities(
    s, loaded, loaded_name: str | None, texts: dict[str, torch.Tensor], seq_len: int, accelerator
) -> dict | None:
    """The parent's perplexity on each eval text, by name, for the ratios and the plot's reference line (computed
    once per run); `loaded` (the model named `loaded_name`: the teacher, or a stored run's parent) is used where
    it is that parent, else the parent is loaded for this."""
    parent = s.parent or s.distill_from or (s.model if s.kv_heads is not None else None)
    if parent is None:
        return None
    model = loaded if loaded is not None and parent == loaded_name else None
    if model is None:
        model, _ = load_model(
            parent, "auto", accelerator.device, option="parent", trust_remote_code=s.trust_remote_code
        )
    found = {name: perplexity(model, ids, seq_len, seq_len, progress=False).perplexity for name, ids in texts.items()}
    del model
    return found
