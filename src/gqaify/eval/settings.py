"""The settings of `gqaify eval` (imports nothing heavy: the command line reads their defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from gqaify.auto import AUTO
from gqaify.eval.caches.formats import FULL, format_problem
from gqaify.eval.tasks import TaskRequest
from gqaify.settings import QUIET, Limit, Positional, Range, Stage, override, setting
from gqaify.settings.groups import Output, Runtime
from gqaify.text.pins import Pin, sha256_problem
from gqaify.text.settings import Texts

# data_sha256: the texts a rerun from a report must evaluate
DATA_PIN = Pin("data_sha256", "evaluation", "its perplexities would differ", "evaluate")
# batches beyond this are no serving batch: each row holds a KV cache of --decode-context + --decode-tokens tokens
DECODE_BATCH_MAX = 4096
SEQ_LEN_MOST = 2048  # the window where --seq-len is not set and the models have more positions


RETRIEVAL_SHORTEST = 64  # tokens: a retrieval prompt holds an instruction, a key and a question beside its filler


def _retrieval_problem(lengths: list[int], name: str) -> str | None:
    short = [n for n in lengths if n < RETRIEVAL_SHORTEST]
    return short and f"{name} {short[0]} is too short for a retrieval prompt; give {RETRIEVAL_SHORTEST} tokens or more"


@dataclass(frozen=True)
class EvalSettings(Output, Runtime):
    """What `gqaify eval` measures, and on what: the command line's options, a --config file's keys, and the
    fields of `gqaify.evaluate`'s `settings`. report.json records them."""

    models: list[str] = setting(
        [], "the parent first, then the models to compare (hub ids, folders, .gguf files)", required=True
    )
    data = Texts(  # data, split, text_column
        "the texts to evaluate on", "a panel: each reported, with the mean and worst", required=True, split="test"
    )
    out = override(help="folder for the report")
    force = override(help="replace --out if it is empty or a report gqaify wrote (nothing else)")
    data_sha256: str | None = setting(
        None,
        "SHA-256 of the texts --data must hold (report.json records it, so that a rerun refuses text that changed "
        "since); '' evaluates any text",
        check=sha256_problem,
    )
    seq_len: int | None = setting(
        None, f"window length in tokens (default: the models' positions, at most {SEQ_LEN_MOST:,})", check=Range(2)
    )
    stride: int | None = setting(
        None, "tokens between window starts (default: seq_len, no overlap)", check=Range(1, "seq_len")
    )
    max_tokens: int | None = setting(None, "evaluate only the first N tokens of the text", check=Range(2))
    batch_size: int = setting(1, "windows (and task requests) per forward pass", check=Range(1))
    memory_budget: str = setting(  # a size, or auto
        AUTO,
        "memory for weights + KV cache, for the context that fits, like 80GB or 24GiB (auto: the GPU's where the "
        "models run on one, else this machine's)",
    )
    decode_context: int = setting(512, "prefill tokens before decoding", check=Range(1))
    decode_tokens: int = setting(32, "greedy tokens decoded", check=Range(1))
    decode_batch: int = setting(
        8,
        "the larger decode batch",
        check=(Range(1), Limit(DECODE_BATCH_MAX, "each row holds its own KV cache and its prefill")),
    )
    repeats: int = setting(5, "timed runs of each model, in turns with the parent's", check=Range(1))
    diag_tokens: int = setting(512, "tokens for the attention diagnostics", check=Range(1))
    speed: bool = setting(True, "measure decode speed")
    tasks: list[str] = setting(
        [], "lm-evaluation-harness tasks to score, comma- or space-separated (needs pip install 'gqaify[tasks]')"
    )
    num_fewshot: int | None = setting(None, "few-shot examples per task (default: each task's own)")
    limit: float | None = setting(None, "score only the first N items of each task (or a fraction below 1)")
    include_path: str | None = setting(None, "folder of local task YAMLs, for --tasks")
    generate: list[str] | None = setting(
        None,
        "greedy continuations of PROMPT... side by side in report.md (--generate alone: two default prompts)",
        empty_list=True,
    )
    generate_tokens: int = setting(40, "tokens generated per prompt", check=Range(1))
    kv_cache: list[str] = setting(
        [FULL],
        "KV cache formats to serve each model with: f16 (whole); llama.cpp's q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl "
        "(or K/V apart: q8_0/q4_0) for .gguf models; transformers' quanto4, quanto2, fp8. Each model x format is a "
        "point of the frontier (report.md, frontier.png), with the verdict per budget",
        check=format_problem,
    )
    retrieval: list[int] = setting(
        [],
        "prompt lengths in tokens for a pass-key retrieval check (a key planted at five depths and asked for), "
        "under each --kv-cache format",
        check=_retrieval_problem,
    )

    def problems(self) -> list[str]:
        """Everything wrong with the values, at once: their declarations', and the task knobs' (`TaskRequest`);
        `evaluate` adds what the files and models say (--out, --memory-budget read as bytes, each model's
        positions)."""
        return EVAL.declared_problems(self) + self.task_request().problems()

    def task_request(self) -> TaskRequest:
        """The lm-evaluation-harness tasks to score (no names: none)."""
        return TaskRequest.of(
            self.tasks,
            num_fewshot=self.num_fewshot,
            limit=self.limit,
            include_path=self.include_path,
            batch_size=self.batch_size,
        )


# Names users bring from lm-evaluation-harness, transformers' generate and perplexity guides, and what gqaify calls
# them: an unknown key or option that is one of these is answered with its gqaify name, not the nearest spelling
# (--max-new-tokens is not --max-tokens).
FOREIGN_NAMES = {
    "max_new_tokens": ("generate_tokens", ""),
    "prompt": ("generate", "--generate PROMPT..."),
    "prompts": ("generate", "--generate PROMPT..."),
    "model": ("models", "or MODEL... as arguments"),
    "model_name_or_path": ("models", ""),
    "dataset": ("data", ""),
    "dataset_name": ("data", ""),
    "output_path": ("out", ""),
    "output_dir": ("out", ""),
    "max_length": ("seq_len", "the window length"),
    "torch_dtype": ("dtype", ""),
}

EVAL = Stage(
    settings=EvalSettings,
    description="Evaluate MODEL... (hub ids, folders or .gguf files; the first is the parent) on the same text and "
    "windows, and write report.json, report.md and PNG plots to --out.\n\n"
    "  gqaify eval PARENT CONVERTED --data wiki.txt --out report\n"
    "  gqaify eval PARENT CONVERTED --data wiki=wiki.txt code=code.txt verse=verse.txt --out report   (a panel)\n"
    "  gqaify eval PARENT CONVERTED --data wiki.txt --out report --tasks hellaswag,arc_easy --generate\n"
    "  gqaify eval --config eval.yaml --seq-len 1024          (the file's settings; options given here win)\n"
    "  gqaify eval --config report/report.json --out again    (rerun an evaluation from its report)",
    positionals=(Positional("models", "MODEL", nargs="*"),),
    switches=(QUIET,),
    foreign_names=FOREIGN_NAMES,
)


def window_length(seq_len: int | None, configs: list) -> int:
    """The window length: `seq_len` (--seq-len) where set, else the fewest positions of the models' `configs`
    (max_position_embeddings; None for a config that could not be read), at most `SEQ_LEN_MOST`."""
    positions = [getattr(c, "max_position_embeddings", None) for c in configs if c is not None]
    return seq_len or min([SEQ_LEN_MOST, *(p for p in positions if p)])


def decode_context(asked: int, new_tokens: int, positions: int | None) -> int:
    """The prefill measured before decoding: `asked` (--decode-context), shortened so that it and the `new_tokens`
    decoded after it fit the model's `positions` (None: not capped). A --decode-tokens that leaves no context in
    the positions is refused (`gqaify.eval.core`)."""
    return asked if not positions else max(1, min(asked, positions - new_tokens))
