"""Text data through `datasets`, and its tokens: the one loader for evaluation, uptraining and calibration.

DATA is a local file (.txt, .jsonl/.json, .parquet, .csv), a local folder of such files, or a hub dataset
written `name[:config][@split]`, e.g. `Salesforce/wikitext:wikitext-2-raw-v1` (a name that is neither an existing
path nor that is refused as the settings are read: `_source_problem`). Rows are joined with blank lines
("\\n\\n"), the usual perplexity setup. A plain text file is one row, its text kept verbatim (datasets'
default of a row per line would double every newline once joined); it has no columns, so a text column asked of
the sources that have them does not apply to it. Where the hub does not answer, a hub dataset comes
from `datasets`' cache alone, or is refused at once (`gqaify.model.hub.offline_unless_reachable`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gqaify.errors import UserError, one_line, raise_if_problems
from gqaify.logs import muted
from gqaify.model.locations import exists, is_repo_id, lookup_problem
from gqaify.records import PROVENANCE_FILE
from gqaify.text.corpus_format import STORED, corpus_problems, corpus_record, nested_corpus_problem, stored_problem

if TYPE_CHECKING:
    import torch

SILENT = logging.CRITICAL + 1  # a logger's level that lets nothing through

# file suffix -> the `datasets` builder that reads it
_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def is_text_file(source: str) -> bool:
    """Whether `source` names a plain-text file, read whole as one document (no split, no column to speak of)."""
    return _BUILDERS.get(Path(source).suffix.lower()) == "text"


@dataclass(frozen=True)
class NamedText:
    """One text of a panel or a mixture: `NAME=SOURCE`, or SOURCE alone (named by its file's stem or the hub
    dataset's name). A value that is itself an existing path is a SOURCE, `=` and all, unless it also reads as
    NAME=SOURCE with an existing SOURCE: `_named_text_problem` refuses that as ambiguous."""

    name: str
    source: str

    @classmethod
    def parse(cls, value: str) -> NamedText:
        name, sep, source = value.partition("=")
        if sep and _NAME.fullmatch(name) and source and not exists(value):
            return cls(name, source)
        return cls(_default_name(value), value)


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_NAME_RULE = "1 to 64 ASCII letters, digits, '_', '.' or '-', the first a letter or digit"


def _named_text_problem(value: str, option: str) -> str | None:
    """What is wrong with one `NAME=SOURCE` value: a NAME that breaks the rule (where the value is no path
    either), NAME= with no SOURCE, a value that is both an existing file and NAME=SOURCE of an existing SOURCE, or
    a SOURCE that is neither a path nor a hub dataset (`_source_problem`)."""
    name, sep, source = value.partition("=")
    if not sep:
        return _source_problem(value, value, option)
    if exists(value):
        if _NAME.fullmatch(name) and source and exists(source):
            return (
                f"{option} {value} is ambiguous: a file of that name exists, and so does {source}, which it would "
                f"name {name!r}; write ./{value} for the file, or {name}=./{source} for {source} named {name!r}"
            )
        return None
    if not _NAME.fullmatch(name):
        return (
            f"{option} {value}: no such file or folder, and {name!r} is not a text's name (NAME=SOURCE takes a "
            f"NAME of {_NAME_RULE}); check the path, or rename the text"
        )
    if not source.strip():
        return (
            f"{option} {value} names the text {name!r} but no source after '='; write NAME=SOURCE, e.g. {name}=wiki.txt"
        )
    return _source_problem(source, value, option)


def _source_problem(source: str, value: str, option: str) -> str | None:
    """What is wrong with a text's SOURCE (of `value`, as given): a name the file system cannot look up, or a name
    that is no existing path, none meant (`_path_like`: a missing one is `load_rows`' to tell), and no hub dataset."""
    if problem := lookup_problem(source, option):
        return problem
    if exists(source) or _path_like(source) or _hub_dataset(source) is not None:
        return None
    return _no_source(source, value, option)


def _no_source(source: str, value: str, option: str) -> str:
    return (
        f"{option} {value}: no such file or folder, and {source!r} is no hub dataset (owner/name[:config][@split], "
        "e.g. Salesforce/wikitext:wikitext-2-raw-v1@test); check the path or the dataset's name"
    )


def _path_like(data: str) -> bool:
    """Whether `data` is meant as a local path (a data file's suffix, or ./ / ~ first), not as a hub dataset."""
    return Path(data).suffix in _BUILDERS or data.startswith((".", "/", "~"))


def _hub_dataset(data: str) -> tuple[str, str, str] | None:
    """The hub dataset `name[:config][@split]` as (name, config, split), '' for a part not given; None where `data`
    is none (its name no hub repository id, or ':' or '@' followed by nothing)."""
    rest, at, split = data.partition("@")
    name, colon, config = rest.partition(":")
    if not is_repo_id(name) or (colon and not config) or (at and not split):
        return None
    return name, config, split


def _default_name(source: str) -> str:
    path = Path(source).expanduser()
    if path.suffix in _BUILDERS or exists(path):
        return path.stem or path.name or source
    return source.split("@")[0].split(":")[0].rsplit("/", 1)[-1] or source  # a hub dataset: no owner, config, split


def named_texts(values: list[str]) -> list[NamedText]:
    """Each value of a panel (`gqaify eval --data`, uptrain's eval_data) or a mixture as a `NamedText`."""
    return [NamedText.parse(v) for v in values]


def named_texts_problem(values: list[str], option: str) -> str | None:
    """An empty value, a value `_named_text_problem` refuses, or two texts of one name (each row of a report names
    its text): a settings rule."""
    if any(not v.strip() for v in values):
        return f"{option} has an empty value; name a text file, folder or hub dataset"
    for value in values:
        if problem := _named_text_problem(value, option):
            return problem
    names = [t.name for t in named_texts(values)]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        return f"{option} names two texts {twice[0]!r}; name each as NAME=SOURCE (e.g. wiki=wiki.txt)"
    return None


@dataclass(frozen=True)
class TextData:
    source: str
    split: str
    text_column: str
    text: str  # every row joined with "\n\n"
    rows: int


# The column a source of code names its text by, read where the text column asked is the default ("text") and the
# source has none of that name (the Stack's and CodeParrot's files: a mixture's sources share one text_column).
CODE_COLUMN = "content"


def load_rows(
    data: str,
    split: str = "test",
    text_column: str | None = "text",
    streaming: bool = False,
    option: str = "--data",
    vocab_size: int | None = None,
):
    """The `datasets` dataset behind `data`, checked to have a `text_column` (None: any columns).

    A corpus folder (`gqaify generate`) is checked whole before a row is read (`corpus_format.corpus_problems`),
    and local data with stored top-K log-probabilities, not streamed, is checked as it loads
    (`corpus_format.stored_problem`).

    Args:
        streaming: return an `IterableDataset` that reads lazily (for sets larger than memory or disk).
        option: how the user named `data` (e.g. "--data", "eval_data"), for error messages.
        vocab_size: the vocabulary stored token ids must fall in (None: not checked).

    Raises:
        UserError: the data is missing, or has no such column or split; a corpus that is incomplete or damaged.
    """
    import datasets
    from datasets.exceptions import DatasetGenerationError

    datasets.disable_progress_bars()
    path = Path(data).expanduser()
    corpus = False
    builder = None
    try:
        if exists(path):
            builder, files = _local_files(path, option)
            _check_readable(builder, files, option)
            corpus = path.is_dir() and corpus_record(path) is not None
            if corpus:
                raise_if_problems(corpus_problems(path, files, option, vocab_size))
            elif path.is_dir():
                raise_if_problems(nested_corpus_problem(path, option))
            # A local file is one split, whatever it is called: name it as asked so that `split` holds.
            options = {"sample_by": "document"} if builder == "text" else {}
            files_by_split = {split: [str(f) for f in files]}
            with muted("datasets", SILENT):  # a file it cannot parse is reported below, in one line
                dataset = datasets.load_dataset(
                    builder, data_files=files_by_split, split=split, streaming=streaming, **options
                )
            if builder == "text" and text_column not in (None, "text"):
                # Plain text has no columns: its one column ("text") is the text, whatever column is asked of the
                # sources that have them (a panel of a .txt and a .jsonl whose column is "content").
                dataset = dataset.rename_column("text", text_column)
        elif _path_like(data):
            raise UserError(f"{option} {data}: no such file or folder; check the path")
        else:
            dataset = _load_hub(data, split, streaming, option)
    except UserError:
        raise
    except DatasetGenerationError as exc:  # a file its builder cannot parse
        raise UserError(_unreadable(option, data, builder, exc)) from exc
    except ValueError as exc:  # unknown split, bad config name
        raise UserError(f"{option} {data}: {exc}; check --split and the config name") from exc
    except (FileNotFoundError, ConnectionError, OSError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
        raise UserError(f"{option} {data} could not be loaded ({problem}); check the name or path") from exc
    columns = dataset.column_names  # None for some streamed sets: then a missing column shows on first read
    if columns is not None and text_column == "text" and "text" not in columns and CODE_COLUMN in columns:
        dataset = dataset.rename_column(CODE_COLUMN, "text")
        columns = dataset.column_names
    if columns is not None and text_column is not None and text_column not in columns:
        raise UserError(
            f"{option} {data} has no column {text_column!r}; pass {_column_option(option)} with one of {columns}"
        )
    if exists(path) and not corpus and not streaming and set(STORED) <= set(columns):
        fix = "write it again with gqaify generate --top-logprobs K"
        raise_if_problems(stored_problem(dataset.data.table, f"{option} {data}", fix, vocab_size=vocab_size))
    return dataset


def unavailable(data: str, split: str, option: str, streaming: bool = False) -> str | None:
    """Why the source `data` cannot be read now, found as its reading would find it (`load_rows`) but never reading
    what can be: a local path that does not exist; where the hub does not answer, a hub dataset that datasets'
    cache cannot give (a streamed one never can). None for an existing path, and for a hub dataset while the hub
    answers (fetching it is the run's work). A check: it never raises.

    Args:
        streaming: whether the text is read lazily (uptrain's `streaming`, and a calibration's first characters).
    """
    from gqaify.model.hub import unreachable

    if exists(data) or (not _path_like(data) and unreachable() is None):
        return None
    try:
        with muted("datasets", SILENT):
            load_rows(data, split, None, streaming=streaming, option=option)
    except UserError as exc:
        return str(exc)
    return None


def _load_hub(data: str, split: str, streaming: bool, option: str):
    """The hub dataset `name[:config][@split]` (its own split, where a mixture's sources need different ones, else
    `split`): from the hub, or from `datasets`' cache where the hub does not answer.

    Raises:
        UserError: the hub does not answer and the dataset is not in the cache (a streamed one never is).
    """
    import datasets

    from gqaify.model.hub import offline_unless_reachable

    hub = _hub_dataset(data)
    if hub is None:
        raise UserError(_no_source(data, data, option))
    name, config, own_split = hub
    split = own_split or split
    with offline_unless_reachable() as why:
        if why is not None and streaming:
            raise _unreachable(data, option, why)
        try:
            return datasets.load_dataset(name, config or None, split=split, streaming=streaming)
        except ConnectionError as exc:  # offline: datasets' "Couldn't reach ... on the Hub"
            raise _unreachable(data, option, why or _cause(exc)) from exc


def _unreachable(data: str, option: str, why: str) -> UserError:
    return UserError(
        f"{option} {data} is not a local path and the Hugging Face hub could not be reached ({why}); check the "
        f"network (or HF_ENDPOINT, HF_HUB_OFFLINE), or give a local file; a dataset loaded once is kept in "
        f"datasets' cache"
    )


def _column_option(option: str) -> str:
    """The option that names the column of the text `option` gives: --text-column for --data, --calib-text-column for
    --calib-data, --score-text-column for generate's --score-data; a recipe's key for uptrain's keys (its eval_data
    is read by text_column too)."""
    if option.startswith("--"):
        return f"--{option[2:].removesuffix('data')}text-column"
    return "calib_text_column" if option == "calib_data" else "text_column"


def load_text(
    data: str, split: str = "test", text_column: str = "text", option: str = "--data", max_chars: int | None = None
) -> TextData:
    """Load `data` and join its `text_column` into one string.

    Args:
        max_chars: read rows lazily and stop once this many characters are joined (the last row whole).

    Raises:
        UserError: the data is missing, has no such column or split, or holds no text.
    """
    if max_chars is None:
        dataset = load_rows(data, split, text_column, option=option)
        rows = [row for row in dataset[text_column] if isinstance(row, str)]
    else:
        rows, chars = [], 0
        try:
            with muted("datasets", SILENT):  # a file it cannot parse is reported below, in one line
                for row in load_rows(data, split, text_column, streaming=True, option=option):
                    if isinstance(text := row.get(text_column), str):
                        rows.append(text)
                        chars += len(text) + 2
                        if chars >= max_chars:
                            break
        except (ValueError, OSError) as exc:  # a streamed file its builder cannot parse, found on reading
            path = Path(data).expanduser()
            files = sorted(path.iterdir()) if path.is_dir() else [path]
            json = any(_BUILDERS.get(f.suffix) == "json" for f in files)
            raise UserError(_unreadable(option, data, "json" if json else None, exc)) from exc
    text = "\n\n".join(rows)
    if not text.strip():
        raise UserError(f"{option} {data} ({split}, column {text_column!r}) holds no text; check the file or split")
    return TextData(data, split, text_column, text, len(rows))


@dataclass(frozen=True)
class Tokens:
    ids: torch.Tensor  # (N,) token ids
    chars: int  # the characters of the text they cover


def tokenize(tokenizer, text: str, max_tokens: int | None = None, what: str = "--data") -> Tokens:
    """The token ids of `text`, cut after its first `max_tokens`, and the characters they cover.

    Args:
        what: how the user named the text (e.g. "--calib-data wiki.txt"), for the error message.

    Raises:
        UserError: fewer than 2 tokens (no next token to predict).
    """
    import torch

    offsets = getattr(tokenizer, "is_fast", False)  # where each token ends in the text (fast tokenizers only)
    encoded = tokenizer(text, return_offsets_mapping=offsets, verbose=False)
    ids, chars = encoded["input_ids"], len(text)
    if max_tokens is not None and len(ids) > max_tokens:
        ids = ids[:max_tokens]
        chars = encoded["offset_mapping"][max_tokens - 1][1] if offsets else len(tokenizer.decode(ids))
    if len(ids) < 2:
        raise UserError(f"{what} gives {len(ids)} token(s); it needs at least 2: give it more text")
    return Tokens(torch.tensor(ids), chars)


def _local_files(path: Path, option: str) -> tuple[str, list[Path]]:
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors*")):
        raise UserError(
            f"{option} {path} is a model folder (config.json and its weights), not text; give a text file, a folder "
            "of text files, or a corpus gqaify generate wrote"
        )
    # a folder's data files; gqaify.json is the record gqaify writes beside a corpus (`gqaify generate`), not data
    data_files = (p for p in path.rglob("*") if p.suffix in _BUILDERS and p.name != PROVENANCE_FILE)
    files = sorted(data_files) if path.is_dir() else [path]
    # a named pipe or a device would block in open(), or be read as no file at all
    if odd := next((f for f in files if not f.is_file()), None):
        raise UserError(
            f"{option} {odd} is not a regular file or folder (a named pipe or a device); give a file or a folder"
        )
    if not files:
        raise UserError(f"{option} {path} holds no {', '.join(sorted(_BUILDERS))} files; point it at text data")
    builders = {_BUILDERS.get(f.suffix) for f in files}
    if None in builders or len(builders) > 1:
        raise UserError(f"{option} {path}: use files of one kind, one of {', '.join(sorted(_BUILDERS))}")
    return builders.pop(), files


_SNIFF_BYTES = 1 << 16


def _check_readable(builder: str, files: list[Path], option: str) -> None:
    """Refuse local files that are binary where text is expected (a weights file renamed .txt, random bytes).

    Raises:
        UserError: naming the file and the first byte that cannot be UTF-8 text.
    """
    for path in files:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
        if builder == "parquet":
            if head[:4] != b"PAR1":
                raise UserError(f"{option} {path} is not a parquet file (it lacks the PAR1 mark); check the file")
            continue
        at = head.find(b"\0")
        if at < 0:
            try:
                head.decode("utf-8")
            except UnicodeDecodeError as exc:
                cut = len(head) == _SNIFF_BYTES and exc.start >= len(head) - 3  # a character cut by the sample
                at = -1 if cut else exc.start
        if at >= 0:
            raise UserError(
                f"{option} {path} is not text (binary data at byte {at:,}); point it at UTF-8 text "
                "(.txt, .jsonl, .csv) or a .parquet file"
            )


def _unreadable(option: str, data: str, builder: str | None, exc: BaseException) -> str:
    """The one line for a local file that `builder` could not parse (datasets' error in `exc`)."""
    if builder == "json":
        return f"{option} {data} is not valid JSON lines: {_cause(exc)}; fix the file"
    return f"{option} {data} could not be read ({_cause(exc)}); check the file's format"


def _cause(exc: BaseException) -> str:
    """The innermost message of an exception chain (datasets wraps the parser's error)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return one_line(exc)


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


def tokens_sha256(ids) -> str:
    """SHA-256 of token ids (tensors of them, in order, as int64): what run.json records of uptrain's data, and a
    scored corpus of the text it scored."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for t in ids:
        digest.update(t.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()
