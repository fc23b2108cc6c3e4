"""`accelerate launch -m gqaify.uptrain --recipe FILE [--key value ...]` (or `python -m gqaify.uptrain`): the
uptrain stage's own entry, whose `command_line` `gqaify uptrain` runs too."""

from __future__ import annotations

import sys

from gqaify.command import quiet_transformers, run_command

PROG = "python -m gqaify.uptrain"


def command_line(argv: list[str], prog: str = PROG, stages: tuple = ()) -> None:
    """Uptrain as the command line `argv` says, and print the summary (once per launch); with `--plan CONFIG`,
    print the memory plan of that run under the accelerate config CONFIG instead, and train nothing. `stages`:
    every command's (`gqaify.stages.STAGES`), to name another command's settings file as such."""
    from gqaify.uptrain.settings import parse_command_line

    settings, plan_config = parse_command_line(argv, prog, stages)  # --help and bad settings: before torch
    if plan_config is not None:
        from gqaify.uptrain.plan import Launch, plan

        print(plan(settings, Launch.read(plan_config)).table())
        return

    from accelerate import PartialState

    from gqaify.summary import format_uptrain_summary
    from gqaify.uptrain.train import run

    quiet_transformers()  # loading and saving bars between the training bar's updates
    result = run(settings)
    if PartialState().is_main_process:  # one summary per launch
        print(format_uptrain_summary(result))


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the command line `argv` (default: sys.argv[1:], the process's own, which exits with the status) and
    return its exit status (`gqaify.command`)."""
    from gqaify.stages import STAGES

    words = sys.argv[1:] if argv is None else argv
    return run_command(lambda: command_line(words, prog, STAGES), process_exit=argv is None)


if __name__ == "__main__":
    sys.exit(main())
