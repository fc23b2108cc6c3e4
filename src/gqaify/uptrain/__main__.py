"""`accelerate launch -m gqaify.uptrain --recipe FILE [--key value ...]` (or `python -m gqaify.uptrain`): the
uptrain stage's own entry, whose `command_line` `gqaify uptrain` runs too."""

from __future__ import annotations

import sys
from pathlib import Path

from gqaify.command import quiet_transformers, run_command
from gqaify.errors import UserError
from gqaify.packaged import shipped

PROG = "python -m gqaify.uptrain"


def command_line(argv: list[str], prog: str = PROG) -> None:
    """Uptrain as the command line `argv` says, and print the summary (once per launch); with `--plan CONFIG`,
    print the memory plan of that run under the accelerate config CONFIG instead, and train nothing."""
    from gqaify.uptrain.settings import parse

    launch_config, argv = _plan_option(argv)
    settings = parse(argv, prog=prog)  # --help and bad settings answer before torch is loaded
    if launch_config is not None:
        from gqaify.uptrain.plan import Launch, plan

        print(plan(settings, Launch.read(launch_config)).table())
        return

    from accelerate import PartialState

    from gqaify.summary import format_uptrain_summary
    from gqaify.uptrain.train import run

    quiet_transformers()  # loading and saving bars between the training bar's updates
    result = run(settings)
    if PartialState().is_main_process:  # one summary per launch
        print(format_uptrain_summary(result))


def _plan_option(argv: list[str]) -> tuple[Path | None, list[str]]:
    """(the accelerate config `--plan CONFIG` names: a path, or a shipped one such as accelerate/fsdp; the rest).

    Raises:
        UserError: --plan without a config, or one that is neither a file nor shipped.
    """
    if "--plan" not in argv:
        return None, argv
    at = argv.index("--plan")
    if at + 1 >= len(argv) or argv[at + 1].startswith("-"):
        raise UserError("--plan needs the accelerate config of the launch, e.g. --plan accelerate/fsdp")
    name, rest = argv[at + 1], argv[:at] + argv[at + 2 :]
    path = Path(name) if Path(name).is_file() else shipped(name)
    if path is None:
        raise UserError(f"--plan {name}: no such accelerate config; give its path, or one gqaify recipes lists")
    return path, rest


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the command line `argv` (default: sys.argv[1:]) and return its exit status (`gqaify.command`)."""
    return run_command(lambda: command_line(sys.argv[1:] if argv is None else argv, prog))


if __name__ == "__main__":
    sys.exit(main())
