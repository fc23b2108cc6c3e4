"""Text the user has, scored by the parent once (`gqaify generate --score-data`), so that any number of uptraining
runs distil from it with no teacher in memory.

    --score-data wiki=a.txt code=b.jsonl     each source's documents tokenized, EOS-marked and packed in blocks of
                                             --length tokens, exactly as uptrain packs its data (`packed_blocks`)
    the order                                sample g comes from source i with probability w_i / Σ w (seeded), and
                                             is that source's next block (its first tokens first, as eval reads)
    shard k                                  samples k·B .. k·B + B - 1 (B = --batch-size), scored in one forward
                                             pass: each block's top-K log-probabilities at every position

A block is scored as uptrain's live teacher scores it (the parent reads the block alone, from its first token), so
a run with seq_len = --length from the stored top-K sees at each position what `distill_from` would give, cut to
its K most likely tokens. The corpus is written as every corpus is (`gqaify.generation.corpus`): resumable, shared
over several processes, checked by every reader.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gqaify.errors import UserError
from gqaify.generation.settings import GenerateSettings, whole_shards_of
from gqaify.text.loading import named_texts, packed_blocks, tokens_sha256


@dataclass(frozen=True)
class ScoredText:
    """The blocks of --score-data and the order the corpus stores them in: sample g is `blocks[order[g]]`."""

    blocks: list[torch.Tensor]  # (length,) token ids each, the sources' one after another
    order: list[int]
    sha256: str  # of the token ids of every sample in order: what a resumed corpus must still score

    @classmethod
    def read(cls, s: GenerateSettings, tokenizer) -> ScoredText:
        """The blocks and order `s` asks for: enough samples to fill whole shards past --tokens.

        Raises:
            UserError: a source cannot be read or holds less than one block; the sources hold fewer tokens than
                --tokens asks for.
        """
        sources = named_texts(s.score_data)
        per_source = []
        for text in sources:
            rows = packed_blocks(text.source, s.score_split, s.score_text_column, tokenizer, s.length)
            per_source.append([row["input_ids"] for row in rows])
        available = sum(len(b) for b in per_source) * s.length
        samples = whole_shards_of(s.tokens, s)
        if s.tokens > available:
            raise UserError(
                f"--tokens {s.tokens:,} is more than the {available:,} tokens --score-data packs into (blocks of "
                f"--length {s.length}); lower --tokens to {available:,} or give more text"
            )
        order = _order([len(b) for b in per_source], s.score_weights, samples, s.seed)
        starts = [sum(len(b) for b in per_source[:i]) for i in range(len(per_source))]
        blocks = [block for source in per_source for block in source]
        ordered = [starts[i] + k for i, k in order]
        return cls(blocks, ordered, tokens_sha256(blocks[g] for g in ordered))

    def sha256_of_first(self, samples: int) -> str | None:
        """The SHA-256 of the first `samples` samples in order, as a corpus begun with fewer --tokens pinned them
        (a sample's place in the order does not depend on how many follow it); None past this order's end."""
        if samples > len(self.order):
            return None
        return tokens_sha256(self.blocks[g] for g in self.order[:samples])


def _order(sizes: list[int], weights: list[float] | None, samples: int, seed: int) -> list[tuple[int, int]]:
    """(source, block within it) of each sample: the source drawn by `weights` from `seed`, the block that source's
    next in its own order (from its first again once all are used). One source gives its blocks in order: the
    blocks uptrain packs from the same text, at the same indices."""
    if len(sizes) == 1:
        return [(0, g % sizes[0]) for g in range(samples)]
    generator = torch.Generator().manual_seed(seed)
    weights = torch.tensor(weights or [1.0] * len(sizes), dtype=torch.float64)
    chosen = torch.multinomial(weights, samples, replacement=True, generator=generator).tolist()
    used = [0] * len(sizes)
    order = []
    for source in chosen:
        order.append((source, used[source] % sizes[source]))
        used[source] += 1
    return order


@torch.inference_mode()
def score_shard(parent, scored: ScoredText, s: GenerateSettings, shard: int, digits: int) -> list[dict]:
    """The rows of shard `shard`: its --batch-size blocks, each with the parent's top-K log-probabilities (rounded
    to `digits` decimals) at every position, from one forward pass over the batch."""
    ids = torch.stack([scored.blocks[g] for g in scored.order[shard * s.batch_size : (shard + 1) * s.batch_size]])
    logits = parent.model(input_ids=ids.to(parent.device), use_cache=False).logits  # (batch, length, vocab)
    rows = []
    for block, row_logits in zip(ids.tolist(), logits, strict=True):
        logprobs, top = torch.log_softmax(row_logits.float(), dim=-1).topk(s.top_logprobs, dim=-1)  # (length, k)
        rows.append(
            {
                "text": parent.tokenizer.decode(block),
                "prompt": "",
                "tokens": len(block),
                "input_ids": block,
                "top_ids": top.tolist(),
                "top_logprobs": [[round(v, digits) for v in position] for position in logprobs.tolist()],
            }
        )
    return rows


def length_problem(s: GenerateSettings, model) -> str | None:
    """A --length past the parent's positions: a block it cannot read whole."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions and s.length > positions:
        return f"--length {s.length} exceeds the {positions} positions of {s.model}; lower --length"
    return None
