"""`streamasr bench-model` runs the dev set and reports well-formed figures (no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_model_reports_each_engine(tmp_path):
    out = tmp_path / "bm.json"
    proc = subprocess.run([sys.executable, "-m", "streamasr.cli", "bench-model", "--engines", "ours-int8", "--threads", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    [run] = report["runs"]
    assert run["engine"] == "ours-int8" and report["utterances"] == len(run["latency_s"]) >= 10
    assert 0 < run["rtf"] and run["wer"] <= 0.10
    peak = run["traced_peak_kib"]
    assert 0 < peak["median"] <= peak["max"]
    assert "ours-int8" in proc.stdout and "traced peak KiB" in proc.stdout


def test_wer_counts_words_said_where_the_reference_has_none():
    """WER is (substitutions + deletions + insertions) / reference words: here 4 reference words, all
    recognized, and 2 words against an empty reference (2 insertions), so 2 / 4."""
    from streamasr.testdata import wer

    assert wer(["go forward ten meters", ""], ["go forward ten meters", "thank you"]) == 2 / 4


def test_normalize_reads_every_digit_group_separator():
    """1,200,000 written with both group commas is one number, 1.2 million; a comma and a space
    separates two numbers (the cards' "five five")."""
    from streamasr.testdata import normalize, wer

    assert normalize("1,200,000 people") == "one million two hundred thousand people"
    assert wer(["one million two hundred thousand people"], ["1,200,000 people."]) == 0
    assert normalize("5, 5") == "five five"


def test_a_repeat_of_zero_is_refused_with_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "streamasr.cli", "bench-model", "--engines", "ours-int8", "--repeat", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--repeat and --threads must be 1 or more" in proc.stderr and "Traceback" not in proc.stderr


def test_normalize_reads_ordinals_as_words():
    """"1st" is "first", not "one" and "saint"; WER must not count a spelling as errors."""
    from streamasr.testdata import normalize, wer

    assert normalize("The 1st of May, the 22nd, the 40th and the 101st") == (
        "the first of may the twenty second the fortieth and the one hundred first")
    assert wer(["the first of may"], ["the 1st of May"]) == 0


def test_wer_refuses_lists_of_different_lengths():
    import pytest

    from streamasr.testdata import wer

    with pytest.raises(ValueError, match="2 references against 1 hypotheses"):
        wer(["a b", "c"], ["a b"])


def test_an_unknown_engine_or_model_is_refused_without_a_traceback():
    """An engine that is not one of the four, or a model that does not exist, is the operator's typo:
    said as an error with exit status 2, before any engine is loaded, not as a traceback."""
    for args, said in ((["--engines", "ours"], "--engines"), (["--engines", "ours-fp16"], "--engines"),
                       (["--engines", "ours-int8,fw-int16"], "--engines"),
                       (["--model", "whisper-huge", "--engines", "ours-int8"], "unknown model 'whisper-huge'")):
        proc = subprocess.run([sys.executable, "-m", "streamasr.cli", "bench-model", *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr[-2000:])
        assert said in proc.stderr, (args, proc.stderr[-2000:])
