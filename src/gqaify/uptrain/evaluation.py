"""What a run measures at each evaluation: perplexity and KL from the parent on each eval text (a panel, with its
mean KL and worst ratio to the parent) and lm-evaluation-harness task scores, logged to metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from gqaify.auto import AUTO
from gqaify.conversion.shapes import shape
from gqaify.eval.perplexity import perplexity
from gqaify.eval.results import EvalText, PanelSummary, TextScore
from gqaify.model.loading import load_model
from gqaify.text.loading import load_text, named_texts, tokenize
from gqaify.uptrain.curve import draw_curve
from gqaify.uptrain.settings import UptrainSettings
from gqaify.uptrain.state import LoopState, RunState


def evaluator(run: RunState, loop: LoopState, texts: dict[str, EvalText] | None, harness, tokenizer):
    """For the run and its loop (`state.RunState`, `state.LoopState`), a function that logs the eval perplexity and KL
    (with eval_data, on the tokens of each of its `texts`: `panel_row`) and task scores (with eval_tasks, through
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
    if texts is not None and run.record.parent_perplexities is None:
        parents = _parent_perplexities(s, reference, reference_name, texts, seq_len, accelerator)
        first = None if parents is None else next(iter(parents.values()))
        run.save_record(parent_perplexity=first, parent_perplexities=parents)
    title = curve_title(s)

    def evaluate() -> None:
        row: dict = {"tokens": loop.progress.tokens, "train_seconds": round(loop.progress.seconds, 3)}
        model.eval()
        if texts is not None:
            row |= panel_row(model, reference, texts, seq_len, run.record.parent_perplexities)
        if harness is not None:
            row |= {score.name: score.value for score in harness.score(accelerator.unwrap_model(model), tokenizer)}
        model.train()
        accelerator.log(row, step=loop.progress.step)
        if texts is not None and accelerator.is_main_process:
            draw_curve(run.out, s.target_kl, run.record.parent_perplexities, title)

    return evaluate


def _stored_runs_parent(s: UptrainSettings, accelerator):
    """The parent a run from stored log-probabilities measures its eval KL from (`parent`), or None."""
    if not (s.distill_from_data and s.parent):
        return None
    model, _ = load_model(s.parent, AUTO, accelerator.device, option="parent", trust_remote_code=s.trust_remote_code)
    return model.requires_grad_(False)


def panel_row(model, teacher, texts: dict[str, EvalText], seq_len: int, parents: dict | None) -> dict:
    """The eval metrics of one evaluation, from each text's `TextScore` and their `PanelSummary` (the summary eval's
    report gives): the first text's perplexity and KL from the teacher (eval_perplexity, eval_kl); with several
    texts, each text's (eval_perplexity/NAME, eval_kl/NAME) and the mean KL (eval_kl_mean); with the parent's
    perplexities, the worst ratio to them (eval_ratio_worst)."""
    scores = [
        TextScore.of(
            name,
            perplexity(model, text.ids, seq_len, seq_len, progress=False, parent=teacher),
            text.words,
            text.text_bytes,
            parents[name] if parents else None,
        )
        for name, text in texts.items()
    ]
    summary = PanelSummary.of(scores)  # None without the parent's perplexities; its KL None without a teacher
    first = scores[0]
    row = {"eval_perplexity": first.perplexity} | ({} if teacher is None else {"eval_kl": first.kl_to_parent})
    if len(scores) > 1:
        for score in scores:
            row[f"eval_perplexity/{score.text}"] = score.perplexity
            if teacher is not None:
                row[f"eval_kl/{score.text}"] = score.kl_to_parent
        if summary is not None and summary.mean_kl_to_parent is not None:  # a teacher comes with the parent's
            row["eval_kl_mean"] = summary.mean_kl_to_parent
    if summary is not None:  # the curve's worst ratio (one text's own where there is one)
        row["eval_ratio_worst"] = summary.worst_ratio_to_parent
    return row


def eval_texts(s: UptrainSettings, tokenizer) -> dict[str, EvalText] | None:
    """Each eval_data text's tokens and span, by name (None without eval_data)."""
    if not s.eval_data:
        return None
    texts = {}
    for named in named_texts(s.eval_data):
        text = load_text(named.source, s.eval_split, s.text_column, option="eval_data").text
        found = tokenize(tokenizer, text, s.eval_tokens, f"eval_data {named.source}")
        texts[named.name] = EvalText.of(found.ids, text[: found.chars])
    return texts


def _parent_perplexities(
    s, loaded, loaded_name: str | None, texts: dict[str, EvalText], seq_len: int, accelerator
) -> dict | None:
    """The parent's perplexity on each eval text, by name, for the ratios and the plot's reference line (computed
    once per run); `loaded` (the model named `loaded_name`: the teacher, or a stored run's parent) is used where
    it is that parent, else the parent is loaded for this."""
    parent = s.parent or s.distill_from or (s.model if s.converts else None)
    if parent is None:
        return None
    model = loaded if loaded is not None and parent == loaded_name else None
    if model is None:
        model, _ = load_model(parent, AUTO, accelerator.device, option="parent", trust_remote_code=s.trust_remote_code)
    found = {name: perplexity(model, t.ids, seq_len, seq_len, progress=False).perplexity for name, t in texts.items()}
    del model
    return found


def curve_title(s: UptrainSettings) -> str:
    """The recovery plot's title: the model, the attention a run that converts gives it, what trains, and whether
    it is distilled, e.g. "ref-mha-6L as GQA-2 (lora, distilled)" (`Shape.run_name`)."""
    return f"{Path(s.model).name}{_converted_to(s)} ({s.trainable}{', distilled' if s.distill_weight > 0 else ''})"


def _converted_to(s: UptrainSettings) -> str:
    return shape(s.attention).run_name(s) if s.converts else ""
