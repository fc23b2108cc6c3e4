"""A corpus folder as its readers open it: the layout `gqaify generate` writes (`gqaify.generation.corpus`), and the
one check every reader makes before it reads a row (`gqaify.text.loading.load_rows`: eval, calibration and uptrain).

    OUT/gqaify.json              `records.CorpusRecord`: complete, shards, samples, tokens, settings (batch_size,
                                 top_logprobs)
    OUT/data/train-00000.jsonl   batch_size rows: {"text", "prompt", "tokens"}, with --top-logprobs K also
                                 {"input_ids", "top_ids", "top_logprobs"}: a list of K at each of the input_ids

`corpus_problems` refuses a corpus that is not the one its record describes: a record whose counts are no counts
of a corpus (`count_problem`, asked before anything is made of a count; the shards it names are then counted from
the files on disk), incomplete (a generate stopped before its end), a shard missing, cut short or not named by the
record, a shard of another K, and stored log-probabilities that are not finite or above 0, ids outside the
vocabulary, rows of ids and top-K not aligned. Each shard is parsed once by pyarrow and checked column by column,
not token by token. A folder that is no corpus but holds corpora is refused (`nested_corpus_problem`): read as loose
files, they would pass by these checks.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from gqaify._version import __version__
from gqaify.errors import UserError
from gqaify.records import CORPUS, PROVENANCE_FILE, CorpusRecord, read_provenance, read_record
from gqaify.settings.fields import shown

SHARDS = "data"  # the shards' folder in OUT
TEXT = ("text", "prompt", "tokens")  # every row's columns
STORED = ("input_ids", "top_ids", "top_logprobs")  # a row's columns with the parent's top-K (--top-logprobs K)


def shard_name(index: int) -> str:
    return f"train-{index:05d}.jsonl"


_SHARD = re.compile(r"train-(\d{5,})\.jsonl")


def shard_index(name: str) -> int | None:
    """The index of the shard file `name` (`shard_name` read back), or None for any other name."""
    match = _SHARD.fullmatch(name)
    return int(match[1]) if match and shard_name(int(match[1])) == name else None


def corpus_full_disk(path: Path) -> str:
    """What a full disk while `gqaify generate` writes `path` (a shard, or the record) says."""
    return (
        f"no space left while writing {path}; the whole shards written so far are kept: free some space and rerun "
        "the same command to go on"
    )


def corpus_record(folder: Path) -> CorpusRecord | None:
    """The record of the corpus `folder` holds, or None where it holds none (any other data folder).

    Raises:
        UserError: `folder` holds a corpus whose record this gqaify cannot read (`refuse_unreadable_corpus`).
    """
    try:
        record = read_record(folder)
    except (OSError, ValueError) as exc:
        refuse_unreadable_corpus(
            folder,
            exc,
            damaged="write it again (gqaify generate)",
            later="read it with the gqaify that wrote it, or write it again with this one (gqaify generate)",
        )
        return None
    return record if isinstance(record, CorpusRecord) else None


def refuse_unreadable_corpus(folder: Path, error: Exception, damaged: str, later: str) -> None:
    """Refuse `folder`, whose record `read_record` could not read (`error`), where its header says it is a corpus:
    damaged (this version's record, or one without a version), with the fix `damaged`, or another version's (a
    later gqaify's, with a field this one does not know), with the fix `later`. Returns where it is not a corpus's
    record: a reader takes such a folder as any other data folder.

    Raises:
        UserError: the corpus, what keeps its record from being read, and the fix.
    """
    file = folder / PROVENANCE_FILE
    header = read_provenance(folder) if file.is_file() else None
    if header is None and file.is_file() and not _is_json(file):  # cut short: no header to say whose it is
        raise UserError(
            f"{folder}'s {PROVENANCE_FILE} is damaged ({error}): a record gqaify wrote, cut short; {damaged}"
        )
    if header is None or header.kind != CORPUS:
        return
    if header.version in (None, __version__):
        raise UserError(f"{folder} holds a corpus whose record is damaged ({error}); {damaged}")
    raise UserError(
        f"{folder} holds a corpus written by gqaify {header.version}, whose record this gqaify ({__version__}) "
        f"cannot read ({error}); {later}"
    )


def _is_json(file: Path) -> bool:
    try:
        json.loads(file.read_text())
    except (OSError, ValueError):
        return False
    return True


def nested_corpus_problem(folder: Path, option: str) -> str | None:
    """A data folder that is no corpus but holds corpora below it (None: it holds none): read as loose files, their
    shards would pass by every check a corpus's record makes (complete, one corpus, the length of its blocks)."""
    inside = sorted(
        record.parent
        for record in folder.rglob(PROVENANCE_FILE)
        if record.parent != folder and (header := read_provenance(record.parent)) is not None and header.kind == CORPUS
    )
    if not inside:
        return None
    held = f"the corpus {inside[0]}" if len(inside) == 1 else f"{len(inside)} corpora ({inside[0]} first)"
    return (
        f"{option} {folder} holds {held} among its files; a corpus is read only as itself, as its record describes "
        f"it: name the corpus folder ({inside[0]}), or each corpus as a source of its own (NAME=FOLDER)"
    )


def corpus_problems(folder: Path, files: list[Path], option: str, vocab_size: int | None = None) -> list[str]:
    """What keeps the corpus in `folder` from being read as its record describes (empty: nothing).

    Args:
        files: the data files a reader would load from `folder`.
        vocab_size: the ids must be below it (None: not known to the reader, only negative ids are refused).
    """
    try:
        record = corpus_record(folder)
    except UserError as exc:  # a corpus whose record this gqaify cannot read
        return [f"{option} {exc}"]
    if record is None:
        return []
    # the record's settings, OUT named again: a corpus moved since keeps the OUT it was written to in its record
    record_file = shlex.quote(str(folder / PROVENANCE_FILE))
    rerun = f"gqaify generate --config {record_file} --out {shlex.quote(str(folder))}"
    where = f"{option} {folder}"
    damaged = count_problem(record, f"{where}: its record {folder / PROVENANCE_FILE}")
    if damaged:
        return [
            f"{damaged}; write the corpus again into an empty OUT (gqaify generate --config {record_file} --out NEW)"
        ]
    settings = record.settings
    if not record.complete:
        return [
            f"{where} is an incomplete corpus ({record.tokens:,} of {settings.get('tokens', 0):,} tokens; "
            f"its gqaify generate was stopped): finish it by rerunning the same command ({rerun})"
        ]
    # the shards named that are on disk, counted from the files there: a record's count allocates nothing
    shards = folder / SHARDS
    present = {i for f in files if f.parent == shards and (i := shard_index(f.name)) is not None and i < record.shards}
    if len(present) < record.shards:
        first = shards / shard_name(next(i for i in range(record.shards) if i not in present))
        return [
            f"{where} lacks {record.shards - len(present):,} of the {record.shards:,} shards its record names "
            f"({_short(first, folder)} first); write them again with the same gqaify generate command ({rerun})"
        ]
    wanted = [shards / shard_name(i) for i in range(record.shards)]  # each one a file on disk
    extra = sorted(set(files) - set(wanted))
    if extra:
        return [
            f"{where} holds {_short(extra[0], folder)}, which its record does not name; move it out of the corpus "
            "(gqaify generate writes every shard the record names)"
        ]
    found = _shards_problem(record, folder, wanted, where, rerun, vocab_size)
    return [found] if found else []


def _shards_problem(
    record: CorpusRecord, folder: Path, wanted: list[Path], where: str, rerun: str, vocab_size: int | None
) -> str | None:
    """What keeps the shards `wanted` (each a file) from being the ones `record` describes: a shard unreadable, cut
    short, without a column or with ids out of range, or tokens in all other than the record's (None: nothing)."""
    k, rows = record.settings.get("top_logprobs") or 0, record.settings.get("batch_size", 1)
    tokens, again = 0, f"delete it and rerun the same gqaify generate command to write it again ({rerun})"
    for path in wanted:
        table, found = _read_shard(path, folder, where)
        if found:
            return f"{found}; {again}"
        if table.num_rows != rows:
            return (
                f"{where}: {_short(path, folder)} holds {table.num_rows} of its {rows} rows (cut short); delete it "
                f"and rerun the same gqaify generate command to write it again ({rerun})"
            )
        columns = (*TEXT, *STORED) if k else TEXT
        absent = [c for c in columns if c not in table.column_names]
        found = (
            f"{where}: {_short(path, folder)} has no column {absent[0]!r}; {again}"
            if absent
            else stored_problem(table, f"{where}: {_short(path, folder)}", again, k, vocab_size)
            if k
            else None
        )
        if found:
            return found
        tokens += _sum(table.column("tokens"))
    if tokens != record.tokens:
        record_file = shlex.quote(str(folder / PROVENANCE_FILE))
        return (
            f"{where} holds {tokens:,} tokens, its record {record.tokens:,}; the shards were changed "
            f"since gqaify generate wrote them: write the corpus again into an empty OUT (gqaify generate --config "
            f"{record_file} --out NEW)"
        )
    return None


# What a corpus's record counts, by where it says it ("settings.batch_size": its settings' batch_size), and the least
# each may be: a value that is no whole number from it on is a damaged record's
_COUNTS = {
    "shards": 0,
    "samples": 0,
    "tokens": 0,
    "settings.tokens": 1,
    "settings.batch_size": 1,
    "settings.length": 1,
    "settings.top_logprobs": 0,
}


def count_problem(record: CorpusRecord, where: str) -> str | None:
    """What makes the counts of a corpus's `record` no counts of a corpus gqaify generate wrote (None: nothing): one
    that is no whole number (or below its least), or samples other than its shards of batch_size samples. Asked
    before anything is made of a count (a record of 10**12 shards was a list of 10**12 paths); `where` names the
    record in the message, which ends before the fix."""
    if not isinstance(record.settings, dict):
        return f"{where} holds settings {shown(record.settings)}, not a mapping of setting: value: it is damaged"
    for name, least in _COUNTS.items():
        key = name.partition(".")[2]
        value = record.settings.get(key, least) if key else getattr(record, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            return f"{where} says {name} {shown(value)}, which is no count of a corpus: it is damaged"
    vocab = record.vocab_size  # None: a record written before it was kept; -1 was blamed on "another tokenizer's" ids
    if vocab is not None and (isinstance(vocab, bool) or vocab < 1):
        return f"{where} says vocab_size {shown(vocab)}, which no tokenizer has: it is damaged"
    batch = record.settings.get("batch_size", 1)
    if record.samples != record.shards * batch:
        return (
            f"{where} says {record.shards:,} shards of {batch:,} samples (settings.batch_size), but "
            f"{record.samples:,} samples: it is damaged"
        )
    length = record.settings.get("length")  # None: a record written before it was kept
    if length is not None and record.tokens > record.samples * length:
        return (
            f"{where} says tokens {record.tokens:,}, more than its {record.samples:,} samples of at most {length:,} "
            "tokens (settings.length) hold: it is damaged"
        )
    return None


def stored_problem(table, where: str, fix: str, k: int | None = None, vocab_size: int | None = None) -> str | None:
    """What is wrong with the stored top-K of `table` (a pyarrow Table with the STORED columns), or None: the rows
    of ids and top-K of different lengths, a position with other than `k` entries (None: the first row's), a
    log-probability that is not finite or above 0, an id that is negative or not below `vocab_size`.

    Args:
        where: how the message names the table; fix: how it says to repair a damaged one.
    """
    problem = _stored_damage(table, where, k)
    if problem:
        return f"{problem}; {fix}"
    import numpy as np

    ids, top = (table.column(c).combine_chunks() for c in STORED[:2])
    for name, column, depth in (("input_ids", ids, 1), ("top_ids", top, 2)):
        values = np.asarray(_values(column, depth).to_numpy(zero_copy_only=False))
        if values.size and values.min() < 0:
            return f"{where} holds a negative id in {name} ({int(values.min())}); {fix}"
        if values.size and vocab_size is not None and values.max() >= vocab_size:
            return (
                f"{where} holds id {int(values.max())} in {name}, outside the model's vocabulary of {vocab_size:,} "
                "tokens: it was written by another parent; generate the corpus from the model's parent"
            )
    return None


def _stored_damage(table, where: str, k: int | None) -> str | None:
    """What keeps `table`'s stored top-K from being read as numbers of the right shapes and values, or None."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    ids, top, logprobs = (table.column(c).combine_chunks() for c in STORED)
    for name, column, depth in (("input_ids", ids, 1), ("top_ids", top, 2), ("top_logprobs", logprobs, 2)):
        values = _values(column, depth)
        if values is None or not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
            return f"{where} holds {name} that are not lists of numbers"
        if values.null_count:
            return f"{where} holds {values.null_count} null(s) in {name}"
        if name != "top_logprobs" and not pa.types.is_integer(values.type):
            return f"{where} holds {name} that are not whole numbers"
    positions = pc.list_value_length(ids).to_numpy(zero_copy_only=False)  # (rows,)
    for name, column in (("top_ids", top), ("top_logprobs", logprobs)):
        bad = np.flatnonzero(pc.list_value_length(column).to_numpy(zero_copy_only=False) != positions)
        if bad.size:
            return f"{where}: row {bad[0] + 1} has {name} for other than each of its input_ids (ragged rows)"
    widths = {
        name: pc.list_value_length(column.flatten()).to_numpy(zero_copy_only=False)
        for name, column in (("top_ids", top), ("top_logprobs", logprobs))
    }  # (positions,) each
    said = "the record's" if k else "the first row's"
    k = k or (int(widths["top_ids"][0]) if widths["top_ids"].size else 0)
    for name, width in widths.items():
        bad = np.flatnonzero(width != k)
        if bad.size and (width == width[0]).all():
            return f"{where} holds the top {width[0]} {name} at each position, {said} top {k}"
        if bad.size:
            row = _row_of(positions, bad[0])
            return f"{where}: row {row} holds {width[bad[0]]} {name} at a position, {said} {k} (ragged rows)"
    values = _values(logprobs, 2).to_numpy(zero_copy_only=False).astype(np.float64)  # (positions * k,)
    for bad, said in ((~np.isfinite(values), "not finite (NaN or infinite)"), (values > 0, "above 0")):
        if bad.any():
            first = int(np.argmax(bad))
            return (
                f"{where}: {int(bad.sum()):,} top_logprobs are {said} (a log-probability is finite and at most 0), "
                f"the first in row {_row_of(positions, first // k)}"
            )
    return None


def _read_shard(path: Path, folder: Path, where: str):
    """(the shard as a pyarrow Table, None) or (None, why it cannot be read)."""
    import pyarrow as pa
    import pyarrow.json as pj

    if path.stat().st_size == 0:
        return pa.table({}), None  # no rows: said by the caller, as any shard cut short
    # one block for the whole shard: a row longer than a block (a long sample's top-K) is refused by pyarrow
    options = pj.ReadOptions(block_size=max(path.stat().st_size + 1, 1 << 20))
    try:
        return pj.read_json(path, read_options=options), None
    except (pa.ArrowInvalid, OSError) as exc:
        return (
            None,
            f"{where}: {_short(path, folder)} cannot be read ({str(exc).splitlines()[0]}): cut short or damaged",
        )


def _values(column, depth: int):
    """The numbers of a list column `depth` lists deep, flattened; None where it is not that deep."""
    import pyarrow as pa

    for _ in range(depth):
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            return None
        column = column.flatten()
    return column


def _row_of(positions, position: int) -> int:
    """The row (1-based, the line of the shard) that holds flattened `position`, with `positions` per row."""
    import numpy as np

    return int(np.searchsorted(np.cumsum(positions), position, side="right")) + 1


def _sum(column) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(column).as_py() or 0)


def _short(path: Path, folder: Path) -> str:
    return str(path.relative_to(folder)) if path.is_relative_to(folder) else str(path)
