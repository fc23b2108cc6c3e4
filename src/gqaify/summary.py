"""What a conversion or an uptraining run did, in a few lines for the terminal (the CLI and the demo print them)."""

from __future__ import annotations


def format_summary(result) -> str:
    """A few lines saying what a conversion did."""
    kind = result.attention
    before, after = result.kv_bytes_per_token_before, result.kv_bytes_per_token_after
    rewrite = (
        result.record.rewrite
    )  # the G-head model rewritten as another shape (`conversion.shape_contract.ShapeRecord`)
    method = f" with --method {result.method}"
    if rewrite is not None and (heads := rewrite.heads(result.source_kv_heads, result.num_heads)):
        method, fitted = "", []  # the G-head conversion was not what was kept: its lines go
    else:
        heads = f"{result.source_kv_heads} -> {result.kv_heads} ({result.num_heads} query heads; groups "
        heads += f"{_groups(result.groups)})"
        fitted = _fit_lines(result)
    return "\n".join(
        [
            f"converted {result.model_type} to {kind}{method} in {result.seconds:.2f} s",
            f"  K/V heads       {heads}",
            f"  KV cache/token  {before:,} -> {after:,} bytes ({before / after:g}x smaller)",
            *fitted,
            *(rewrite.summary_lines() if rewrite is not None else []),
            f"  tensors         {result.tensors_converted} rewritten, {result.tensors_copied} copied, "
            f"{result.num_shards} shard(s), {result.bytes_written / 1e6:,.1f} MB",
            f"  saved to        {printable(result.out)}",
        ]
    )


def _fit_lines(result) -> list[str]:
    lines = []
    if result.permutations is not None:
        lines.append(f"  grouping        similarity (layer 0 order {result.permutations[0]}; all in gqaify.json)")
    if result.fits:
        parts = []
        for key, name in (("k", "scores"), ("v", "outputs")):
            errors = [getattr(fit, key) for fit in result.fits if getattr(fit, key) is not None]
            if errors:
                parts.append(f"{name} {sum(errors) / len(errors):.3f}")
        lines.append(
            f"  fit error       {', '.join(parts)} (mean relative, on calibration text; per layer in gqaify.json)"
        )
        last = result.fits[-1]
        if last.out is not None:
            repaired = sum(bool(fit.repaired) for fit in result.fits)
            lines.append(
                f"  layer outputs   {last.out:.3f} relative error after the last layer; "
                f"{repaired} of {len(result.fits)} layers repaired, {last.refined} refine steps each"
            )
        seconds = result.calibration_seconds
        lines.append(
            f"  calibration     {seconds['total']:.1f} s (capture {seconds['capture']:.1f}, fit {seconds['fit']:.1f}, "
            f"repair {seconds['repair']:.1f}, refine {seconds['refine']:.1f}, converted pass {seconds['run']:.1f})"
        )
    return lines


def format_uptrain_summary(result) -> str:
    """A few lines saying what an uptraining run did."""
    lines = [f"uptrained {result.steps} steps, {result.tokens:,} tokens; final training loss {result.loss:.4f}"]
    if result.eval_perplexity is not None:
        parent = f" (parent {result.parent_perplexity:.2f})" if result.parent_perplexity is not None else ""
        lines.append(f"  eval perplexity {result.eval_perplexity:.2f}{parent}")
    if result.forecast is not None:
        lines.append(f"  recovery        {result.forecast.sentence()}")
    lines.append(f"  model           {printable(result.final)}")
    plot = f", plot {printable(result.plot)}" if result.plot else ""
    lines.append(f"  metrics         {printable(result.metrics)}{plot}")
    return "\n".join(lines)


def _groups(groups: list[list[int]]) -> str:
    shown = ["[" + ",".join(map(str, g)) + "]" for g in groups[:4]]
    return " ".join(shown) + (" ..." if len(groups) > 4 else "")


def format_corpus_summary(corpus) -> str:
    """A few lines saying what `gqaify generate` wrote."""
    if corpus.resumed_from == corpus.shards:
        resumed = " (all on disk already)"
    else:
        resumed = f" (resumed after shard {corpus.resumed_from})" if corpus.resumed_from else ""
    past = corpus.asked is not None and corpus.tokens > corpus.asked  # the last shard filled whole
    asked = f" (--tokens {corpus.asked:,}, its last shard filled whole)" if past else ""
    return "\n".join(
        [
            f"{'scored' if corpus.scored else 'sampled'} {corpus.tokens:,} tokens{asked} in {corpus.samples:,} "
            f"{'blocks' if corpus.scored else 'samples'}, {corpus.shards} shard(s){resumed}",
            f"  saved to        {printable(corpus.out)}",
            "  use it as       --calib-data OUT, uptrain's data: OUT, gqaify eval --data OUT, datasets.load_dataset",
        ]
    )


def printable(path) -> str:
    """`path` as text on one line: as it is, or quoted with escapes where it holds a newline or another control
    character (a path may hold any character but / and NUL; a summary line must stay one line)."""
    text = str(path)
    return text if text.isprintable() else repr(text)
