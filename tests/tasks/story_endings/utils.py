"""The items of the story_endings task, built from the TinyStories stories in ../shared beside the checkout.

One item per sentence after the third of each story: the three sentences before it are the context, the
sentence itself is the answer, and the sentences at the same relative place in the next three stories are the
other choices (an item whose choices are not all different is left out). The answer's place among the four
rotates, so always picking one place scores 25%.
"""

import re
from pathlib import Path

STORIES = Path(__file__).resolve().parents[3].parent / "shared" / "assets" / "text" / "tinystories-valid-head.txt"
CONTEXT_SENTENCES = 3
CHOICES = 4


def sentences(story: str) -> list[str]:
    return [s for s in re.split(r'(?<=[.!?])\s+|(?<=[.!?]")\s+', " ".join(story.split())) if s]


def items(text: str) -> list[dict]:
    stories = [sentences(s) for s in text.split("<|endoftext|>") if s.strip()]
    stories = [s for s in stories if len(s) > CONTEXT_SENTENCES]
    rows = []
    for i, story in enumerate(stories):
        for cut in range(CONTEXT_SENTENCES, len(story)):  # the index of the answer
            others = []
            for j in ((i + d) % len(stories) for d in range(1, CHOICES)):
                other = stories[j]
                others.append(other[round(cut * (len(other) - 1) / (len(story) - 1))])
            if len({story[cut], *others}) < CHOICES:
                continue
            label = len(rows) % CHOICES
            choices = others[:label] + [story[cut]] + others[label:]
            rows.append({"context": " ".join(story[cut - CONTEXT_SENTENCES : cut]), "choices": choices, "label": label})
    return rows


def story_endings(**_metadata):
    """The task's dataset: one split, "test" (the harness passes the task's metadata; it is not needed)."""
    import datasets

    if not STORIES.is_file():
        raise FileNotFoundError(f"story_endings reads {STORIES}, which is not there (../shared/assets)")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(items(STORIES.read_text(encoding="utf-8")))})
