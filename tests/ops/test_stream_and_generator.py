"""The JSONL stream format and the synthetic stream generator."""
from __future__ import annotations

import json
import random
import statistics

import pytest
from opstools import replay_cli
from opstools.common import OpsError
from opstools.generator import GeneratorConfig, generate, parse_histogram, sample_prompt_tokens
from opstools.stream import read_stream


def write_lines(tmp_path, *lines: str):
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_stream_is_read_sorted_by_offset_with_default_ids(tmp_path):
    path = write_lines(
        tmp_path,
        '{"offset_s": 2.5, "prompt": "b", "max_tokens": 3}',
        "",
        '{"id": "first", "offset_s": 0, "prompt_token_ids": [5, 6], "max_tokens": 1, "extra": "ignored"}',
    )
    requests = read_stream(path)
    assert [r.id for r in requests] == ["first", "line1"]
    assert requests[0].completion_prompt() == [5, 6]
    assert requests[1].completion_prompt() == "b"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a"]', "expected a JSON object"),
        ('{"prompt": "a", "max_tokens": 1}', "missing 'offset_s'"),
        ('{"offset_s": "soon", "prompt": "a", "max_tokens": 1}', "'offset_s' must be a number >= 0"),
        ('{"offset_s": 0, "prompt": "a"}', "missing 'max_tokens'"),
        ('{"offset_s": 0, "prompt": "a", "max_tokens": 0}', "'max_tokens' must be an integer >= 1"),
        ('{"offset_s": 0, "max_tokens": 1}', "exactly one of 'prompt' and 'prompt_token_ids'"),
        ('{"offset_s": 0, "prompt": "a", "prompt_token_ids": [1], "max_tokens": 1}', "exactly one of"),
        ('{"offset_s": 0, "prompt_token_ids": [1, -2], "max_tokens": 1}', "list of integers >= 0"),
        ('{"offset_s": 0, "prompt": "", "max_tokens": 1}', "non-empty string"),
    ],
)
def test_bad_lines_are_named_by_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path, '{"offset_s": 0, "prompt": "ok", "max_tokens": 1}', line)
    with pytest.raises(OpsError) as error:
        read_stream(path)
    assert str(error.value).startswith(f"{path}:2: ")
    assert message in str(error.value)


def test_duplicate_ids_missing_and_empty_files_are_errors(tmp_path):
    dup = write_lines(tmp_path, '{"id": "a", "offset_s": 0, "prompt": "x", "max_tokens": 1}',
                      '{"id": "a", "offset_s": 1, "prompt": "y", "max_tokens": 1}')
    with pytest.raises(OpsError, match="id 'a' already used on line 1"):
        read_stream(dup)
    with pytest.raises(OpsError, match="cannot open"):
        read_stream(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(OpsError, match="no requests"):
        read_stream(empty)


SMALL = dict(min_tokens=200, max_tokens=2_000)


def test_generator_is_deterministic_for_a_seed():
    first = [g.request for g in generate(GeneratorConfig(count=30, rate_per_s=2, seed=5, reuse_share=0.5, **SMALL))]
    again = [g.request for g in generate(GeneratorConfig(count=30, rate_per_s=2, seed=5, reuse_share=0.5, **SMALL))]
    other = [g.request for g in generate(GeneratorConfig(count=30, rate_per_s=2, seed=6, reuse_share=0.5, **SMALL))]
    assert first == again
    assert [r.prompt for r in first] != [r.prompt for r in other]


def test_poisson_arrivals_have_the_chosen_rate():
    items = list(generate(GeneratorConfig(count=2000, rate_per_s=4.0, seed=1, min_tokens=10, max_tokens=20)))
    offsets = [g.request.offset_s for g in items]
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    # exponential gaps: standard deviation about equal to the mean
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.15)


def test_lengths_are_log_uniform_between_the_bounds_and_follow_the_word_estimate():
    config = GeneratorConfig(count=1, rate_per_s=1)  # defaults: 9k to 200k tokens
    rng = random.Random(2)
    lengths = [sample_prompt_tokens(rng, config) for _ in range(4000)]
    assert 9_000 <= min(lengths) and max(lengths) <= 200_000
    # log-uniform: the median is the geometric mean of the bounds (42.4k), a quarter lies below 19.5k
    assert statistics.median(lengths) == pytest.approx(42_426, rel=0.08)
    assert sum(n < 19_536 for n in lengths) / len(lengths) == pytest.approx(0.25, abs=0.03)
    items = list(generate(GeneratorConfig(count=3, rate_per_s=1, seed=2, min_tokens=9_000, max_tokens=20_000)))
    for item in items:
        words = len(item.request.prompt.split()) - 1  # the [salt-index] tag
        assert item.approx_prompt_tokens == pytest.approx(words * 13 / 12, rel=0.01)
        assert 9_000 * 0.99 <= item.approx_prompt_tokens <= 20_000 * 1.01


def test_reuse_share_controls_shared_prefixes():
    items = list(generate(GeneratorConfig(count=400, rate_per_s=1, seed=3, reuse_share=0.6, prefix_share=0.9, **SMALL)))
    by_id = {g.request.id: g for g in items}
    reused = [g for g in items if g.reuses is not None]
    assert len(reused) / len(items) == pytest.approx(0.6, abs=0.08)
    for item in reused[:50]:
        parent = by_id[item.reuses].request.prompt
        child = item.request.prompt
        assert by_id[item.reuses].reuses is None  # reuse is of a fresh prompt
        shared = " ".join(parent.split()[: item.shared_words])
        assert child.startswith(shared) and child != parent
        assert len(child.split()) == len(parent.split())


def test_cold_stream_prompts_differ_from_their_first_words():
    items = list(generate(GeneratorConfig(count=200, rate_per_s=1, seed=4, reuse_share=0.0, **SMALL)))
    heads = {g.request.prompt.split()[0] for g in items}
    assert len(heads) == 200


def test_histogram_spec_and_its_errors():
    bins = parse_histogram("9000-16000:75, 64000-200000:25")
    assert [(b.low, b.high, b.weight) for b in bins] == [(9000, 16000, 75.0), (64000, 200000, 25.0)]
    config = GeneratorConfig(count=1, rate_per_s=1, histogram=bins)
    rng = random.Random(1)
    lengths = [sample_prompt_tokens(rng, config) for _ in range(2000)]
    assert all(9_000 <= n <= 16_000 or 64_000 <= n <= 200_000 for n in lengths)
    assert sum(n <= 16_000 for n in lengths) / len(lengths) == pytest.approx(0.75, abs=0.04)
    for bad in ("9000:1", "a-b:1", "16000-9000:1", "9000-16000:0"):
        with pytest.raises(OpsError, match="--length-histogram"):
            parse_histogram(bad)


def test_generate_command_writes_a_stream_the_replay_reads(tmp_path, capsys):
    out = tmp_path / "gen"
    code = replay_cli.main(["generate", "--count", "20", "--rate", "2", "--seed", "9", "--reuse-share", "0.5",
                            "--min-tokens", "300", "--max-tokens", "900", "--out", str(out)])
    assert code == 0
    requests = read_stream(out / "stream.jsonl")
    assert len(requests) == 20
    info = json.loads((out / "generate.json").read_text())
    assert info["count"] == 20 and info["seed"] == 9
    assert "20 requests" in capsys.readouterr().out


def test_generate_calibrates_tokens_per_word_against_tokenize(tmp_path, engine):
    out = tmp_path / "gen"
    code = replay_cli.main(["generate", "--count", "5", "--rate", "1", "--min-tokens", "1000", "--max-tokens", "1000",
                            "--tokenize-url", engine.url, "--out", str(out)])
    assert code == 0
    info = json.loads((out / "generate.json").read_text())
    # the fake tokenizer counts every word and every '.': 13 tokens per 12 words
    assert info["tokens_per_word"] == pytest.approx(13 / 12, rel=0.01)
    assert engine.tokenize_calls == 2
