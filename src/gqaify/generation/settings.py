"""The settings of `gqaify generate` (imports nothing heavy: the command line reads them before torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gqaify.settings import (
    QUIET,
    Excludes,
    Limit,
    Needs,
    Positional,
    Range,
    Stage,
    override,
    recorded,
    setting,
)
from gqaify.settings.groups import Out, Runtime, Seed
from gqaify.text.pins import Pin, sha256_problem
from gqaify.text.settings import Texts

# The settings that may change when a corpus is resumed: they change where it stops or how it is shown, not what
# each shard holds (a larger `tokens` extends a complete corpus). The device is recorded as the kind it resolved
# to and may not change: a GPU's random numbers are not the CPU's.
RESUMABLE_CHANGES = frozenset({"out", "progress", "tokens"})
# score_sha256: the text a rerun from a corpus's record must score (a resumed corpus's is checked on its own, against
# the record's score_sha256, so it is no part of the settings a resume must repeat)
SCORE_PIN = Pin("score_sha256", "corpus", "its blocks would differ", "score")
# Stored log-probabilities cost 8 bytes (id and value) per kept token at every position, as JSON text more:
# beyond a few hundred the file outweighs the teacher it replaces.
TOP_LOGPROBS_MAX = 1024


@dataclass(frozen=True)
class GenerateSettings(Out, Seed, Runtime):
    """What `gqaify generate` samples from the parent, and where it writes it. gqaify.json in OUT records them."""

    model: str | None = setting(None, "the parent: a hub id, a folder or a .gguf file", required=True)
    out = override(help="folder for the corpus (a dataset folder `datasets` and every gqaify DATA read)")
    tokens: int = setting(
        100_000, "tokens to sample in all (the parent's new tokens; prompts not counted)", check=Range(1)
    )
    length: int = setting(
        256, "new tokens per sample at most (a sample ends early at the end-of-text token)", check=Range(1)
    )
    batch_size: int = setting(
        16,
        "samples per generate call (one shard of the corpus)",
        check=Range(1, "tokens", fix="a shard needs no more samples than the tokens asked for; lower --batch-size"),
    )
    temperature: float = setting(
        1.0,
        "softmax temperature (1: the parent's own distribution)",
        check=Range(0, low_open=True, fix="1 samples the parent as is"),
    )
    top_p: float = setting(
        1.0,
        "nucleus sampling mass (1: the whole distribution)",
        check=Range(0, 1, low_open=True, fix="1 keeps the whole distribution"),
    )
    greedy_tokens: int = setting(
        0,
        "the first N new tokens of each sample by top-1, the rest sampled (LLM-QAT's rule; 0: all sampled)",
        check=Range(0, "length", high_open=True),
    )
    start: Literal["bos", "random-token"] = setting(
        "bos",
        "without prompts: each sample starts at the beginning-of-text token, or at a token drawn "
        "uniformly from the vocabulary (LLM-QAT)",
        check=Excludes("prompts", "both choose how a sample begins", when="bos".__ne__),
    )
    prompts: str | None = setting(None, "text file of prompts, one per line, used in turn (instead of start)")
    chat: bool = setting(
        False,
        "wrap each prompt as a user turn in the model's chat template (instruct models)",
        check=Needs("prompts", "wraps prompts in the chat template"),
    )
    top_logprobs: int = setting(
        0,
        "store the parent's K most likely next tokens and their log-probabilities at every position of each "
        "sample, so that uptrain's distill_from_data needs no teacher (0: text only)",
        check=(Range(0), Limit(TOP_LOGPROBS_MAX, "each kept costs 8 bytes or more at every position stored")),
    )
    score_data = Texts(  # score_data, score_weights, score_split, score_text_column
        "text to score instead of sampling, its documents packed in blocks of --length tokens as uptrain packs them "
        "(seq_len = --length), each block scored by the parent in one forward pass and stored with its top "
        "--top-logprobs K so that uptrain's distill_from_data trains on it with no teacher",
        "a mixture, each block drawn from a source by --score-weights",
        weighs="the chance that a block comes from it",
    )
    score_sha256: str | None = setting(
        None,
        "SHA-256 of the tokens --score-data must give (gqaify.json records it, so that a rerun refuses text that "
        "changed since); '' scores any text",
        check=sha256_problem,
    )
    seed = override(help="seed: the same seed and settings write the same tokens")
    dtype = override(help="model dtype (auto: the config's; a .gguf: float32)")

    def problems(self) -> list[str]:
        """Everything wrong with the values, at once (their declarations'); `generate_corpus` adds --device and
        what OUT, the prompts and the model say."""
        problems = GENERATE.declared_problems(self)
        if self.score_data:
            sampling = {
                "--prompts": self.prompts is not None,
                "--chat": self.chat,
                "--start": self.start != "bos",
                "--greedy-tokens": self.greedy_tokens != 0,
                "--temperature": self.temperature != 1,
                "--top-p": self.top_p != 1,
            }
            problems += [
                f"{flag} chooses how the parent samples, and --score-data samples nothing; drop {flag}"
                for flag, given in sampling.items()
                if given
            ]
            if not self.top_logprobs:
                problems.append("--score-data stores the parent's top-K at every position; give --top-logprobs K")
            problems += [p for p in [self._shard_problem()] if p]
        return problems

    def _shard_problem(self) -> str | None:
        """A shard of scored text larger than --tokens: the text is scored in whole shards of --batch-size blocks of
        --length tokens (`whole_shards_of`), so `--tokens 256 --length 64` scored 1,024 tokens, the 16 blocks of the
        default --batch-size, without a word. A budget that fills shards past it by less than one is kept."""
        if min(self.tokens, self.length, self.batch_size) < 1:  # the fields' own problems
            return None
        shard = self.batch_size * self.length
        if self.tokens < self.length:
            return (
                f"--tokens {self.tokens:,} is less than one block of --length {self.length} (--score-data scores "
                f"whole blocks); raise --tokens to {self.length}, or lower --length to {self.tokens}"
            )
        if shard > self.tokens:
            return (
                f"--score-data scores whole shards of --batch-size {self.batch_size} blocks of --length {self.length}, "
                f"{shard:,} tokens, more than --tokens {self.tokens:,}; lower --batch-size to "
                f"{self.tokens // self.length}, or raise --tokens to {shard:,}"
            )
        return None

    def identity(self) -> dict:
        """The settings that decide the tokens written: a resumed corpus must have the same."""
        return recorded(self, leave_out=RESUMABLE_CHANGES | {SCORE_PIN.setting})


GENERATE = Stage(
    settings=GenerateSettings,
    description="Sample a corpus from MODEL (the parent) into the folder OUT: text for --calib-data, uptrain's data "
    "and eval's --data, when you have none that matches every use of the model. Resumable: rerun the same "
    "command after a stop.\n\n"
    "  gqaify generate PARENT OUT --tokens 100000\n"
    "  gqaify generate PARENT OUT --prompts prompts.txt --chat      (an instruct model's answers to your prompts)\n"
    "  gqaify generate --config OUT/gqaify.json --out OUT2          (the same settings again)",
    positionals=(Positional("model", "MODEL"), Positional("out", "OUT")),
    switches=(QUIET,),
)


def whole_shards_of(tokens: int, s: GenerateSettings) -> int:
    """The samples that fill whole shards of --batch-size blocks of --length tokens past `tokens`."""
    return math.ceil(tokens / (s.length * s.batch_size)) * s.batch_size
