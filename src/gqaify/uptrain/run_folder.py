"""An uptraining run's folder: its claim, what makes it this run, its checkpoints, its final model, and what a run
that failed leaves there (`left_after_failure`).

    output_dir/
        run.json               the settings that define the run and the SHA-256 of its data's tokens (a rerun
                               must match both to resume), how far it went, and the checkpoints it wrote here
                               (`records.RunRecord`); `--config DIR/run.json` reruns the run in DIR, wherever
                               the folder has been moved or copied since
        checkpoints/step-N/    model, optimizer, schedule, random generators and data position, as safetensors and
                               JSON (`checkpoint_files`: nothing is read back with pickle); only those run.json
                               lists are resumed from or removed (`checkpoint_files.Checkpoints`)
        final/                 a plain Hugging Face checkpoint, gqaify.json and the model card

Everything here is written to a hidden name and renamed into place when complete (`whole.written_whole`), so
a run killed at any moment leaves only complete checkpoints; a run that never trained leaves the folder as it
was found.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from gqaify._version import __version__
from gqaify.command import Left
from gqaify.conversion.card import Uptrained, model_card
from gqaify.conversion.record import ConversionRecord
from gqaify.errors import PEER_STOPPED, ResourceError, UserError
from gqaify.output.claims import CLAIM_INSIDE, claimed
from gqaify.output.destination import write_provenance
from gqaify.output.whole import is_full_disk, readable_as_umask_allows, written_whole
from gqaify.records import RUN_FILE, RunRecord, UptrainedRecord, Uptraining, as_json, read_record_file
from gqaify.settings import current_names, defaults, recorded, text_lists
from gqaify.text.loading import NamedText
from gqaify.text.pins import local_path
from gqaify.uptrain.checkpoint_files import Progress, latest_checkpoint, named_checkpoints, named_step, write_json
from gqaify.uptrain.curve import FORECAST_FILE, PLOT_FILE, REPORT_FILE
from gqaify.uptrain.metrics import METRICS, METRICS_CSV, eval_curve, read_metrics
from gqaify.uptrain.settings import RESUMABLE_CHANGES, UptrainSettings

CHECKPOINTS = "checkpoints"
CONVERTED = "converted"  # the model converted by a run given a source and kv_heads
FINAL = "final"
LOG = logging.getLogger(__name__)


def what_is_left(out: Path, steps: int, made: list[str]) -> str:
    """What an interrupted run leaves (its own checkpoints: those of `made`, the names run.json lists), and how to go
    on from it."""
    latest = latest_checkpoint(out / CHECKPOINTS, made)
    if latest is None:
        return (
            f"training had started but saved no checkpoint yet; {out} holds its settings and metrics: rerun the "
            "same command to start it again"
        )
    step = named_step(latest.name)
    return f"the last checkpoint is step {step} of {steps}, in {latest}: rerun the same command to resume from it"


# The settings that may name a local file or folder (the lists: each a SOURCE or NAME=SOURCE), compared by where
# they lead, not by how they are spelled
PATH_SETTINGS = ("model", "output_dir", "distill_from", "parent")
PATH_LIST_SETTINGS = ("data", "eval_data", "calib_data")


def _identity(s: UptrainSettings, processes: int) -> dict:
    values = recorded(s, leave_out=RESUMABLE_CHANGES)
    return _located({**values, "processes": processes})


def _located(values: dict) -> dict:
    """`values` with each setting that names an existing local file or folder made absolute, links resolved
    (relative to the working directory, for a run.json written before with relative paths too): `s-gqa2`,
    `s-gqa2/`, `./s-gqa2` and its absolute path are one model. A hub name, or a path that is not there, is kept as
    it is."""

    def found(value):
        return local_path(value) if isinstance(value, str) else value

    def text_found(value):  # a text's SOURCE located, its NAME= kept only where given (as run.json has always held)
        if not isinstance(value, str):
            return value
        text = NamedText.parse(value)
        return local_path(value) if text.source == value else f"{text.name}={local_path(text.source)}"

    changed = {k: found(values[k]) for k in PATH_SETTINGS if k in values}
    if isinstance(values.get("output_dir"), str):  # where the run is, even before it exists: absolute
        changed["output_dir"] = str(Path(found(values["output_dir"])).expanduser().absolute())
    changed |= {k: [text_found(v) for v in values[k]] for k in PATH_LIST_SETTINGS if isinstance(values.get(k), list)}
    return {**values, **changed}


@dataclass(frozen=True)
class Found:
    """output_dir as a run found it, before its claim: whether it existed, which of the run's names (`RUN_NAMES`) it
    held, and every local path the run reads (`read_paths`), which nothing of the run's removes. A run that never
    trained leaves it so (`undo_claim`)."""

    out: Path
    existed: bool
    names: set[str]
    reads: list[Path]

    @classmethod
    def of(cls, out: Path, s: UptrainSettings) -> Found:
        return cls(out, out.exists(), run_files(out), read_paths(s))


@contextlib.contextmanager
def claimed_by_launch(out: Path, accelerator):
    """`claims.claimed` on output_dir, held by the launch's main process for the whole run; where another run holds
    it, every process of this launch is refused with the same line.

    Raises:
        UserError: another gqaify run (its pid named) is writing output_dir, or its claim's name holds something
            else.
    """
    from accelerate.utils import broadcast_object_list

    with contextlib.ExitStack() as held:
        said, failed = [None], None  # (refused: True for a UserError, its line), as every rank learns it
        if accelerator.is_main_process:
            try:
                held.enter_context(claimed(out, "gqaify uptrain", option="output_dir", inside=True))
            except BaseException as exc:  # every rank hears of it: none waits for a main process that stopped
                said = [(isinstance(exc, UserError), str(exc))]
                failed = exc
        if accelerator.num_processes > 1:
            broadcast_object_list(said)
        if failed is not None:
            raise failed
        if said[0] is not None:
            refused, line = said[0]
            raise UserError(line) if refused else ResourceError(f"{PEER_STOPPED}; nothing was written: rerun it")
        yield


def claim_output_dir(out: Path, s: UptrainSettings, processes: int, accelerator, data_sha256: str) -> RunRecord:
    """The record of `out`'s run (run.json), written if new; refuses a folder that holds another run or other
    files. A run recorded there that never trained (killed while converting) with other settings or data is
    replaced, and the line says what changed and what it replaces.

    Args:
        data_sha256: the SHA-256 of the training data's tokens (`data.training_loader`); a run recorded before run.json
            held it is not compared.

    Raises:
        UserError: `out` holds another run's checkpoints (with different settings or data) or unrelated files, or
            a run.json gqaify cannot read.
    """
    identity = _identity(s, processes)
    if (out / RUN_FILE).exists():
        run = read_run_record(out)
        # a setting added since: it trained at its default; a text since made a list of texts: a list of one
        had = _located(text_lists(UptrainSettings, {**defaults(UptrainSettings), **run.settings}))
        _check_recorded(out, had)
        # a run's identity is its settings, not where its folder is: a run moved or copied resumes where it is
        differs = [k for k in identity if k != "output_dir" and had.get(k) != identity[k]]
        recorded = run.data_sha256 if run.data_sha256 is not None else data_sha256  # an earlier run.json: not said
        if (differs or recorded != data_sha256) and not run.started and not _holds_anything(out / CHECKPOINTS):
            # a run that was stopped before it trained (killed while converting): nothing of it to keep
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                replaced = remove_run_files(out, run_files(out), reads=read_paths(s))
                change = (
                    "; ".join(f"{k} was {had.get(k)!r}, now {identity[k]!r}" for k in differs) or "its data changed"
                )
                LOG.warning(
                    "output_dir %s held a run that never trained (%s): replaced its %s; nothing else there was touched",
                    out,
                    change,
                    ", ".join(replaced) or "nothing",
                )
            return _new_run(out, identity, accelerator, data_sha256)  # in the folder this run had claimed
        if differs:
            k = differs[0]
            raise UserError(
                f"output_dir {out} holds another run's checkpoints (it had {k}={had.get(k)!r}, now "
                f"{identity[k]!r}); rerun with {k} as it had to go on with that run, or use a new output_dir (this "
                "one is left as it is)"
            )
        if recorded != data_sha256:
            raise UserError(
                f"data {' '.join(s.data)} changed since the run in output_dir {out} began (its tokens' SHA-256 was "
                f"{recorded[:12]}, now {data_sha256[:12]}); restore the data to go on with this run, or use a new "
                "output_dir to train on it as it is now"
            )
        return _as_it_is_now(out, run, identity)
    if out.exists() and any(p.name != CLAIM_INSIDE for p in out.iterdir()):  # this run's own claim aside
        raise UserError(f"output_dir {out} is not empty and holds no gqaify run; choose a new or empty folder")
    return _new_run(out, identity, accelerator, data_sha256)


def _holds_anything(folder: Path) -> bool:
    """Whether `folder` is a link, or a folder with anything in it: checkpoints/ of a run replaced as one that never
    trained must hold nothing (what it held would be removed with it)."""
    return folder.is_symlink() or folder.is_dir() and any(folder.iterdir())


def _as_it_is_now(out: Path, run: RunRecord, identity: dict) -> RunRecord:
    """The record of the run `out` holds, as a resumed run keeps it: at the output_dir it is in now (moved or copied
    since it was written), listing the checkpoints it made that are still there (a run.json of an earlier gqaify,
    which lists none: the folders named as gqaify names them, `named_checkpoints`)."""
    root = out / CHECKPOINTS
    made = run.checkpoints if run.checkpoints is not None else named_checkpoints(root)
    made = [name for name in made if (root / name).exists() or (root / name).is_symlink()]
    return dataclasses.replace(run, settings={**run.settings, "output_dir": identity["output_dir"]}, checkpoints=made)


def _check_recorded(out: Path, had: dict) -> None:
    """Refuse a run.json whose settings are not what any run records: a value of the wrong type (a damaged record,
    which would otherwise be compared, and called another run's).

    Raises:
        UserError: the setting and what is wrong with it; the folder is left as it is.
    """
    names = {f.name for f in dataclasses.fields(UptrainSettings)}
    try:
        UptrainSettings(**{k: v for k, v in had.items() if k in names})
    except UserError as exc:
        raise UserError(
            f"output_dir {out}'s {RUN_FILE} is damaged ({exc}): the run cannot resume from it; use a new output_dir "
            "(this one is left as it is)"
        ) from None


def _new_run(out: Path, identity: dict, accelerator, data_sha256: str) -> RunRecord:
    """A new run's record, written to `out`/run.json (the folder made if need be) by the main process.

    Raises:
        ResourceError: the disk is full; run.json is written whole or not at all, and a folder made for it is
            removed again.
    """
    run = RunRecord(version=__version__, settings=identity, data_sha256=data_sha256, checkpoints=[])
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        made = not out.exists()
        try:
            out.mkdir(parents=True, exist_ok=True)
            save_run(out, run)
        except OSError as exc:
            if not is_full_disk(exc):
                raise
            if made:  # empty: run.json was not written
                with contextlib.suppress(OSError):
                    out.rmdir()
            raise ResourceError(f"no space left on the disk of output_dir {out}; nothing was written") from exc
    accelerator.wait_for_everyone()
    return run


def read_run_record(out: Path) -> RunRecord:
    """The record in `out`/run.json (read from that file, whatever else `out` holds), its settings under their names
    now (an earlier gqaify's run.json names a setting renamed since under its former name: `Settings.renamed`).

    Raises:
        UserError: it cannot be read as a run's record (damaged, of a later gqaify, or not a run's).
    """
    try:
        run = read_record_file(out / RUN_FILE)
    except (OSError, ValueError) as exc:  # never "delete it": the checkpoints beside it are the run's
        version = _version_in(out / RUN_FILE)
        if version in (None, __version__):
            raise UserError(
                f"output_dir {out}'s {RUN_FILE} is damaged ({exc}): the run cannot resume from it; use a new "
                "output_dir (this one is left as it is)"
            ) from None
        raise UserError(
            f"output_dir {out}'s {RUN_FILE} was written by gqaify {version}, which this gqaify ({__version__}) cannot "
            f"read ({exc}); resume the run with gqaify {version}, or use a new output_dir"
        ) from None
    if not isinstance(run, RunRecord):
        raise UserError(f"output_dir {out} is not empty and holds no gqaify run; choose a new or empty folder")
    settings = current_names(UptrainSettings, run.settings, f"output_dir {out}'s {RUN_FILE}")
    return dataclasses.replace(run, settings=settings)


def _version_in(file: Path) -> str | None:
    """The gqaify version a record file says wrote it; None where it says none or cannot be read."""
    try:
        version = json.loads(file.read_text()).get("version")
    except (OSError, ValueError, AttributeError):
        return None
    return version if isinstance(version, str) else None


def save_run(out: Path, run: RunRecord) -> None:
    """`run` as `out`/run.json, written whole: every change to a run's record is saved here."""
    write_json(out / RUN_FILE, as_json(run))


# What a run writes in its output_dir, by name: all it ever removes there (never anything else of that folder).
RUN_NAMES = (RUN_FILE, CONVERTED, CHECKPOINTS, FINAL, METRICS, METRICS_CSV, PLOT_FILE, FORECAST_FILE, REPORT_FILE)


def run_files(out: Path) -> set[str]:
    """The names of `RUN_NAMES` present in `out` (links included)."""
    return {name for name in RUN_NAMES if (out / name).exists() or (out / name).is_symlink()}


def read_paths(s: UptrainSettings) -> list[Path]:
    """Every local file or folder the run reads (its model, parent, teacher, texts), links resolved."""
    values = _located({k: getattr(s, k) for k in (*PATH_SETTINGS, *PATH_LIST_SETTINGS)})
    named = [values[k] for k in PATH_SETTINGS if k != "output_dir" and values[k]]
    named += [v for k in PATH_LIST_SETTINGS for v in values[k] or ()]
    return [Path(NamedText.parse(v).source) for v in named if Path(NamedText.parse(v).source).is_absolute()]


def remove_run_files(out: Path, names: set[str], reads: list[Path]) -> list[str]:
    """Remove `names` (each one of `RUN_NAMES`) from `out`, except any that is or holds a path the run reads
    (`read_paths`): a model the run trains is never removed, however it is named (a run file inside a folder the run
    reads is still the run's). A link is removed, never what it leads to. Returns what was removed, in `RUN_NAMES`'
    order."""
    removed = []
    for name in (n for n in RUN_NAMES if n in names):
        path = out / name
        if not path.is_symlink():
            real = path.resolve()
            if any(r == real or real in r.parents for r in reads):  # what the run reads, or a folder holding it
                continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(name + ("/" if name in (CONVERTED, CHECKPOINTS, FINAL) else ""))
    return removed


def undo_claim(found: Found) -> None:
    """Remove what a run that never trained wrote (of `RUN_NAMES`, those not `found` in output_dir when it began), so
    that output_dir is left as it was found; a folder made for the run goes too, if nothing else is in it."""
    out = found.out
    remove_run_files(out, run_files(out) - found.names, reads=found.reads)
    if not found.existed:
        with contextlib.suppress(OSError):
            out.rmdir()


def left_after_failure(found: Found, steps: int, run: RunRecord, main_process: bool) -> Left:
    """What a run of `steps` that failed leaves in output_dir, as the line that ends it says it (`command.Left`):
    where it never started training (its record, `run`, says so), output_dir as it was `found` (the main process
    removes what the run wrote there: `undo_claim`), nothing written; else its checkpoints, from which a rerun
    resumes (`what_is_left`)."""
    disk = f"output_dir {found.out}"
    if not run.started:
        if main_process:
            undo_claim(found)
        nothing = "nothing was written"
        return Left(nothing, f"{nothing}: rerun the same command", f"{nothing}: free some space and rerun", disk)
    left = what_is_left(found.out, steps, run.checkpoints or [])
    return Left(left, left, f"{left}, once space is freed", disk)


@dataclass(frozen=True)
class Trained:
    """The model a run trains, as it was read: its folder (whose gqaify.json carries over to final/) and the dtype
    it was saved in (final/ is saved in it again)."""

    path: str
    dtype: object  # a torch.dtype


def save_final(
    accelerator, model, tokenizer, trained: Trained, out: Path, s, progress: Progress, run: RunRecord
) -> None:
    """output_dir/final: a plain checkpoint in the trained model's dtype, gqaify.json provenance, and the model
    card with what uptraining measured (and the recovery plot)."""
    model_path, dtype = trained.path, trained.dtype
    state = accelerator.get_state_dict(model)  # gathers FSDP shards; on the main process only
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    unwrapped = accelerator.unwrap_model(model)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    for alias, name in _tied(unwrapped).items():  # FSDP gathers tied weights as copies: make them one tensor again
        if alias in state and name in state:
            state[alias] = state[name]
    with written_whole(out / FINAL) as partial:
        unwrapped.save_pretrained(partial, state_dict=state)
        # save_pretrained names the dtype of the parameters trained (float32) in config.json; the weights are `dtype`
        unwrapped.config.dtype = dtype
        unwrapped.config.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        readable_as_umask_allows(partial)  # safetensors writes its files 0600: final/ is read as every output is
        uptrain = Uptraining(
            version=__version__,
            model=model_path,
            steps=progress.step,
            tokens=progress.tokens,
            settings=_located(recorded(s)),  # paths absolute: `gqaify uptrain --config final/gqaify.json`
            data_sha256=run.data_sha256,
        )
        converted = ConversionRecord.read(Path(model_path))
        if converted is None:  # a model gqaify did not convert: the uptraining is all there is to say
            write_provenance(partial, UptrainedRecord(version=__version__, uptrain=uptrain))
            return
        record = converted.uptrained(uptrain)
        _save_card(partial, record, out, s, progress, run)
        write_provenance(partial, record)


def _tied(model) -> dict[str, str]:
    """Each name of a parameter that is another's (tied embeddings), mapped to the first name it has; transformers
    saves such a parameter once only when the state dict's tensors are one too."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases[name] = first.setdefault(id(param), name)
    return {alias: name for alias, name in aliases.items() if alias != name}


def _save_card(folder: Path, record: ConversionRecord, out: Path, s, progress: Progress, run: RunRecord) -> None:
    """folder/README.md: the conversion's model card with what uptraining measured, and the recovery plot."""
    _, perplexities = eval_curve(read_metrics(out / METRICS))
    plot = None
    if (out / "recovery.png").is_file():
        shutil.copyfile(out / "recovery.png", folder / "recovery.png")
        plot = "recovery.png"
    uptrained = Uptrained(
        tokens=progress.tokens,
        steps=progress.step,
        data=s.data,
        eval_data=s.eval_data,
        distill_from=s.distill_from if s.distill_weight > 0 else None,
        perplexity_before=perplexities[0] if perplexities else None,
        perplexity_after=perplexities[-1] if len(perplexities) > 1 else None,
        parent_perplexity=run.parent_perplexity,
        plot=plot,
    )
    model_card(record, uptrained).save(folder / "README.md")
