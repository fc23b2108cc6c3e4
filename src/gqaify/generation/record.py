"""A corpus's record, OUT/gqaify.json (`records.CorpusRecord`): begun before the first shard, rewritten as shards
land, complete at the end; read again by a rerun into the same OUT, which goes on only with the same settings,
prompts and scored text."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from gqaify._version import __version__
from gqaify.errors import UserError, raise_if_problems
from gqaify.generation.settings import SCORE_PIN, GenerateSettings, whole_shards_of
from gqaify.output.destination import destination_problems
from gqaify.output.whole import write_text_whole
from gqaify.records import PROVENANCE_FILE, CorpusRecord, read_record, record_text
from gqaify.settings import recorded
from gqaify.text.corpus_format import SHARDS, corpus_full_disk, count_problem, refuse_unreadable_corpus
from gqaify.text.pins import local_path, located_all

if TYPE_CHECKING:
    from gqaify.generation.scoring import ScoredText

LOG = logging.getLogger(__name__)


def new_record(
    s: GenerateSettings, prompts_sha256: str | None, score_sha256: str | None, vocab_size: int
) -> CorpusRecord:
    """The record of a corpus about to begin: no shard yet (`vocab_size`: the parent's, which every reader's model
    must have)."""
    return CorpusRecord(
        version=__version__,
        parent=s.model,
        vocab_size=vocab_size,
        prompts_sha256=prompts_sha256,  # what a resumed run's --prompts must still hold
        score_sha256=score_sha256,  # what a resumed run's --score-data must still give
        settings=recorded(s),
        shards=0,
        samples=0,
        tokens=0,
        complete=False,
    )


def record_to_continue(out: Path, s: GenerateSettings, prompts_sha256: str | None) -> CorpusRecord | None:
    """The record of the corpus this run continues (None: a new one); refuses an OUT that holds anything else, and
    prompts that changed since the corpus began (`prompts_sha256`: the SHA-256 of --prompts now)."""
    if out.is_dir() and all(leftover(p) for p in out.iterdir()):
        for path in out.iterdir():  # what a run killed before its first record left: nothing of its corpus
            path.rmdir() if path.is_dir() else path.unlink()
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        raise_if_problems(destination_problems(out, force=True))
        return None
    if not out.is_dir():
        raise UserError(f"{out} exists and is not a folder; choose another OUT")
    try:
        record = read_record(out)
    except (OSError, ValueError) as exc:
        refuse_unreadable_corpus(
            out,
            exc,
            damaged="choose another OUT",
            later="go on with it with the gqaify that wrote it, or choose another OUT",
        )
        record = None
    if not isinstance(record, CorpusRecord):
        raise UserError(
            f"{out} already exists and is not a corpus gqaify generate wrote; choose another OUT (nothing is replaced)"
        )
    if damaged := count_problem(record, f"{out}: its record {out / PROVENANCE_FILE}"):
        raise UserError(f"{damaged}; choose another OUT")
    theirs = {k: v for k, v in record.settings.items() if k in s.identity()}
    for key in ("model", "prompts"):  # recorded relative, or with links, by earlier versions: as from here
        if isinstance(theirs.get(key), str):
            theirs[key] = local_path(theirs[key])
    if isinstance(theirs.get("score_data"), list):
        theirs["score_data"] = located_all(theirs["score_data"])
    changed = sorted(k for k, v in s.identity().items() if theirs.get(k) != v)
    if changed:
        was = ", ".join(f"{k} {theirs.get(k)!r} -> {getattr(s, k)!r}" for k in changed)
        raise UserError(
            f"{out} holds a corpus sampled with other settings ({was}); rerun with its settings "
            f"(--config {out / PROVENANCE_FILE}) to go on, or choose another OUT"
        )
    then = record.prompts_sha256  # None in a record of an earlier version: not known, not checked
    if prompts_sha256 is not None and then is not None and then != prompts_sha256:
        raise UserError(
            f"--prompts {s.prompts} changed since {out} was sampled from it (SHA-256 {then[:12]}... then, "
            f"{prompts_sha256[:12]}... now); put its prompts back to go on, or choose another OUT for the new ones"
        )
    if not os.access(out, os.W_OK):
        raise UserError(f"cannot write {out}: it is not writable; choose another OUT")
    return record


def check_scored_text(out: Path, record: CorpusRecord | None, s: GenerateSettings, scored: ScoredText) -> None:
    """Refuses to score other text than a rerun's record pins (score_sha256), or to go on with a corpus whose
    --score-data gives other tokens now (`scored`) than when it began. A corpus extended to a larger --tokens
    is compared on the samples it was begun with."""
    sha256 = scored.sha256
    began = record.settings.get("tokens") if record is not None else None
    more = isinstance(began, int) and began < s.tokens and record.score_sha256 is not None
    if more and scored.sha256_of_first(whole_shards_of(began, s)) == record.score_sha256:
        sha256 = record.score_sha256  # the same text, asked for more of it
    raise_if_problems(SCORE_PIN.problem(f"--score-data {' '.join(s.score_data)}", s.score_sha256, sha256))
    then = record.score_sha256 if record is not None else None
    if then is not None and then != sha256:
        raise UserError(
            f"--score-data {' '.join(s.score_data)} gives other tokens than when {out} began (SHA-256 {then[:12]}... "
            f"then, {sha256[:12]}... now); put its text back to go on, or choose another OUT for the new text"
        )


def finish_record(out: Path, record: CorpusRecord, s: GenerateSettings, shards: int, tokens: int) -> None:
    """A corpus that holds the --tokens asked already: mark it complete if a killed run had not, else leave it.

    A lower --tokens changes nothing: the record keeps the --tokens its corpus was sampled to (what `--config
    OUT/gqaify.json` writes again, and what it holds), and no shard is removed: the corpus holds what was asked.
    """
    recorded_tokens = record.settings.get("tokens")
    target = max(s.tokens, recorded_tokens) if isinstance(recorded_tokens, int) else s.tokens
    if tokens >= target and not record.complete:  # a run killed after its last shard, before its record
        write_record(out, record, dataclasses.replace(s, tokens=target), shards, shards * s.batch_size, tokens, True)
    elif s.tokens < target:
        LOG.warning("%s holds %s tokens, more than --tokens %s; left as it is (its record too)", out, tokens, s.tokens)


def write_record(
    out: Path, record: CorpusRecord, s: GenerateSettings, shards: int, samples: int, tokens: int, complete: bool
) -> None:
    """OUT/gqaify.json: `record` with the settings `s`, the counts of what OUT holds now and every file in it."""
    files = sorted(p.name for p in out.iterdir() if p.name != PROVENANCE_FILE)
    now = dataclasses.replace(
        record,
        settings=recorded(s),
        shards=shards,
        samples=samples,
        tokens=tokens,
        complete=complete,
        files=files,
    )
    write_text_whole(out / PROVENANCE_FILE, record_text(now), full_disk=corpus_full_disk(out / PROVENANCE_FILE))


def leftover(path: Path) -> bool:
    """Whether `path` in OUT is what a run killed before its first record leaves: a half-written record, an
    empty shard folder."""
    if path.name == SHARDS and path.is_dir() and not path.is_symlink():
        return not any(path.iterdir())
    return path.name == f".{PROVENANCE_FILE}.tmp" and path.is_file()
