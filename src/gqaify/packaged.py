"""The files gqaify packages: uptraining recipes and accelerate configs (`src/gqaify/recipes`, linked as recipes/ at
the repository root), found by name from any folder once gqaify is installed, as torchtune's configs are; and the
versions gqaify is tested with (`src/gqaify/constraints.txt`, linked as constraints.txt at the root).

    gqaify recipes                                   list them, each with what it is and the command that runs it
    gqaify recipes cp smollm2-135m-mqa my.yaml       copy one out to edit
    gqaify uptrain --recipe smollm2-135m-mqa         run one by name (a path works too, and wins)
    pip install -c "$(gqaify --constraints)" "gqaify[pinned,lora]"   the extras' tested versions too, once installed

Every packaged file is one entry of `RECIPE_REGISTRY` or `LAUNCH_REGISTRY` below (torchtune's `_recipe_registry.py`),
read by the listing, the copy and `--recipe NAME`: a file on disk that no entry names is never found, and a test
fails where the entries and the files disagree. A recipe's paths (`data`, `calib_data`, `eval_data`, `model`) are
read from the working directory, as every path gqaify is given; the packaged recipes name their text as hub datasets
(`name[:config]@split`), what a user has, and each first line runs it offline from a checkout with the local copies
in ../shared/assets as overrides.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gqaify.errors import UserError

RECIPES = Path(__file__).resolve().parent / "recipes"
CONSTRAINTS = Path(__file__).resolve().parent / "constraints.txt"  # pip's -c file of the tested versions
# The words a recipe's printed command leaves for the user to fill, and what each stands for: said beside the command
# (`anywhere`), and a run given one as it is printed is refused at once, never asked of the hub (uptrain's checks).
PLACEHOLDERS = {"MODEL": "a model of your own to convert (a folder, hub id or .gguf file)"}


@dataclass(frozen=True)
class Recipe:
    """An uptraining recipe gqaify packages, declared once: its name and what it converts and trains. Its file is
    recipes/NAME.yaml (what `gqaify recipes cp NAME .` writes and `--recipe NAME` then reads), whose first line is
    the command that runs it."""

    name: str  # `--recipe NAME`, `gqaify recipes cp NAME`
    converts: str  # the parent and the shape it becomes: "SmolLM2-135M-Instruct -> MQA"
    summary: str  # one line: how it converts and trains, and where it runs
    distributed: bool  # written for several processes too (a multi-process accelerate config runs it as it is)

    @property
    def file(self) -> Path:
        return RECIPES / f"{self.name}.yaml"

    @property
    def description(self) -> str:
        processes = "one process or several" if self.distributed else "one process"
        return f"{self.converts} ({processes}): {self.summary}"


@dataclass(frozen=True)
class LaunchConfig:
    """An accelerate config gqaify packages, declared once: `accelerate launch --config_file` reads its file,
    recipes/NAME.yaml (NAME as `accelerate/cpu`), and `--plan NAME` plans the memory a run needs under it."""

    name: str  # "accelerate/NAME"
    processes: int  # its num_processes
    summary: str  # one line: what it launches

    @property
    def file(self) -> Path:
        return RECIPES / f"{self.name}.yaml"

    @property
    def description(self) -> str:
        return f"{self.processes} process{'es' if self.processes > 1 else ''}: {self.summary}"


# Every packaged recipe: a new one is its YAML under recipes/ (its first line the command that runs it) and one
# entry here.
RECIPE_REGISTRY: tuple[Recipe, ...] = (
    Recipe(
        "llama2-7b-gqa8",
        "Llama-2-7B -> GQA-8",
        "the GQA paper's setting adapted (mean pooling), on FineWeb-Edu streamed, in bf16 on 8 GPUs with FSDP",
        distributed=True,
    ),
    Recipe(
        "ref-mha-6L-gqa2",
        "ref-mha-6L -> GQA-2",
        "the small real MHA Llama of ../shared/assets, on TinyStories, a few minutes on a CPU",
        distributed=False,
    ),
    Recipe(
        "smollm2-135m-mla",
        "SmolLM2-135M-Instruct -> MLA 128",
        "latent attention at MQA's cache, fitted layer by layer, then the MQA recipe's training at a lower lr",
        distributed=False,
    ),
    Recipe(
        "smollm2-135m-mla256",
        "SmolLM2-135M-Instruct -> MLA 256",
        "latent attention at two thirds of the cache (no GQA makes it), then the MQA recipe's training",
        distributed=False,
    ),
    Recipe(
        "smollm2-135m-mqa",
        "SmolLM2-135M-Instruct -> MQA",
        "lsq fitted layer by layer, distilled from the parent on five kinds of text (code among them), on a CPU",
        distributed=True,
    ),
)

# Every packaged accelerate config: a new one is its YAML under recipes/accelerate/ and one entry here.
LAUNCH_REGISTRY: tuple[LaunchConfig, ...] = (
    LaunchConfig("accelerate/cpu", 1, "the CPU, full precision"),
    LaunchConfig("accelerate/fsdp", 8, "FSDP2 on 8 GPUs of one machine, bf16"),
    LaunchConfig("accelerate/multi-gpu", 8, "DDP on the GPUs of one machine (set num_processes to their number), bf16"),
    LaunchConfig("accelerate/single-gpu", 1, "one GPU, bf16"),
)


def recipe_names() -> list[str]:
    """Every packaged file's name, as the registries list them: the recipes, then the accelerate configs."""
    return [entry.name for entry in (*RECIPE_REGISTRY, *LAUNCH_REGISTRY)]


def entry(name: str) -> Recipe | LaunchConfig | None:
    """The registry's entry for `name` (with or without .yaml, or as the checkout names it: recipes/NAME.yaml), or
    None."""
    stem = name.removesuffix(".yaml").removeprefix("recipes/")
    return next((e for e in (*RECIPE_REGISTRY, *LAUNCH_REGISTRY) if e.name == stem), None)


def find(name: str) -> Path | None:
    """The packaged file `name` (spelled as `entry` takes it), or None."""
    found = entry(name)
    return None if found is None else found.file


def recipe_by_name(name: str) -> Path | None:
    """The packaged recipe `name` for `--recipe NAME` (as `find`), or None.

    Raises:
        UserError: `name` is a packaged accelerate config: the launch's, which accelerate reads, not a recipe.
    """
    found = entry(name)
    if not isinstance(found, LaunchConfig):
        return None if found is None else found.file
    raise UserError(
        f"--recipe {name} is an accelerate config, not a recipe; pass it to `accelerate launch --config_file "
        f"{found.file} -m gqaify.uptrain --recipe RECIPE`, or to --plan {found.name} for the memory a run needs "
        "under it"
    )


def launch_config(name: str) -> Path:
    """The accelerate config `--plan NAME` names: a path, or a packaged one such as accelerate/fsdp.

    Raises:
        UserError: neither a file nor packaged; a device.
    """
    path = Path(name).expanduser()  # os.path's tests: no error on a name the file system refuses
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        raise UserError(f"--plan {name} is a device, not an accelerate config; give the config file's path")
    found = path if os.path.isfile(path) else find(name)
    if found is None:
        raise UserError(f"--plan {name}: no such accelerate config; give its path, or one gqaify recipes lists")
    return found


def first_line(path: Path) -> str:
    """A recipe's first line without its comment mark: the command that runs it."""
    with open(path) as f:
        return f.readline().lstrip("# ").strip()


def anywhere(path: Path) -> str:
    """The command that runs a recipe from any folder, a wheel's install or a checkout: the commands its comment
    gives by name (its lines `#   gqaify ...`, joined by &&, with what each placeholder stands for); else its first
    line with each packaged file it names as the checkout does (`recipes/accelerate/fsdp.yaml`) given by its
    installed path. (A recipe's first line runs it offline from a checkout, with ../shared's copies of its data: a
    wheel's user has neither.)"""
    with open(path) as f:
        comment = [line for line in f if line.startswith("#")]
    named = [line.removeprefix("#").strip() for line in comment if line.startswith("#   gqaify ")]
    if named:
        return _with_placeholders(" && ".join(named))
    words = first_line(path).split(" ")
    return " ".join(str(found) if (found := _packaged(w)) else w for w in words)


def _with_placeholders(command: str) -> str:
    """`command`, followed by a shell comment saying what each placeholder it names stands for (`PLACEHOLDERS`)."""
    used = [f"{word}: {meaning}" for word, meaning in PLACEHOLDERS.items() if word in command.split()]
    return command + (f"  # {'; '.join(used)}" if used else "")


def _packaged(word: str) -> Path | None:
    """The installed file a checkout-relative word names (`recipes/NAME.yaml`), or None."""
    return find(word) if word.startswith("recipes/") and word.endswith(".yaml") else None


def listing() -> str:
    """The packaged files, as the registries list them: each name with what it is, and under it the command that
    runs it from any folder (a recipe: `anywhere`) or its path (an accelerate config: accelerate reads a file)."""
    entries = (*RECIPE_REGISTRY, *LAUNCH_REGISTRY)
    width = max(len(e.name) for e in entries)
    lines = []
    for e in entries:
        shown = anywhere(e.file) if isinstance(e, Recipe) else str(e.file)
        lines += [f"{e.name.ljust(width)}  {e.description}", f"{' ' * width}  {shown}"]
    return "\n".join(lines)


def copy_out(name: str, destination: str) -> Path:
    """Copy the packaged file `name` to `destination` (a file, or a folder to put it in); never over a file.

    Raises:
        UserError: no such packaged file, `destination` exists as a file, or it cannot be written (its folder not
            writable, a read-only file system, a full disk: the errno's reason); nothing is left behind.
    """
    source = find(name)
    if source is None:
        raise UserError(f"no packaged recipe or config {name!r}; gqaify recipes lists them")
    target = Path(destination).expanduser()
    if target.is_dir():
        target = target / source.name
    if not target.parent.is_dir():
        raise UserError(f"cannot copy to {target}: the folder {target.parent} does not exist; create it first")
    created = False
    try:
        with open(target, "xb") as f:  # created here, or refused: never over a file
            created = True
            f.write(source.read_bytes())
    except FileExistsError:
        raise UserError(f"{target} already exists and is kept; name a new file to copy {name} to") from None
    except OSError as exc:  # a folder not writable, a read-only file system, a full disk: what was begun goes
        if created:
            target.unlink(missing_ok=True)
        raise UserError(f"cannot copy to {target}: {exc.strerror or exc}; choose another place") from None
    return target
