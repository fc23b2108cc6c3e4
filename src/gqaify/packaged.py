"""The files gqaify packages: uptraining recipes and accelerate configs (`src/gqaify/recipes`, linked as recipes/ at
the repository root), found by name from any folder once gqaify is installed, as torchtune's configs are; and the
versions gqaify is tested with (`src/gqaify/constraints.txt`, linked as constraints.txt at the root).

    gqaify recipes                                   list them, each with the command that runs it
    gqaify recipes cp smollm2-135m-mqa my.yaml       copy one out to edit
    gqaify uptrain --recipe smollm2-135m-mqa         run one by name (a path works too, and wins)
    pip install -c "$(gqaify --constraints)" gqaify  the tested versions, for a wheel user (pip reads the path)

A recipe's paths (`data`, `calib_data`, `eval_data`, `model`) are read from the working directory, as every path
gqaify is given; the packaged recipes name their text as hub datasets (`name[:config]@split`), what a user has, and
each first line runs it offline from a checkout with the local copies in ../shared/assets as overrides.
"""

from __future__ import annotations

from pathlib import Path

from gqaify.errors import UserError

RECIPES = Path(__file__).resolve().parent / "recipes"
CONSTRAINTS = Path(__file__).resolve().parent / "constraints.txt"  # pip's -c file of the tested versions


def recipe_names() -> list[str]:
    """Every packaged file's name: recipes by their stem, accelerate configs as `accelerate/NAME`."""
    recipes = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    return recipes + sorted(f"accelerate/{p.stem}" for p in (RECIPES / "accelerate").glob("*.yaml"))


def find(name: str) -> Path | None:
    """The packaged file `name` (with or without .yaml, or as the checkout names it: recipes/NAME.yaml), or None."""
    stem = name.removesuffix(".yaml").removeprefix("recipes/")
    if stem not in recipe_names():
        return None
    return RECIPES / f"{stem}.yaml"


def recipe_by_name(name: str) -> Path | None:
    """The packaged recipe `name` for `--recipe NAME` (as `find`), or None.

    Raises:
        UserError: `name` is a packaged accelerate config: the launch's, which accelerate reads, not a recipe.
    """
    found = find(name)
    if found is None or found.parent == RECIPES:
        return found
    stem = found.relative_to(RECIPES).with_suffix("").as_posix()
    raise UserError(
        f"--recipe {name} is an accelerate config, not a recipe; pass it to `accelerate launch --config_file {found} "
        f"-m gqaify.uptrain --recipe RECIPE`, or to --plan {stem} for the memory a run needs under it"
    )


def first_line(path: Path) -> str:
    """A recipe's first line without its comment mark: the command that runs it."""
    with open(path) as f:
        return f.readline().lstrip("# ").strip()


def listing() -> str:
    """The packaged recipes, one a line, with the command that runs each (its `recipes/NAME.yaml` is found by name
    from any folder), then the accelerate configs with their paths (accelerate reads a file)."""
    names = recipe_names()
    width = max(len(n) for n in names)
    shown = [str(find(n)) if n.startswith("accelerate/") else first_line(find(n)) for n in names]
    return "\n".join(f"{n.ljust(width)}  {s}" for n, s in zip(names, shown, strict=True))


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
