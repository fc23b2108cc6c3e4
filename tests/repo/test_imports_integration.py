"""What is imported when: --help and usage errors answer without torch; `import gqaify` loads nothing heavy; a
mean conversion loads only what it uses. Checked in a fresh interpreter, by the modules present afterwards."""

import json
import subprocess
import sys

import pytest

from gqaify.testing import build_model, save

HEAVY = ("torch", "transformers", "accelerate", "datasets", "matplotlib")


def loaded_after(code: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--bogus"], ["bogus"]])
def test_help_and_usage_errors_load_nothing_heavy(argv):
    code = (
        f"from gqaify.entry.cli import main\nimport contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()), "
        f"contextlib.redirect_stderr(io.StringIO()):\n    main({argv!r})"
    )
    assert loaded_after(code) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "--help"],
        ["eval", "--help"],
        ["uptrain", "--help"],
        ["convert", "a", "b", "--kv-heads", "two"],
        ["eval", "m", "--data", "d"],
        ["convert", "--config", "nowhere.yaml"],
    ],
)
def test_a_command_parses_its_settings_without_transformers(argv):
    """The settings parser is gqaify's own (transformers' HfArgumentParser loaded its package: 2 s of --help)."""
    code = (
        f"from gqaify.entry.cli import main\nimport contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()), "
        f"contextlib.redirect_stderr(io.StringIO()):\n    main({argv!r})"
    )
    assert loaded_after(code) == []


def test_import_gqaify_is_light_and_names_resolve_on_use():
    assert (
        loaded_after(
            "import gqaify; gqaify.ConvertSettings; gqaify.EvalSettings; gqaify.UptrainSettings; gqaify.__version__"
        )
        == []
    )
    assert "torch" in loaded_after("import gqaify; gqaify.convert")


def test_a_mean_conversion_loads_only_torch(tmp_path):
    src = save(build_model("llama", num_kv_heads=4), tmp_path / "src")
    code = f"import gqaify\ngqaify.convert({str(src)!r}, {str(tmp_path / 'out')!r}, kv_heads=2, progress=False)"
    assert loaded_after(code) == ["torch"]
