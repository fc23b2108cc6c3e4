"""`gqaify uptrain --help` in a process of its own: every field of the settings, with its default."""

from __future__ import annotations

from gqaify.uptrain import UptrainSettings
from helpers import (
    run_uptrain,
)

# -- settings and recipes ------------------------------------------------------------------------------------


def test_help_lists_every_field_with_its_default():
    import dataclasses

    done = run_uptrain(["--help"])
    assert done.returncode == 0
    for field in dataclasses.fields(UptrainSettings):
        assert f"--{field.name}" in done.stdout
    assert "(default: 256)" in done.stdout  # seq_len
