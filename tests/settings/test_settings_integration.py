"""A YAML alias bomb given as a --config file, in a process of its own: refused at once in bounded memory."""

import subprocess
import sys

import pytest

# -- a --config file from anyone: bounded in size, aliases and nesting; messages that say what is wrong


def alias_bomb(key: str) -> str:
    """Nine levels of nine aliases under `key`: 400 bytes that stand for 9**9 strings."""
    levels = ["  - &a0 [lol]"] + [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return f"{key}:\n" + "\n".join(levels) + "\nout: o\nkv_heads: 1\n"


@pytest.mark.parametrize("key", ["src", "unknown"])
def test_a_yaml_alias_bomb_is_refused_at_once_in_bounded_memory(tmp_path, key):
    """It grew by 25 MB/s under a known key (a type error's repr expanded every alias) until killed."""
    (tmp_path / "bomb.yaml").write_text(alias_bomb(key))
    limited = (
        "import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "from gqaify.entry.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", limited, "convert", "--config", "bomb.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--config bomb.yaml uses a YAML alias (*name) (line 3); write the value itself" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.yaml"]
