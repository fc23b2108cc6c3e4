"""Long work shows a progress bar on a terminal: checked under a real pseudo-terminal, not captured pipes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gqaify.testing import CORPUS, build_model, save_with_tokenizer


def _on_a_terminal(argv: list[str], size: tuple[int, int] | None) -> str:
    """What `gqaify ARGV` writes to a pseudo-terminal (of `size` columns and rows; None: one nobody sized)."""
    import fcntl
    import struct
    import termios

    main, child = os.openpty()
    if size is not None:
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "gqaify.entry.cli", *argv], stdout=child, stderr=child)
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child closed its end (EIO on Linux)
            break
        if not chunk:
            break
        chunks.append(chunk)
    process.wait()
    os.close(main)
    assert process.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
@pytest.mark.parametrize("size", [None, (100, 40)], ids=["unsized", "sized"])
def test_a_fit_shows_its_bars_on_a_terminal_sized_or_not(tmp_path, size):
    """On a pseudo-terminal nobody sized (script, ssh -T), tqdm took 0 rows as no room and drew nothing for the
    whole fit; it draws there as on a sized one."""
    src = save_with_tokenizer(
        build_model("llama", num_kv_heads=4, num_attention_heads=4, vocab_size=320), tmp_path / "src"
    )
    (tmp_path / "calib.txt").write_text(CORPUS * 8)
    argv = [str(src), str(tmp_path / "out"), "--kv-heads", "2", "--method", "lsq"]
    argv += ["--calib-data", str(tmp_path / "calib.txt"), "--calib-tokens", "512"]
    shown = _on_a_terminal(["convert", *argv], size)
    assert "calibrating: 100%" in shown and "converting: 100%" in shown, shown
    quiet = _on_a_terminal(["convert", *argv[:1], str(tmp_path / "q"), *argv[2:], "-q"], size)
    assert "calibrating" not in quiet and "converting" not in quiet
