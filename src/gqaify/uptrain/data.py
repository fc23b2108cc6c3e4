"""Training data: documents tokenized, marked with EOS, packed into blocks, served in a seeded order.

    documents     "Once upon a time ..."   "The lobster ..."   ...
    tokens        [bos] 12 87 ... 5 [eos] [bos] 44 ... [eos] ...       each document ends with EOS
    blocks        |<-- seq_len -->|<-- seq_len -->|<-- ...             the stream cut every seq_len tokens

A block may span documents (the EOS between them marks the boundary), so no token is padding and every
position is trained on. The tail of each tokenized batch of documents shorter than a block is dropped.

The order is a function of (seed, epoch) alone: `EpochSampler` permutes the blocks afresh each epoch, and a
resumed run skips the batches it already consumed, so it sees exactly the data an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from gqaify.corpora import STORED
from gqaify.data import load_rows
from gqaify.errors import UserError

DOCUMENTS_PER_MAP = 1000  # documents tokenized and packed together; the remainder of each map batch is dropped


def packed_blocks(data: str, split: str, text_column: str, tokenizer, seq_len: int, streaming: bool = False):
    """`datasets` dataset of {"input_ids": (seq_len,)} blocks from `data`.

    Raises:
        UserError: the data cannot be loaded, or (not streaming) holds less than one block of tokens.
    """
    rows = load_rows(data, split, text_column, streaming=streaming, option="data")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the model's tokenizer has no EOS token to mark document ends; set tokenizer.eos_token")

    def tokenize(batch: dict) -> dict:
        texts = [t for t in batch[text_column] if isinstance(t, str) and t.strip()]
        ids = tokenizer(texts, verbose=False)["input_ids"] if texts else []  # the tokenizer fails on no texts
        return {"input_ids": [doc if doc[-1:] == [eos] else [*doc, eos] for doc in ids]}

    def pack(batch: dict) -> dict:
        stream = [token for doc in batch["input_ids"] for token in doc]
        whole = len(stream) // seq_len * seq_len
        return {"input_ids": [stream[i : i + seq_len] for i in range(0, whole, seq_len)]}

    columns = rows.column_names or [text_column]
    documents = rows.map(tokenize, batched=True, batch_size=DOCUMENTS_PER_MAP, remove_columns=columns)
    blocks = documents.map(pack, batched=True, batch_size=DOCUMENTS_PER_MAP)
    if streaming:
        return blocks.with_format("torch")
    if len(blocks) == 0:
        tokens = sum(len(ids) for ids in documents["input_ids"]) if documents.num_rows else 0  # (no rows, no column)
        raise UserError(
            f"data {data} gives {tokens:,} tokens, less than one block of seq_len {seq_len}; "
            "give more text or lower seq_len"
        )
    return blocks.with_format("torch")


def packed_stored_blocks(data: str, split: str, seq_len: int, streaming: bool = False, vocab_size: int | None = None):
    """`datasets` dataset of {"input_ids": (seq_len,), "top_ids": (seq_len, k), "top_logprobs": (seq_len, k)}
    blocks from a corpus written by `gqaify generate --top-logprobs K`: its token ids as the parent sampled them
    (each document already ends with EOS) and the parent's top-k at every position, packed as `packed_blocks`
    packs text. At a document's last position the stored top-k is the parent's guess past the end (it read that
    document alone), where a teacher running on the block would read the next document's first token.

    Args:
        vocab_size: the model's vocabulary, which every stored id must fall in.

    Raises:
        UserError: the data holds no stored log-probabilities, or (not streaming) less than one block; a corpus
            that is incomplete or damaged (`gqaify.corpora`).
    """
    rows = load_rows(data, split, None, streaming=streaming, option="data", vocab_size=vocab_size)
    columns = rows.column_names
    if columns is not None and not set(STORED) <= set(columns):
        raise UserError(
            f"data {data} holds no stored log-probabilities (columns {', '.join(columns)}); write it with "
            "gqaify generate --top-logprobs K, or drop distill_from_data and name the teacher with distill_from"
        )

    def pack(batch: dict) -> dict:
        streams = {key: [value for row in batch[key] for value in row] for key in STORED}
        whole = len(streams["input_ids"]) // seq_len * seq_len
        return {key: [stream[i : i + seq_len] for i in range(0, whole, seq_len)] for key, stream in streams.items()}

    blocks = rows.map(pack, batched=True, batch_size=DOCUMENTS_PER_MAP, remove_columns=columns)
    if not streaming and len(blocks) == 0:
        raise UserError(f"data {data} holds less than one block of seq_len {seq_len}; generate more or lower seq_len")
    return blocks.with_format("torch")


def mixed(blocks: list, weights: list[float] | None, seed: int) -> tuple[object, list[int] | None]:
    """The blocks of several sources as one dataset, and how many of its blocks each source gave (None when
    streaming: the count is not known before reading).

    Each next block comes from source i with probability w_i / Σ w (`datasets.interleave_datasets`, drawn from
    `seed`, the same order every time), until every source has given all of its blocks: a small source is repeated
    to keep its share, and no block of a large one is left out.
    """
    import datasets

    weights = weights or [1.0] * len(blocks)
    marked = [
        b.map(lambda batch, i=i: {"source": [i] * len(batch["input_ids"])}, batched=True) for i, b in enumerate(blocks)
    ]
    together = datasets.interleave_datasets(
        marked, probabilities=[w / sum(weights) for w in weights], seed=seed, stopping_strategy="all_exhausted"
    )
    if isinstance(together, datasets.IterableDataset):
        return together.remove_columns("source").with_format("torch"), None
    sources = together.with_format(None)["source"]
    counts = [sources.count(i) for i in range(len(blocks))]
    return together.remove_columns("source").with_format("torch"), counts


class EpochSampler(Sampler[int]):
    """A permutation of `num_blocks` blocks drawn from (seed, epoch), cut to a multiple of `multiple`.

    `multiple` is the blocks of one optimizer step over all processes, so an epoch ends on a step boundary
    and every process gets the same number of batches.
    """

    def __init__(self, num_blocks: int, seed: int, multiple: int):
        self.num_blocks, self.seed, self.multiple = num_blocks, seed, multiple
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_blocks // self.multiple * self.multiple

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        yield from torch.randperm(self.num_blocks, generator=generator)[: len(self)].tolist()
