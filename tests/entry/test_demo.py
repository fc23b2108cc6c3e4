"""The demo's texts: what every install has (the wheel's tiny-shakespeare, this Python's own texts), none fetched and
none read from beside a checkout; fitted on one part of each kind, judged on another and on a kind never fitted on."""

from __future__ import annotations

from pathlib import Path

import gqaify
from gqaify.entry import demo
from gqaify.entry.demo_texts import SHAKESPEARE, demo_texts
from gqaify.text.loading import load_text, named_texts


def test_the_demos_texts_need_neither_the_hub_nor_shared_beside_a_checkout(tmp_path, monkeypatch, capsys):
    """Offline with no ../shared the demo stopped after 15 s (the hub's WikiText-2, "or give a local file", which it
    took no option for): its texts are the wheel's and this Python's, written into its folder, each said."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no ../shared beside it
    fit, panel = demo.texts_of(tmp_path / "demo")
    said = capsys.readouterr().out
    assert [t.name for t in named_texts(fit)] == ["verse", "code", "docs"]
    assert [t.name for t in named_texts(panel)] == ["shakespeare", "code", "licence"]
    assert "tiny-shakespeare (public domain, shipped with gqaify), first half" in said
    assert "this Python's LICENSE.txt" in said and "none fetched" in said
    assert SHAKESPEARE.parent == Path(gqaify.__file__).resolve().parent / "texts"
    for text in named_texts(fit + panel):
        assert Path(text.source).parent == tmp_path / "demo" / "texts"
        assert load_text(text.source, "test").text  # read as the stages read them, the hub off


def test_the_demo_judges_on_text_it_never_fitted_on_and_on_a_kind_it_never_fitted_on():
    texts = demo_texts()
    fitted = {t.text for t in texts.fit}
    assert not fitted & {t.text for t in texts.judged}
    assert len(texts.judged) >= 3 and {t.name for t in texts.judged} - {"shakespeare", "code"} == {"licence"}
    assert "licence" not in {t.name for t in texts.fit} and texts.missing == []
    verse = SHAKESPEARE.read_text()
    first, second = texts.fit[0].text, texts.judged[0].text
    assert verse.startswith(first) and verse.endswith(second) and len(first) + len(second) >= len(verse) - 2


def test_a_fresh_demo_removes_only_what_its_earlier_run_wrote(tiny, tmp_path, monkeypatch):
    """The demo starts its uptraining afresh after a completed one by removing the run folder whole, with anything of
    the user's put in it, and in a traceback where it is a link. Only what a run writes there goes now."""
    import gqaify.uptrain.train as train
    from gqaify.records import RunRecord
    from gqaify.uptrain.run_folder import save_run

    out = tmp_path / "demo" / "uptrain"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"weights")
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "my notes.txt").write_text("kept")
    save_run(out, RunRecord(version=gqaify.__version__, settings={}, completed=True))
    ran = []
    monkeypatch.setattr(train, "run", lambda settings: ran.append(settings.output_dir))
    texts = [f"stories={tiny['train']}"]
    demo._short_uptrain(str(tiny["parent"]), tiny["converted"], out, texts, texts)
    assert ran == [str(out)] and sorted(p.name for p in out.iterdir()) == ["my notes.txt"]

    elsewhere = tmp_path / "elsewhere"
    out.rename(elsewhere)
    out.symlink_to(elsewhere, target_is_directory=True)  # the run folder a link to a folder of the user's
    save_run(elsewhere, RunRecord(version=gqaify.__version__, settings={}, completed=True))
    demo._short_uptrain(str(tiny["parent"]), tiny["converted"], out, texts, texts)
    assert out.is_symlink() and sorted(p.name for p in elsewhere.iterdir()) == ["my notes.txt"]
