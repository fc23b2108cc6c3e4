"""`gqaify uptrain` and `accelerate launch -m gqaify.uptrain`: the settings from the command line (before torch is
loaded), the run, its summary (once per launch); with `--plan CONFIG`, the memory plan alone."""

from __future__ import annotations

from gqaify.command import quiet_transformers


def command_line(argv: list[str], prog: str) -> None:
    """Uptrain as the command line `argv` says, and print the summary (once per launch); with `--plan CONFIG`,
    print the memory plan of that run under the accelerate config CONFIG instead, and train nothing."""
    from gqaify.uptrain.settings import parse_command_line

    settings, plan_config = parse_command_line(argv, prog)  # --help and bad settings: before torch
    if plan_config is not None:
        from gqaify.auto import is_auto
        from gqaify.errors import UserError
        from gqaify.uptrain.plan import Launch, plan

        if is_auto(settings.micro_batch_size):
            raise UserError(
                "--plan needs a micro_batch_size: auto is chosen on the device when the run begins (from this plan, "
                "at the largest micro-batch that fits); give a number to plan it"
            )
        print(plan(settings, Launch.read(plan_config)).table())
        return

    from accelerate import PartialState

    from gqaify.summary import format_uptrain_summary
    from gqaify.uptrain.train import run

    quiet_transformers()  # loading and saving bars between the training bar's updates
    result = run(settings)
    if PartialState().is_main_process:  # one summary per launch
        print(format_uptrain_summary(result))
