"""The repository keeps its promises: README's commands are the ones CI runs."""

from conftest import REPO


def test_ci_runs_the_readme_test_command():
    command = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("python3")]
    assert len(command) == 1
    assert f"\n{command[0]}\n" in (REPO / "README.md").read_text()


def test_readme_main_job_uses_the_same_constraints():
    readme = (REPO / "README.md").read_text()
    assert "pip install -q -c constraints.txt -e . && .venv/bin/gqaify demo" in readme
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text().splitlines()


def test_demo_takes_wikitext_from_shared_beside_the_checkout():
    from conftest import ASSETS
    from gqaify.demo import HUB_WIKITEXT, demo_text

    data, origin = demo_text()
    shared = ASSETS / "text" / "wikitext-2-raw-test.txt"
    if shared.is_file():
        assert data == str(shared) and str(shared) in origin
    else:
        assert data == HUB_WIKITEXT and "hub" in origin
