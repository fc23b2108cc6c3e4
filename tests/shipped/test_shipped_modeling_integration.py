"""A shipped class (GPT-2's) through uptraining: refused without trust_remote_code in a process of its own, then
converted inside the run, trained and saved with its modeling file."""

from gqaify.testing import CORPUS, save_with_tokenizer
from helpers import load, run_uptrain
from test_shipped_modeling import mha_parent


def test_uptrain_trains_and_saves_the_shipped_class(tmp_path):
    """Converted inside the run (kv_heads), trained, and saved: final/ carries the modeling file and reloads."""
    from gqaify.uptrain import parse
    from gqaify.uptrain import run as uptrain

    save_with_tokenizer(mha_parent("gpt2", vocab_size=320), tmp_path / "mha")
    (tmp_path / "train.txt").write_text(CORPUS * 3)
    argv = [
        "--model",
        str(tmp_path / "mha"),
        "--kv_heads",
        "1",
        "--output_dir",
        str(tmp_path / "run"),
        "--data",
        str(tmp_path / "train.txt"),
        "--seq_len",
        "16",
        "--micro_batch_size",
        "2",
        "--max_tokens",
        "320",
        "--save_every",
        "0",
        "--no_progress",
    ]
    done = run_uptrain(argv)
    code, err = done.returncode, done.stderr
    assert code == 2 and "--trust-remote-code" in err, err
    result = uptrain(parse([*argv, "--trust_remote_code"]))
    assert result.steps == 10
    final = tmp_path / "run" / "final"
    assert (final / "modeling_gqaify.py").is_file()
    model = load(final)
    assert type(model).__name__ == "GQAGPT2LMHeadModel" and model.config.num_key_value_heads == 1
    assert model.transformer.h[0].attn.c_attn.weight.shape == (64, 64 + 2 * 16)
