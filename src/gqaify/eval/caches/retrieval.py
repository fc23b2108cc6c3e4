"""A key planted in a long text and asked for at its end (the pass-key retrieval of Mohtashami and Jaggi, 2023,
"Landmark Attention"): whether a model still reads back what its cache holds from far away. Local, offline and the
same on every run: the keys come from a seeded generator, the filler is a fixed text.

    There is important information hidden inside a lot of irrelevant text. Find it and memorize it. ...
    The grass is green. The sky is blue. ... The pass key is 68217. Remember it. 68217 is the pass key. ...
    What is the pass key? The pass key is

A prompt of `length` tokens holds the key at `depth` (0: just after the instruction, 1: just before the question);
the model decodes `ANSWER_TOKENS` tokens greedily, and finds the key when the first number it writes is the key.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
TRIALS = 2  # keys per length and depth
ANSWER_TOKENS = 8
INSTRUCTION = (
    "There is important information hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class Prompt:
    length: int
    depth: float
    key: str
    ids: list[int]


def key_of(length: int, depth: float, trial: int) -> str:
    """The five-digit key of one prompt: the same on every run."""
    return str(random.Random(f"{length}/{depth}/{trial}").randint(10000, 99999))


def prompt(tokenizer, length: int, depth: float, key: str) -> Prompt:
    """The prompt of `length` tokens (to within one filler sentence, never over) with `key` at `depth`."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    head, question = bos + ids(INSTRUCTION), ids(QUESTION)
    needle = ids(f" The pass key is {key}. Remember it. {key} is the pass key.")
    sentence = ids(FILLER)
    room = length - len(head) - len(question) - len(needle)
    if room < 0:
        raise ValueError(f"a retrieval prompt needs more than {length} tokens")
    filler = (sentence * (room // len(sentence) + 1))[:room]
    cut = round(depth * len(filler))
    return Prompt(length, depth, key, head + filler[:cut] + needle + filler[cut:] + question)


def prompts(tokenizer, lengths: list[int]) -> list[Prompt]:
    """Every prompt of the check: `TRIALS` keys at each of `DEPTHS` in a prompt of each of `lengths`."""
    return [
        prompt(tokenizer, length, depth, key_of(length, depth, trial))
        for length in lengths
        for depth in DEPTHS
        for trial in range(TRIALS)
    ]


def found(answer: str, key: str) -> bool:
    """Whether `answer`'s first number is `key`."""
    first = re.search(r"\d+", answer)
    return first is not None and first.group() == key


def shortest(tokenizer) -> int:
    """The fewest tokens a prompt can have: the instruction, the key and the question, no filler (and a BOS)."""
    text = INSTRUCTION + " The pass key is 00000. Remember it. 00000 is the pass key." + QUESTION
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
