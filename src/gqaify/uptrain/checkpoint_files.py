"""A run's checkpoints: what each holds, in files that hold data and nothing else (safetensors and JSON), how one is
written whole and read back, and which are kept.

    checkpoints/step-N/
        model.safetensors          every weight (tied ones once: `state.json` names their aliases)
        optimizer.safetensors      the optimizer's tensors (AdamW's moments and step counts), by parameter name
        state.json                 the optimizer's parameter groups, the schedule, the loss scaler
        rng-R.json                 process R's random generators (Python, NumPy, torch, the accelerator's)
        progress.json              where the run stands (`Progress`)
        gqaify-files.json          every file the save wrote (`rotate` removes only those)

A folder in checkpoints/ is the run's own only where gqaify can prove it wrote it there (`Checkpoints`): a real
folder, named as gqaify names it, that run.json lists (`RunRecord.checkpoints`: recorded in the run folder, so that
a user's copy, step-0000006.bak with the very files gqaify wrote, is not taken for one). Only those are resumed from
and removed; anything else (a copy, a link to a folder elsewhere) is left alone and named in a warning.

accelerate's own `save_state` stores the schedule, the run's progress and the random generators as pickles, and
its `load_state` reads them back with `weights_only=False`: a run folder someone sent, or one on a shared disk,
could then run code when resumed. Nothing here is read with pickle: a checkpoint is as safe to resume as a
safetensors model is to load.

The model and the optimizer go through torch's distributed state-dict API (`torch.distributed.checkpoint.
state_dict`), whole (`full_state_dict`): the same files whether the run had one process, DDP or FSDP2, and the
same code reads them back under any of them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
from collections.abc import Collection
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from gqaify.errors import UserError
from gqaify.output.whole import readable_as_umask_allows, written_whole
from gqaify.records import RUN_FILE

LOG = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
FORMAT = 1  # state.json's "format": what this module writes and reads


def rng_file(rank: int) -> str:
    return f"rng-{rank}.json"


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kwargs)


def save_training_state(folder: Path, accelerator, model, optimizer, scheduler) -> None:
    """Write the model, optimizer, schedule, loss scaler and every process's random generators into `folder`.
    Call it in every process (FSDP gathers the shards from all of them); the main process writes the shared
    files, each process its own `rng-R.json`."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = get_model_state_dict(model, options=_options())
    optim = get_optimizer_state_dict(model, _torch_optimizer(optimizer), options=_options())
    if accelerator.is_main_process:
        weights, aliases = _once(weights)
        save_file({k: v.contiguous() for k, v in weights.items()}, folder / MODEL_FILE)
        tensors, settings = _flat_optimizer(optim)
        save_file(tensors, folder / OPTIMIZER_FILE)
        scaler = accelerator.scaler.state_dict() if accelerator.scaler is not None else None
        state = {
            "format": FORMAT,
            "aliases": aliases,
            "optimizer": settings,
            "scheduler": scheduler.state_dict(),
            "scaler": scaler,
        }
        (folder / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
    (folder / rng_file(accelerator.process_index)).write_text(json.dumps(_rng_state()) + "\n")


def load_training_state(folder: Path, accelerator, model, optimizer, scheduler) -> None:
    """Read back what `save_training_state` wrote into the prepared model, optimizer and schedule, and this process's
    random generators.

    Raises:
        UserError: the checkpoint is not in this format (an earlier gqaify's accelerate pickles, which are never
            loaded) or is damaged; nothing of the run is changed.
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _read_state(folder)
    rng_name = rng_file(accelerator.process_index)
    with _damage_in(folder, MODEL_FILE):
        weights = load_file(folder / MODEL_FILE)
        for alias, name in state["aliases"].items():
            weights[alias] = weights[name]
    with _damage_in(folder, OPTIMIZER_FILE):
        tensors = load_file(folder / OPTIMIZER_FILE)
    with _damage_in(folder, rng_name):
        rng = json.loads((folder / rng_name).read_text())
    with _damage_in(folder, STATE_FILE):
        groups, schedule, scaler = state["optimizer"], state["scheduler"], state["scaler"]
    # what parses but holds the wrong things is damage too, not an internal error; nothing is set before all is read
    with _damage_in(folder, MODEL_FILE):
        set_model_state_dict(model, weights, options=_options())
    with _damage_in(folder, OPTIMIZER_FILE):
        set_optimizer_state_dict(
            model, _torch_optimizer(optimizer), _nested_optimizer(tensors, groups), options=_options()
        )
    with _damage_in(folder, STATE_FILE):
        scheduler.load_state_dict(schedule)
        if accelerator.scaler is not None and scaler is not None:
            accelerator.scaler.load_state_dict(scaler)
    with _damage_in(folder, rng_name):
        _set_rng_state(rng)


@contextlib.contextmanager
def _damage_in(folder: Path, name: str):
    """What goes wrong reading or applying the checkpoint's file `name` as a `UserError` naming that file: the errors
    a damaged file raises (safetensors' SafetensorError for a header too large, an OverflowError for a random
    generator's state out of range), never an internal error."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, OverflowError, SafetensorError) as exc:
        said = f"{type(exc).__name__}: {exc}" if not isinstance(exc, (OSError, ValueError)) else exc
        raise _damaged(folder, said, name) from None


def _read_state(folder: Path) -> dict:
    """state.json of the checkpoint `folder`, checked for this format.

    Raises:
        UserError: there is none (a checkpoint of an earlier gqaify: accelerate's pickles), or it is damaged.
    """
    file = folder / STATE_FILE
    if not file.is_file():
        raise UserError(
            f"checkpoint {folder} was written by an earlier gqaify as pickles, which can run code when read and are "
            "never loaded; resume it with the gqaify that wrote it if you trust its origin, or start a new output_dir"
        )
    try:
        state = json.loads(file.read_text())
        if state.get("format") != FORMAT or not isinstance(state.get("aliases"), dict):
            raise ValueError(f"format {state.get('format')!r}, expected {FORMAT}")
    except (OSError, ValueError, AttributeError) as exc:
        raise _damaged(folder, exc, STATE_FILE) from None
    return state


def _damaged(folder: Path, exc: Exception | str, name: str) -> UserError:
    return UserError(
        f"checkpoint {folder}'s {name} is damaged ({exc}); move the checkpoint out of its checkpoints/ folder to "
        "resume from the one before it"
    )


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper (`AcceleratedOptimizer.optimizer`), or `optimizer`."""
    return getattr(optimizer, "optimizer", optimizer)


def _once(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(`weights` with each tensor stored once, the names left out mapped to the name kept): safetensors refuses
    two names for one storage (tied embeddings)."""
    kept, aliases, seen = {}, {}, {}
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            kept[name] = tensor
    return kept, aliases


def _flat_optimizer(optim: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(the tensors of an optimizer's full state dict, named `PARAM/KEY`; the rest, for JSON: its parameter groups
    and any value of the state that is not a tensor)."""
    tensors, other = {}, {}
    for param, values in optim["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{param}/{key}"] = value.detach().contiguous()
            else:
                other.setdefault(param, {})[key] = value
    return tensors, {"param_groups": optim["param_groups"], "other": other}


def _nested_optimizer(tensors: dict[str, torch.Tensor], settings: dict) -> dict:
    """The full optimizer state dict `_flat_optimizer` flattened."""
    state: dict[str, dict] = {param: dict(values) for param, values in settings["other"].items()}
    for name, tensor in tensors.items():
        param, _, key = name.rpartition("/")
        state.setdefault(param, {})[key] = tensor
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in settings["param_groups"]]
    return {"state": state, "param_groups": groups}


def _rng_state() -> dict:
    """This process's random generators as JSON values (torch's states as lists of bytes)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(mt), gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


PROGRESS_FILE = "progress.json"
WRITTEN_FILE = "gqaify-files.json"  # in a checkpoint: every file its save wrote (`rotate` removes only those)


@dataclass
class Progress:
    """Where the run is; saved in every checkpoint as progress.json (`save_checkpoint`)."""

    step: int = 0  # optimizer steps done
    tokens: int = 0  # training tokens consumed, all processes
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches this process has consumed in `epoch`
    seconds: float = 0.0  # training wall-clock, evaluations and checkpoints left out (the curve's x against time)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def checkpoint_name(step: int) -> str:
    """The name of the checkpoint a run writes after `step` optimizer steps: step-0000006."""
    return f"step-{step:07d}"


def named_step(name: str) -> int | None:
    """The step a checkpoint's name says, where it is exactly a name gqaify gives (`checkpoint_name`); None for any
    other name (step-0000006.bak, step-6)."""
    digits = name.removeprefix("step-")
    if digits == name or not (digits.isascii() and digits.isdigit()):
        return None
    return int(digits) if checkpoint_name(int(digits)) == name else None


def _partial(name: str) -> bool:
    """Whether `name` is the hidden name a checkpoint is written under (`written_whole`: .step-N.tmp)."""
    return name.startswith(".") and name.endswith(".tmp") and named_step(name[1:-4]) is not None


@dataclass(frozen=True)
class Checkpoints:
    """What a run folder's checkpoints/ holds, as gqaify can prove it. The run's own checkpoints (`ours`, oldest
    first) are real folders (not links) in a real checkpoints/, named as gqaify names them, that run.json lists as
    made in this run folder (`RunRecord.checkpoints`): only these are resumed from, and only these are removed.
    Everything else (`others`: a user's copy such as step-0000006.bak, which carries the very files gqaify wrote; a
    link, wherever it leads; a folder run.json does not list) is left alone, each with why it is not the run's."""

    ours: list[Path]
    others: list[tuple[Path, str]]

    @classmethod
    def of(cls, root: Path, made: Collection[str]) -> Checkpoints:
        """The checkpoints/ folder `root`, sorted by `made` (the names run.json lists)."""
        if root.is_symlink():
            return cls([], [(root, f"a link to {root.resolve()}")])
        if not root.is_dir():
            return cls([], [])
        ours, others = [], []
        for path in sorted(p for p in root.iterdir() if not _partial(p.name)):
            if path.is_symlink():
                others.append((path, f"a link to {path.resolve()}"))
            elif named_step(path.name) is None:
                others.append((path, "not named as gqaify names its checkpoints"))
            elif not path.is_dir() or path.name not in made:
                others.append((path, f"{RUN_FILE} does not list it as a checkpoint gqaify wrote there"))
            else:
                ours.append(path)
        return cls(sorted(ours, key=lambda p: named_step(p.name)), others)

    @property
    def latest(self) -> Path | None:
        """The run's own checkpoint with the most steps, or None."""
        return self.ours[-1] if self.ours else None


def latest_checkpoint(root: Path, made: Collection[str]) -> Path | None:
    """The run's own checkpoint in `root` with the most steps (`Checkpoints`), or None."""
    return Checkpoints.of(root, made).latest


def named_checkpoints(root: Path) -> list[str]:
    """The names of the real folders in `root` named as gqaify names checkpoints: what a run.json of an earlier gqaify,
    which listed none, is taken to have made (that gqaify took every such folder for its own; copies with other
    names and links are still left alone)."""
    if root.is_symlink() or not root.is_dir():
        return []
    return sorted(
        p.name for p in root.iterdir() if named_step(p.name) is not None and not p.is_symlink() and p.is_dir()
    )


def resume_point(root: Path, made: Collection[str], steps: int, main_process: bool) -> Path | None:
    """The checkpoint a run of `steps` resumes from: the latest of its own in `root` (`Checkpoints`), or None to
    start afresh. Whatever else `root` holds is left alone, and named in a warning (by the main process).

    Raises:
        UserError: `root` is a link (checkpoints would be written and removed through it, outside output_dir), or
            something not the run's has the name of a checkpoint the run may write (writing it would replace that);
            nothing is changed.
    """
    found = Checkpoints.of(root, made)
    if root.is_symlink():
        raise UserError(
            f"{root} is a link to {root.resolve()}, and gqaify writes and removes checkpoints only in a folder of the "
            "run's own; replace the link with a folder (to keep the run on another disk, link output_dir itself)"
        )
    after = named_step(found.latest.name) if found.latest is not None else 0
    for path, why in found.others:
        step = named_step(path.name)
        if step is not None and after < step <= steps:
            raise UserError(
                f"{path} is not a checkpoint of this run ({why}), and the run would write its step {step} checkpoint "
                f"there; move it out of {root} and rerun (nothing was changed)"
            )
    for path, why in found.others if main_process else ():
        LOG.warning("left %s alone (%s): gqaify resumes from and removes only checkpoints it wrote there", path, why)
    return found.latest


def load_checkpoint(folder: Path, accelerator, loop, steps: int) -> None:
    """The loop (`state.LoopState`: its model, optimizer, schedule and `Progress`) as checkpoint `folder` of a run of
    `steps` holds it.

    Raises:
        UserError: the checkpoint is an earlier gqaify's (pickles, never loaded) or damaged.
    """
    progress = read_progress(folder, steps)
    load_training_state(folder, accelerator, loop.model, loop.optimizer, loop.scheduler)
    loop.progress.load_state_dict(progress)


def read_progress(folder: Path, steps: int) -> dict:
    """progress.json of the checkpoint `folder` of a run of `steps`: every field of `Progress` with its type, at the
    step the folder's name says, within the run.

    Raises:
        UserError: it is missing or damaged (a step other than its folder's, or past the run's end).
    """
    try:
        found = json.loads((folder / PROGRESS_FILE).read_text())
        types = {f.name: f.type for f in fields(Progress)}
        if not isinstance(found, dict) or set(found) != set(types):
            raise ValueError(f"fields {sorted(found) if isinstance(found, dict) else found!r}")
        for name, value in found.items():
            number = (int, float) if types[name] == "float" else int
            if isinstance(value, bool) or not isinstance(value, number) or value < 0:
                raise ValueError(f"{name} {value!r}")
        if found["step"] != named_step(folder.name):
            raise ValueError(f"step {found['step']}, in the checkpoint of step {named_step(folder.name)}")
        if found["step"] > steps:
            raise ValueError(f"step {found['step']}, past the run's {steps} steps")
    except (OSError, ValueError) as exc:
        raise UserError(
            f"checkpoint {folder}'s {PROGRESS_FILE} is damaged ({exc}); move the checkpoint out of its checkpoints/ "
            "folder to resume from the one before it"
        ) from None
    return found


def save_checkpoint(accelerator, folder: Path, loop) -> None:
    """The loop's state (`state.LoopState`) as the checkpoint `folder` (checkpoints/`checkpoint_name`), written into
    a hidden folder (`save_training_state`: safetensors and JSON, no pickle) and renamed into place when every
    process has written."""
    main, progress = accelerator.is_main_process, loop.progress
    with written_whole(folder, main_process=main) as partial:
        if main:
            partial.mkdir(parents=True)
        accelerator.wait_for_everyone()
        save_training_state(partial, accelerator, loop.model, loop.optimizer, loop.scheduler)
        accelerator.wait_for_everyone()
        if main:
            write_json(partial / PROGRESS_FILE, progress.state_dict())
            readable_as_umask_allows(partial)  # safetensors writes its files 0600: as every output is
            written = sorted(p.relative_to(partial).as_posix() for p in partial.rglob("*") if p.is_file())
            write_json(partial / WRITTEN_FILE, {"files": [*written, WRITTEN_FILE]})
    accelerator.wait_for_everyone()


def rotate(root: Path, keep: int, made: Collection[str]) -> list[str]:
    """Remove all but the `keep` latest of the run's own checkpoints (`Checkpoints`; nothing else in `root` is
    touched): each whole where it holds only what gqaify wrote there (`WRITTEN_FILE` lists it), else only those
    files, the rest left with a warning (a checkpoint written before the list existed is removed whole). Returns the
    names of those that are no longer checkpoints."""
    removed = []
    for old in Checkpoints.of(root, made).ours[:-keep]:
        listed = old / WRITTEN_FILE
        if not listed.is_file():
            shutil.rmtree(old)
            removed.append(old.name)
            continue
        try:
            ours = set(json.loads(listed.read_text())["files"])
        except (OSError, ValueError, KeyError, TypeError):
            LOG.warning("kept %s: its %s cannot be read, so what gqaify wrote there is not known", old, WRITTEN_FILE)
            continue
        removed.append(old.name)
        present, folders = _contents(old)
        if present <= ours:
            shutil.rmtree(old)
            continue
        for name in sorted(ours & present):
            (old / name).unlink()
        for folder in folders:
            with contextlib.suppress(OSError):
                folder.rmdir()  # emptied by the above; a folder holding the user's files stays
        LOG.warning(
            "kept %s: it holds files gqaify did not write (%s); its checkpoint files were removed",
            old,
            ", ".join(sorted(present - ours)[:3]),
        )
    return removed


def _contents(folder: Path) -> tuple[set[str], list[Path]]:
    """(every file and link under `folder`, by its path there; every real folder under it, deepest first): links are
    listed, never followed."""
    files, folders = set(), []
    for here, dirs, names in os.walk(folder):
        base = Path(here)
        files |= {(base / n).relative_to(folder).as_posix() for n in names}
        files |= {(base / d).relative_to(folder).as_posix() for d in dirs if (base / d).is_symlink()}
        folders += [base / d for d in dirs if not (base / d).is_symlink()]
    return files, sorted(folders, key=lambda p: len(p.parts), reverse=True)


def write_json(path: Path, value: dict) -> None:
    """`value` as the JSON file `path`, written whole."""
    with written_whole(path) as partial:
        partial.write_text(json.dumps(value, indent=2, default=str) + "\n")
