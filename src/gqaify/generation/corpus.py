"""A corpus sampled from the parent, written shard by shard into a dataset folder, resumable after any stop.

    OUT/
        gqaify.json                what wrote it: the parent, the settings, the seed, shards, samples, tokens
        data/train-00000.jsonl     one generate call of batch_size samples: {"text", "prompt", "tokens"} rows,
                                   with --top-logprobs K also {"input_ids", "top_ids", "top_logprobs"}
        data/train-00001.jsonl     ...

`datasets.load_dataset(OUT)` reads it (split "train"), and so does every gqaify DATA (`--calib-data OUT`,
uptrain's `data: OUT`, `gqaify eval --data OUT`).

Shard k is a function of (settings, k) alone: its prompts are the k-th batch_size of the prompt order, and
its random numbers come from a seed derived from (seed, k). So a corpus is the same tokens on every run with
the same settings (on the same device), and a stopped one resumes at its first missing shard and ends as an
uninterrupted one would. Each shard is written to a temporary name and renamed, so a shard is whole or absent.
Every reader refuses a corpus that is incomplete or not as its record says (`gqaify.text.corpus_format`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gqaify.errors import UserError, as_interrupt, problems_in, raise_if_problems
from gqaify.generation.processes import Processes
from gqaify.generation.record import (
    check_scored_text,
    finish_record,
    new_record,
    record_to_continue,
    write_record,
)
from gqaify.generation.scoring import ScoredText, length_problem, score_shard
from gqaify.generation.settings import GenerateSettings
from gqaify.logs import muted
from gqaify.model.loading import device_problem, resolve_device
from gqaify.output.claims import claimed
from gqaify.output.destination import destination_problems, name_problem, resolve_out, space_problem
from gqaify.output.whole import write_text_whole
from gqaify.progress import progress_bar
from gqaify.records import CorpusRecord
from gqaify.text.corpus_format import SHARDS, corpus_full_disk, shard_index, shard_name
from gqaify.text.pins import local_path, located_all

LOG = logging.getLogger(__name__)

LOGPROB_DIGITS = 5  # decimals of a stored log-probability: 1e-5 nats, far below what training resolves
# What a stored token costs on disk before a shard says: its text, a few bytes of UTF-8 in "text" (and, in a prompt,
# in "prompt" too); with --top-logprobs K, its id and at each position K ids and log-probabilities as JSON text
# (up to 6 and 11 characters with their separators). stories260K measures 3.4 and 17 (its ids are short).
TEXT_BYTES_PER_TOKEN = 12
TOP_LOGPROB_BYTES = 18


@dataclass(frozen=True)
class Corpus:
    out: Path
    shards: int
    samples: int
    tokens: int  # the parent's new tokens, prompts not counted (with --score-data: the tokens scored)
    resumed_from: int  # shards found on disk when this run started
    scored: bool = False  # the user's text scored (--score-data), not samples
    asked: int | None = None  # --tokens: whole shards hold at least as many, up to a shard more


@dataclass(frozen=True)
class Parent:
    """The model that writes the corpus, and what sampling needs to know about it."""

    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    ends: tuple[int, ...]  # the tokens that end a sample: the checkpoint's end-of-text tokens and the tokenizer's
    pad: int


def generate_corpus(settings: GenerateSettings) -> Corpus:
    """Sample the corpus `settings` describe into `settings.out`, or finish one a stopped run began.

    OUT is held for the whole run (`claims.claimed`): a second run into the same OUT meanwhile is refused.

    Raises:
        UserError: bad settings, prompts or model; OUT holds something else, or another run is writing it; the
            prompts changed since the corpus began; too little disk space. Nothing is written.
        ResourceError: the disk filled up; the whole shards written so far are kept.
        Interrupted: Ctrl-C or SIGTERM; the message says how much is on disk and how to go on.
    """
    s = settings
    problems = s.problems() + problems_in(name_problem(s.out or ""))  # before OUT is looked at
    raise_if_problems(problems or device_problem(s.device))
    lines, prompts_sha256 = _prompt_lines(s)
    # recorded as they resolve: absolute paths (`--config OUT/gqaify.json` may be given from another folder), and
    # the device, whose random numbers are its own, so that a corpus is never resumed on another kind of device
    prompts = None if s.prompts is None else local_path(s.prompts)
    out = resolve_out(s.out)
    processes = Processes.launched()
    s = replace(
        s,
        model=local_path(s.model),
        prompts=prompts,
        score_data=located_all(s.score_data),
        out=str(out),
        device=resolve_device(s.device).type,
    )
    with contextlib.ExitStack() as held:

        def hold() -> None:  # the main process holds OUT for all of them
            if not out.exists():
                raise_if_problems(destination_problems(out, force=True))  # where the claim goes, before it is made
            held.enter_context(claimed(out, "gqaify generate"))

        processes.on_main(hold)
        return _generate_into(out, s, lines, prompts_sha256, processes)


def _generate_into(
    out: Path, s: GenerateSettings, lines: list[str] | None, prompts_sha256: str | None, processes: Processes
) -> Corpus:
    """`generate_corpus` once OUT is this run's: the main process reads and writes the record, and every process
    samples its share of the shards still missing."""
    record = processes.on_main(lambda: record_to_continue(out, s, prompts_sha256))
    known = processes.on_main(lambda: _shards_on_disk(out))
    shards, found = contiguous_shards(known)
    if record is not None and found >= s.tokens:  # complete already: nothing to sample, no model to load
        if processes.main:
            finish_record(out, record, s, shards, found)
        return Corpus(out, shards, shards * s.batch_size, found, shards, bool(s.score_data), s.tokens)
    processes.on_main(lambda: raise_if_problems(space_problem(out, _bytes_needed(s, out, known))))
    parent = _load(s, processes)
    if s.top_logprobs > (vocab := parent.model.config.vocab_size):
        raise UserError(
            f"--top-logprobs {s.top_logprobs} is more than the {vocab:,} tokens of {s.model}'s "
            f"vocabulary; give {vocab:,} or fewer"
        )
    if s.score_data:
        raise_if_problems(problems_in(length_problem(s, parent.model)))
        scored = processes.on_main(lambda: ScoredText.read(s, parent.tokenizer))  # tokenized once, shared
        check_scored_text(out, record, s, scored)
        s = replace(s, score_sha256=scored.sha256)  # what the record pins: a rerun from it must score this text
        if record is not None:  # extended to more --tokens: the record pins the longer order it is written to now
            record = dataclasses.replace(record, score_sha256=scored.sha256)
        rows_of = functools.partial(score_shard, parent, scored, s, digits=LOGPROB_DIGITS)
    else:
        prompts = _prompt_ids(s, parent.tokenizer, lines)
        _check_positions(s, parent.model, prompts)
        rows_of = functools.partial(_sample_shard, parent, prompts, s)
    if record is None:
        record = new_record(s, prompts_sha256, scored.sha256 if s.score_data else None, vocab)

    def begin() -> None:  # the record before any shard
        out.mkdir(parents=True, exist_ok=True)
        write_record(out, record, s, shards, shards * s.batch_size, found, complete=False)
        (out / SHARDS).mkdir(exist_ok=True)

    processes.on_main(begin)
    resumed_from = shards
    shards, samples, tokens = _sample_into(out, record, rows_of, s, known, processes)
    if processes.main:
        write_record(out, record, s, shards, samples, tokens, complete=True)
    return Corpus(out, shards, samples, tokens, resumed_from, bool(s.score_data), s.tokens)


def _bytes_needed(s: GenerateSettings, out: Path, known: dict[int, int]) -> int:
    """The disk space the rest of the corpus will take: the tokens still to sample, and one shard more (the last
    one may overshoot --tokens by a whole shard), at the bytes a token takes in the shards written so far, or at
    first at a generous estimate."""
    found = sum(known.values())
    if found:
        per_token = sum((out / SHARDS / shard_name(k)).stat().st_size for k in known) / found
    else:
        per_token = TEXT_BYTES_PER_TOKEN + TOP_LOGPROB_BYTES * s.top_logprobs
    return round((max(s.tokens - found, 0) + s.batch_size * s.length) * per_token)


def _sample_into(
    out: Path, record: CorpusRecord, rows_of, s: GenerateSettings, known: dict[int, int], processes: Processes
) -> tuple[int, int, int]:
    """Write the shards missing from `known` (index: tokens; `rows_of(index)` makes one: sampled, or scored with
    --score-data), in rounds of one per process, until shards 0..n-1
    hold `s.tokens`; the main process then removes any shard past n (a last round's, or a killed run's). Returns
    (shards, samples, tokens) in OUT: what one process sampling from shard 0 would have written."""
    bar = progress_bar(
        total=s.tokens,
        initial=min(contiguous_shards(known)[1], s.tokens),
        unit="tok",
        desc="generate",
        shown=s.progress and processes.main,
    )
    try:
        while (enough := shards_enough(known, s.tokens)) is None:
            todo = missing_shards(known, processes.size)
            mine = todo[processes.rank] if processes.rank < len(todo) else None
            written = None
            if mine is not None:
                rows = rows_of(mine)
                _write_shard(out, mine, rows)
                written = sum(r["tokens"] for r in rows)
            known.update((index, tokens) for index, tokens in processes.gather((mine, written)) if index is not None)
            shards, total = contiguous_shards(known)
            bar.update(min(total, s.tokens) - bar.n)
            if processes.main:
                write_record(out, record, s, shards, shards * s.batch_size, total, complete=False)
    except BaseException as exc:
        stop = as_interrupt(exc)
        if stop is not None:
            shards, total = contiguous_shards(known)
            raise stop.with_message(_stopped_message(out, shards, total, s.tokens)) from None
        raise
    finally:
        bar.close()
    if processes.main:
        for index in [k for k in known if k >= enough]:
            (out / SHARDS / shard_name(index)).unlink()
    return enough, enough * s.batch_size, sum(known[k] for k in range(enough))


def _stopped_message(out: Path, shards: int, total: int, asked: int) -> str:
    """What a stopped run left in OUT: a shard holds whole samples, so the shards can hold more than was asked."""
    holds = f"{out} holds {shards} whole shard(s), {total:,} tokens"
    if total >= asked:
        return (
            f"{holds}: the corpus is complete but its record was not yet written; rerun the same command to finish it"
        )
    return f"{holds} (the corpus asked for {asked:,}); rerun the same command to go on from there"


def contiguous_shards(known: dict[int, int]) -> tuple[int, int]:
    """(n, tokens) of shards 0..n-1, all present."""
    n = 0
    while n in known:
        n += 1
    return n, sum(known[k] for k in range(n))


def shards_enough(known: dict[int, int], tokens: int) -> int | None:
    """The fewest shards 0..n-1 that hold `tokens`, or None while one of them is missing."""
    total, n = 0, 0
    while total < tokens:
        if n not in known:
            return None
        total, n = total + known[n], n + 1
    return n


def missing_shards(known: dict[int, int], count: int) -> list[int]:
    """The first `count` shard indices not in `known`."""
    missing, index = [], 0
    while len(missing) < count:
        if index not in known:
            missing.append(index)
        index += 1
    return missing


# -- the folder -------------------------------------------------------------------------------------------------


def _shards_on_disk(out: Path) -> dict[int, int]:
    """The whole shards in OUT, by index, with their tokens (a temporary left by a kill is removed); several
    processes, killed, may leave a gap."""
    folder = out / SHARDS
    if not folder.is_dir():
        return {}
    for partial in folder.glob(".*.tmp"):
        partial.unlink()
    known = {}
    for path in folder.iterdir():
        index = shard_index(path.name)
        if index is not None and path.is_file():
            known[index] = _shard_tokens(path)
    return known


def _shard_tokens(path: Path) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(json.loads(line)["tokens"] for line in f if line.strip())


def _write_shard(out: Path, index: int, rows: list[dict]) -> None:
    lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    path = out / SHARDS / shard_name(index)
    write_text_whole(path, lines, full_disk=corpus_full_disk(path))


# -- the model and its prompts ----------------------------------------------------------------------------------


def _load(s: GenerateSettings, processes: Processes) -> Parent:
    from transformers import GenerationConfig

    from gqaify.model.loading import load_model

    device = processes.device(resolve_device(s.device))
    model, tokenizer = load_model(s.model, s.dtype, device, trust_remote_code=s.trust_remote_code)
    configured = model.generation_config.eos_token_id
    ends = [*(configured if isinstance(configured, list) else [configured]), tokenizer.eos_token_id]
    ends = tuple(dict.fromkeys(e for e in ends if e is not None))
    model.generation_config = GenerationConfig()  # the checkpoint's sampling defaults must not change the parent's
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (ends or (0,))[0]  # masked out anyway
    return Parent(model, tokenizer, device, ends, pad)


def _prompt_lines(s: GenerateSettings) -> tuple[list[str] | None, str | None]:
    """The prompts of --prompts, one per non-empty line, and the SHA-256 of the file ((None, None): every sample
    starts as --start says).

    Raises:
        UserError: the file is missing, unreadable or holds no prompt.
    """
    if s.prompts is None:
        return None, None
    path = Path(s.prompts).expanduser()
    try:
        data = path.read_bytes()
        lines = [line.strip() for line in data.decode("utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--prompts {path} cannot be read ({type(exc).__name__}); give a UTF-8 text file") from exc
    lines = [line for line in lines if line]
    if not lines:
        raise UserError(f"--prompts {path} holds no prompt; write one per line")
    return lines, hashlib.sha256(data).hexdigest()


def _prompt_ids(s: GenerateSettings, tokenizer, lines: list[str] | None) -> list[list[int]] | None:
    """The token ids of each prompt (None: every sample starts as --start says).

    Raises:
        UserError: no start token and no prompts; --chat and the model has no chat template.
    """
    if lines is None:
        if tokenizer.bos_token_id is None and tokenizer.eos_token_id is None:
            raise UserError(f"{s.model} has no beginning- or end-of-text token to start from; give --prompts FILE")
        return None
    if s.chat and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"--chat: {s.model} has no chat template; drop --chat to use the prompts as plain text")
    # transformers warns of a prompt longer than the model's positions; `_check_positions` refuses it in one line
    with muted("transformers.tokenization_utils_base"):
        if s.chat:
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                )
                for p in lines
            ]
            return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return [tokenizer(p)["input_ids"] for p in lines]


def _check_positions(s: GenerateSettings, model, prompts: list[list[int]] | None) -> None:
    positions = getattr(model.config, "max_position_embeddings", None)
    longest = max((len(p) for p in prompts), default=0) if prompts else 2
    if positions and longest + s.length > positions:
        raise UserError(
            f"the longest prompt ({longest} tokens) plus --length {s.length} exceeds the {positions} positions of "
            f"{s.model}; lower --length or shorten the prompts"
        )


def _start_ids(s: GenerateSettings, tokenizer, index: int, generator: torch.Generator, prompts) -> list[int]:
    """The prompt of sample `index`."""
    if prompts is not None:
        return prompts[index % len(prompts)]
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if s.start == "bos":
        return [start]
    special = set(tokenizer.all_special_ids)
    while (token := int(torch.randint(len(tokenizer), (1,), generator=generator))) in special:
        pass
    return [start, token] if tokenizer.bos_token_id is not None else [token]


# -- sampling ---------------------------------------------------------------------------------------------------


@torch.inference_mode()
def _sample_shard(parent: Parent, prompts, s: GenerateSettings, shard: int) -> list[dict]:
    """The rows of shard `shard`: batch_size samples, seeded by (seed, shard)."""
    from transformers import GenerationConfig

    model, tokenizer, device, pad = parent.model, parent.tokenizer, parent.device, parent.pad
    seed = s.seed * 1_000_003 + shard
    generator = torch.Generator().manual_seed(seed)
    starts = [_start_ids(s, tokenizer, shard * s.batch_size + i, generator, prompts) for i in range(s.batch_size)]
    width = max(len(p) for p in starts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in starts], device=device)  # (batch, width), left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in starts], device=device)
    common = {"pad_token_id": pad, "eos_token_id": list(parent.ends) or None}
    if s.greedy_tokens:
        ids, mask = _generate(
            model, ids, mask, GenerationConfig(max_new_tokens=s.greedy_tokens, do_sample=False, **common)
        )
    torch.manual_seed(seed)
    sampled = GenerationConfig(
        max_new_tokens=s.length - s.greedy_tokens,
        do_sample=True,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=0,
        **common,
    )
    ids, _ = _generate(model, ids, mask, sampled)
    rows = [_row(tokenizer, start, ids[i, width:].tolist(), parent.ends, s.chat) for i, start in enumerate(starts)]
    if s.top_logprobs:
        return [_with_top_logprobs(parent, row, s.top_logprobs) for row in rows]
    return [{k: v for k, v in row.items() if k != "ids"} for row in rows]


def _generate(model, ids: torch.Tensor, mask: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids with the new tokens appended, the attention mask extended over them)."""
    out = model.generate(ids, attention_mask=mask, generation_config=config)  # (batch, width + new)
    grown = torch.ones(out.shape[0], out.shape[1] - ids.shape[1], dtype=mask.dtype, device=mask.device)
    return out, torch.cat([mask, grown], dim=1)


def _row(tokenizer, start: list[int], new: list[int], ends: tuple[int, ...], chat: bool) -> dict:
    """One sample as a row: the new tokens up to the first end-of-text, and the text of prompt and sample."""
    new = new[: next((i for i, token in enumerate(new) if token in ends), len(new) - 1) + 1]  # the end kept
    kept = new[:-1] if new and new[-1] in ends else new
    prompt = tokenizer.decode(start, skip_special_tokens=not chat)
    text = tokenizer.decode(start + kept, skip_special_tokens=not chat)
    return {"text": text, "prompt": prompt, "tokens": len(kept), "ids": start + new}


def _with_top_logprobs(parent: Parent, row: dict, k: int) -> dict:
    """`row` with the sample's token ids as uptrain packs a document (prompt, new tokens, the end token the parent
    wrote or the tokenizer's EOS where it wrote none) and, at each of those positions, the parent's k most likely
    next tokens and their log-probabilities: "input_ids", "top_ids", "top_logprobs" (one list of k a position)."""
    ids, eos = row.pop("ids"), parent.tokenizer.eos_token_id
    if eos is not None and ids[-1] != eos:
        ids.append(eos)
    logits = parent.model(input_ids=torch.tensor([ids], device=parent.device), use_cache=False).logits[0]
    logprobs, top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # (positions, k) each
    rounded = [[round(v, LOGPROB_DIGITS) for v in position] for position in logprobs.tolist()]
    return {**row, "input_ids": ids, "top_ids": top.tolist(), "top_logprobs": rounded}
