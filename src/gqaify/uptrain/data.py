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

import itertools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Sampler

from gqaify.errors import UserError
from gqaify.text.corpus_format import STORED, corpus_record, stored_problem
from gqaify.text.loading import DOCUMENTS_PER_MAP, load_rows, named_texts, packed_blocks, tokens_sha256

if TYPE_CHECKING:
    from gqaify.uptrain.settings import UptrainSettings

LOG = logging.getLogger(__name__)


def packed_stored_blocks(data: str, split: str, seq_len: int, streaming: bool = False, vocab_size: int | None = None):
    """`datasets` dataset of {"input_ids": (seq_len,), "top_ids": (seq_len, k), "top_logprobs": (seq_len, k)}
    blocks from a corpus written by `gqaify generate --top-logprobs K`: its token ids as the parent sampled them
    (each document already ends with EOS) and the parent's top-k at every position, packed as `packed_blocks`
    packs text. At a document's last position the stored top-k is the parent's guess past the end (it read that
    document alone), where a teacher running on the block would read the next document's first token. A corpus of
    scored text (`gqaify generate --score-data`) holds blocks already, each scored as the live teacher scores it:
    seq_len must be its --length.

    Args:
        vocab_size: the model's vocabulary, which every stored id must fall in.

    Raises:
        UserError: the data holds no stored log-probabilities, or (not streaming) less than one block; a corpus
            that is incomplete or damaged (`gqaify.text.corpus_format`); scored text in blocks of another length
            than seq_len.
    """
    rows = load_rows(data, split, None, streaming=streaming, option="data", vocab_size=vocab_size)
    record = corpus_record(Path(data).expanduser())
    scored = record.settings if record is not None else {}
    if scored.get("score_data") and scored.get("length") != seq_len:
        raise UserError(
            f"data {data} is text scored in blocks of {scored.get('length')} tokens, so that each block is read as "
            f"the live teacher reads it; set seq_len {scored.get('length')}, or score it again with --length {seq_len}"
        )
    columns = rows.column_names
    if columns is not None and not set(STORED) <= set(columns):
        raise UserError(
            f"data {data} holds no stored log-probabilities (columns {', '.join(columns)}); write it with "
            "gqaify generate --top-logprobs K, or drop distill_from_data and name the teacher with distill_from"
        )

    def pack(batch: dict) -> dict:
        # read as the run goes, after `load_rows`' check of the whole: each batch checked as it comes, in one process
        # (in a launch the main process reads for all, and a refusal there alone would leave the others waiting: the
        # non-finite loss that follows stops every process at once, its line naming this data)
        if streaming and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            _check_streamed(batch, data, vocab_size)
        streams = {key: [value for row in batch[key] for value in row] for key in STORED}
        whole = len(streams["input_ids"]) // seq_len * seq_len
        return {key: [stream[i : i + seq_len] for i in range(0, whole, seq_len)] for key, stream in streams.items()}

    blocks = rows.map(pack, batched=True, batch_size=DOCUMENTS_PER_MAP, remove_columns=columns)
    if not streaming and len(blocks) == 0:
        raise UserError(f"data {data} holds less than one block of seq_len {seq_len}; generate more or lower seq_len")
    return blocks.with_format("torch")


def _check_streamed(batch: dict, data: str, vocab_size: int | None) -> None:
    """The stored top-k of a batch of rows read as a run streams them, checked as `load_rows` checks a corpus
    read whole (`corpus_format.stored_problem`): a NaN there would reach the loss and be taken for a high lr.

    Raises:
        UserError: a log-probability that is not finite or above 0, or an id outside the vocabulary.
    """
    import pyarrow as pa

    where = f"data {data} (streamed: checked as it is read, so after training began)"
    fix = "write it again with gqaify generate --top-logprobs K, or train without --streaming to check it first"
    problem = stored_problem(pa.table({key: batch[key] for key in STORED}), where, fix, vocab_size=vocab_size)
    if problem is not None:
        raise UserError(problem)


def mixed(
    blocks: list, weights: list[float] | None, seed: int, limit: int | None = None
) -> tuple[object, list[int] | None]:
    """The blocks of several sources as one dataset, and how many of its blocks each source gave (None when
    streaming: the count is not known before reading).

    Each next block comes from source i with probability w_i / Σ w, drawn from `seed` (numpy's generator, in the
    1,000-draw batches `datasets.interleave_datasets` draws in, so the same order as it gives), until every source
    has given all of its blocks, a small source repeated to keep its share, or until `limit` blocks are drawn (the
    blocks the run reads), whichever comes first: a tiny weight would otherwise repeat the other sources until it
    had its turn, an epoch of billions of blocks. Where `limit` stops the mixture first, each source is read in a
    seeded order of its blocks, so that the blocks read come from the whole of each source, not its beginning.
    """
    import datasets
    import numpy as np

    weights = weights or [1.0] * len(blocks)
    probabilities = [w / sum(weights) for w in weights]
    if isinstance(blocks[0], datasets.IterableDataset):  # lazy: the order is drawn as it is read
        # mapped and interleaved as python values: `datasets` cannot infer the features of torch tensors
        together = datasets.interleave_datasets(
            [b.with_format(None) for b in blocks],
            probabilities=probabilities,
            seed=seed,
            stopping_strategy="all_exhausted",
        )
        return (together if limit is None else together.take(limit)).with_format("torch"), None
    lengths = np.array([len(b) for b in blocks])  # (sources,)
    rng = np.random.default_rng(seed)
    draws: list = []
    seen = np.zeros(len(blocks), dtype=np.int64)  # (sources,) blocks drawn of each
    while not (seen >= lengths).all() and (limit is None or len(draws) * 1000 < limit):
        draws.append(rng.choice(len(blocks), size=1000, p=probabilities))
        seen += np.bincount(draws[-1], minlength=len(blocks))
    drawn = np.concatenate(draws)  # (draws,) the source of each block
    whole = (seen >= lengths).all()  # then every source is given whole at the last one's last block
    end = max(int(np.flatnonzero(drawn == i)[n - 1]) for i, n in enumerate(lengths)) + 1 if whole else None
    cut = end is None or (limit is not None and end > limit)
    drawn = drawn[:limit] if cut else drawn[:end]
    offsets = np.cumsum([0, *lengths[:-1]])  # (sources,) where each source starts in the concatenation
    shuffle = np.random.default_rng([seed, 1])
    indices = np.empty(len(drawn), dtype=np.int64)  # (blocks,) rows of the concatenation
    for i, n in enumerate(lengths):
        at = np.flatnonzero(drawn == i)  # this source's places in the mixture
        order = shuffle.permutation(n) if cut else np.arange(n)
        indices[at] = order[np.arange(len(at)) % n] + offsets[i]
    together = datasets.concatenate_datasets([b.with_format(None) for b in blocks]).select(indices)
    counts = np.bincount(drawn, minlength=len(blocks)).tolist()
    return together.with_format("torch"), counts


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


def training_loader(s: UptrainSettings, tokenizer, vocab_size: int, accelerator):
    """(DataLoader of packed blocks, optimizer steps of its tokens, SHA-256 of the blocks' tokens: all of them, or
    when streaming the first step's, which are all that is read before training). The blocks are `tokenizer`'s
    tokens, or with distill_from_data the stored ones, each of them in the model's vocabulary of `vocab_size`.

    Raises:
        UserError: the training tokens are fewer than one step, or the data packs into fewer blocks than one step needs.
    """
    from torch.utils.data import DataLoader

    sources = named_texts(s.data)
    tokens_per_step = s.tokens_per_step_per_process * accelerator.num_processes
    steps = s.training_tokens() // tokens_per_step
    blocks_per_step = s.micro_batch_size * s.grad_accum * accelerator.num_processes
    with accelerator.main_process_first():  # the main process tokenizes; the others read datasets' cache
        if s.distill_from_data:
            blocks = [packed_stored_blocks(t.source, s.split, s.seq_len, s.streaming, vocab_size) for t in sources]
        else:
            blocks = [
                packed_blocks(t.source, s.split, s.text_column, tokenizer, s.seq_len, s.streaming) for t in sources
            ]
        if len(blocks) == 1:
            blocks = blocks[0]
        else:
            # no more blocks than the run reads (at least one step's, for the check below)
            blocks, counts = mixed(blocks, s.data_weights, s.seed, limit=max(steps, 1) * blocks_per_step)
            if counts is not None:
                LOG.info("data: %s", ", ".join(f"{t.name} {n:,} blocks" for t, n in zip(sources, counts, strict=True)))
    if problem := s.step_problem(accelerator.num_processes):  # steps < 1, or fewer than eval_points
        raise UserError(problem)
    if s.streaming:  # the size is unknown: read as far as one step needs
        head = [block["input_ids"] for block in itertools.islice(blocks, blocks_per_step)]
        if (found := len(head)) < blocks_per_step:
            raise UserError(
                f"data {' '.join(s.data)} packs into {found} blocks of {s.seq_len} tokens, fewer than one step's "
                f"{blocks_per_step}; give more text, or lower seq_len or the batch"
            )
        shuffled = blocks.shuffle(seed=s.seed, buffer_size=10_000)
        return DataLoader(shuffled, batch_size=s.micro_batch_size, drop_last=True), steps, tokens_sha256(head)
    if len(blocks) < blocks_per_step:
        raise UserError(
            f"data {' '.join(s.data)} packs into {len(blocks)} blocks of {s.seq_len} tokens, fewer than one step's "
            f"{blocks_per_step}; give more text, or lower seq_len or the batch"
        )
    sampler = EpochSampler(len(blocks), s.seed, blocks_per_step)
    loader = DataLoader(blocks, batch_size=s.micro_batch_size, sampler=sampler, drop_last=True)
    return loader, steps, tokens_sha256(batch["input_ids"] for batch in blocks.iter(batch_size=1024))
