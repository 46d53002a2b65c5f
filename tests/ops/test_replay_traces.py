"""Mooncake and AIPerf fixed-schedule traces: read, sent at their times, with shared prefix blocks.

The engine is tests/ops/fake_engine.py run as its own process; its arrivals
log shows when each request came and what it carried. Its prompt cache works
on 256-token chunks of the fake tokenizer's tokens and reports the cached
prompt tokens in the usage event.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from opstools import replay_cli
from opstools.common import OpsError
from opstools.trace_formats import detect_format, read_requests
from opstools.trace_prompts import BLOCK_TOKENS, SyntheticPrompt

from tests.ops.fake_engine import fake_token_count, start_engine_process

NO_ENGINE = "http://127.0.0.1:9"  # never contacted: these traces fail before anything is sent


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    server = start_engine_process(tmp_path_factory.mktemp("engine"), "--decode-gap", "0.005")
    try:
        yield server
    finally:
        server.stop()


def write_jsonl(path: Path, *lines: dict | str) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def rows_by_id(out: Path) -> dict[str, dict[str, str]]:
    with (out / "records.csv").open() as handle:
        return {row["id"]: row for row in csv.DictReader(handle)}


def replay(trace: Path, url: str, out: Path, *extra: str) -> int:
    return replay_cli.main(["run", str(trace), "--url", url, "--out", str(out), "--quiet", "--no-plots", *extra])


def test_equal_hash_ids_give_equal_prompt_blocks():
    first = SyntheticPrompt(3 * BLOCK_TOKENS, (7, 8, 9), own_seed="a").text()
    second = SyntheticPrompt(3 * BLOCK_TOKENS, (7, 8, 4), own_seed="b").text()
    other = SyntheticPrompt(3 * BLOCK_TOKENS, (5, 8, 9), own_seed="a").text()
    two_blocks = SyntheticPrompt(2 * BLOCK_TOKENS, (7, 8), own_seed="c").text()
    assert first.startswith(two_blocks) and second.startswith(two_blocks)
    assert first != second and first[:40] != other[:40]
    salted = SyntheticPrompt(3 * BLOCK_TOKENS, (7, 8, 9), own_seed="a", salt="run2").text()
    assert salted[:40] != first[:40]
    assert fake_token_count(first) == pytest.approx(3 * BLOCK_TOKENS, rel=0.02)
    partial = SyntheticPrompt(BLOCK_TOKENS + 100, (7, 8), own_seed="d").text()
    assert fake_token_count(partial) == pytest.approx(BLOCK_TOKENS + 100, rel=0.03)
    assert partial[: len(partial) - 40] in first  # a short last block is the start of that block
    beyond = SyntheticPrompt(BLOCK_TOKENS + 300, (7,), own_seed="e").text()
    assert fake_token_count(beyond) == pytest.approx(BLOCK_TOKENS + 300, rel=0.03)


def test_mooncake_trace_keeps_its_send_times_and_shares_prefixes(tmp_path, engine):
    trace = write_jsonl(
        tmp_path / "mooncake.jsonl",
        {"timestamp": 0, "input_length": 1200, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 400, "input_length": 1800, "output_length": 2, "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 800, "input_length": 700, "output_length": 1, "hash_ids": [5, 6]},
    )
    before = len(engine.events())
    code = replay(trace, engine.url, tmp_path / "out", "--trace-salt", "mooncake-test")
    assert code == 0
    arrivals = engine.events()[before:]
    times = [a["t"] - arrivals[0]["t"] for a in arrivals]
    assert times[1] == pytest.approx(0.4, abs=0.2) and times[2] == pytest.approx(0.8, abs=0.2)
    rows = rows_by_id(tmp_path / "out")
    assert [rows[f"line{i}"]["completion_tokens"] for i in (1, 2, 3)] == ["3", "2", "1"]
    for line, tokens in (("line1", 1200), ("line2", 1800), ("line3", 700)):
        assert int(rows[line]["prompt_tokens"]) == pytest.approx(tokens, rel=0.02)
    # line2 repeats blocks 0 and 1 (about 1024 tokens: four 256-token chunks); line3 shares nothing
    assert int(rows["line2"]["cached_tokens"]) == 1024
    assert rows["line1"]["cached_tokens"] == rows["line3"]["cached_tokens"] == "0"
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["format"] == "mooncake" and result["completed"] == 3


def test_aiperf_fixed_schedule_sends_texts_as_written_and_lengths_as_built(tmp_path, engine):
    trace = write_jsonl(
        tmp_path / "aiperf.jsonl",
        {"timestamp": 0, "text_input": "[aiperf-a] one two three", "output_length": 2},
        {"timestamp": 150.5, "input_text": "[aiperf-b] four five", "output_length": 3, "session_id": "s1"},
        {"timestamp": 300, "text": "[aiperf-c] six seven"},
        {"timestamp": 450, "input_length": 600, "output_length": 2},
        {"timestamp": 600, "input_length": 600, "output_length": 2, "hash_ids": [11, 12]},
    )
    before = len(engine.events())
    code = replay(trace, engine.url, tmp_path / "out", "--default-max-tokens", "4", "--trace-salt", "aiperf-test")
    assert code == 0
    arrivals = engine.events()[before:]
    assert [a["prompt_head"] for a in arrivals[:3]] == [
        "[aiperf-a] one two three", "[aiperf-b] four five", "[aiperf-c] six seven"]
    times = [a["t"] - arrivals[0]["t"] for a in arrivals]
    assert times[1] == pytest.approx(0.1505, abs=0.15) and times[4] == pytest.approx(0.6, abs=0.2)
    rows = rows_by_id(tmp_path / "out")
    assert [rows[f"line{i}"]["completion_tokens"] for i in range(1, 6)] == ["2", "3", "4", "2", "2"]
    assert int(rows["line4"]["prompt_tokens"]) == pytest.approx(600, rel=0.03)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 5, "input_length": "x", "output_length": 2, "hash_ids": [1]}',
         "'input_length' must be a whole number of tokens >= 1, got 'x'"),
        ('{"timestamp": -1, "input_length": 9, "output_length": 2, "hash_ids": [1]}',
         "'timestamp' must be a number of milliseconds >= 0"),
        ('{"timestamp": 5, "input_length": 9, "output_length": 0, "hash_ids": [1]}', "'output_length' must be"),
        ('{"timestamp": 5, "input_length": 9, "output_length": 2, "hash_ids": [1, -3]}',
         "'hash_ids' must be a list of whole numbers >= 0"),
        ('{"timestamp": 5, "input_length": 9, "output_length": 2}', "missing 'hash_ids'"),
        ('{"input_length": 9, "output_length": 2, "hash_ids": [1]}', "missing 'timestamp'"),
        ('{"timestamp": 5, "input_length": 9', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_a_malformed_mooncake_line_names_file_and_line(tmp_path, capsys, line, message):
    trace = write_jsonl(tmp_path / "t.jsonl", '{"timestamp": 0, "input_length": 9, "output_length": 2, '
                        '"hash_ids": [1]}', line)
    assert replay(trace, NO_ENGINE, tmp_path / "out", "--format", "mooncake") == 2
    err = capsys.readouterr().err
    assert f"{trace}:2: " in err and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 5, "output_length": 2}', "give exactly one of 'input_length', 'text_input'"),
        ('{"timestamp": 5, "text": "a", "input_length": 3, "output_length": 2}', "(the line has text, input_length)"),
        ('{"timestamp": 5, "text": "a", "hash_ids": [1], "output_length": 2}', "'hash_ids' only go with"),
        ('{"timestamp": 5, "text": "", "output_length": 2}', "'text' must be a non-empty string"),
        ('{"timestamp": 5, "text": "a"}', "no 'output_length'; pass --default-max-tokens"),
        ('{"timestamp": 5, "messages": [{"role": "user", "content": "a"}]}', "'messages' (chat messages"),
        ('{"delay": 5, "text": "a", "output_length": 2}', "'delay'"),
        ('{"text": "a", "output_length": 2}', "missing 'timestamp'"),
    ],
)
def test_a_malformed_aiperf_line_names_file_and_line(tmp_path, capsys, line, message):
    trace = write_jsonl(tmp_path / "t.jsonl", '{"timestamp": 0, "text": "fine", "output_length": 2}', line)
    assert replay(trace, NO_ENGINE, tmp_path / "out", "--format", "aiperf") == 2
    err = capsys.readouterr().err
    assert f"{trace}:2: " in err and message in err
    assert not (tmp_path / "out").exists()


def test_the_format_is_told_by_the_first_line(tmp_path):
    assert detect_format({"offset_s": 0, "prompt": "a", "max_tokens": 1}, "w") == "stream"
    assert detect_format({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}, "w") == "mooncake"
    assert detect_format({"timestamp": 0, "input_length": 5, "output_length": 1}, "w") == "aiperf"
    assert detect_format({"timestamp": 0, "text_input": "a"}, "w") == "aiperf"
    with pytest.raises(OpsError, match="cannot tell the format"):
        detect_format({"prompt": "a"}, "w")
    trace = write_jsonl(tmp_path / "t.jsonl", {"timestamp": 2000, "input_length": 5, "output_length": 1,
                                               "hash_ids": [3]},
                        {"timestamp": 1000, "input_length": 5, "output_length": 1, "hash_ids": [3]})
    requests, fmt = read_requests(trace)
    assert fmt == "mooncake" and [(r.id, r.offset_s) for r in requests] == [("line2", 1.0), ("line1", 2.0)]
    with pytest.raises(OpsError, match="a trace line\\? pass --format mooncake"):
        read_requests(trace, "stream")


def test_a_trace_that_is_not_utf8_or_empty_is_named(tmp_path, capsys):
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"timestamp": 0, "text": "\xff\xfe"}\n')
    assert replay(binary, NO_ENGINE, tmp_path / "out", "--format", "aiperf") == 2
    assert f"trace {binary}: not UTF-8 text" in capsys.readouterr().err
    empty = write_jsonl(tmp_path / "empty.jsonl", "")
    assert replay(empty, NO_ENGINE, tmp_path / "out") == 2
    assert f"requests {empty}: no requests in it" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
