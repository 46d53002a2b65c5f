"""Needle prompts: seeded, exact token lengths, the answer checker, and the four phases."""
from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from opstools import needle_cli
from opstools.common import OpsError
from opstools.needle import (
    DEFAULT_LENGTHS,
    answer_has_code,
    build_prompt,
    fit_prompt,
    make_specs,
)

from tests.ops.fake_engine import fake_token_count

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


async def fake_count(text: str) -> int:
    return fake_token_count(text)


def fit(spec, salt, counter=fake_count):
    return asyncio.run(fit_prompt(spec, salt, counter))


def test_specs_are_deterministic_for_a_seed():
    assert make_specs(list(DEFAULT_LENGTHS), 11) == make_specs(list(DEFAULT_LENGTHS), 11)
    codes = {s.code for s in make_specs(list(DEFAULT_LENGTHS), 11)}
    assert len(codes) == len(DEFAULT_LENGTHS)
    assert codes != {s.code for s in make_specs(list(DEFAULT_LENGTHS), 12)}
    for spec in make_specs([1000] * 50, 3):
        assert 0.0 <= spec.depth <= 1.0
        assert len(spec.code) == 9 and spec.code[4] == "-"


@pytest.mark.parametrize("length", [300, 12_800, 50_001])
def test_prompts_hit_the_exact_length_with_the_code_at_its_depth(length):
    spec = make_specs([length], seed=5)[0]
    prompt = fit(spec, "nabc")
    assert prompt.exact and fake_token_count(prompt.text) == length
    assert prompt.tokenize_calls <= 12
    assert prompt.text.count(spec.code) == 1
    assert prompt.text.startswith("Session nabc.\n")
    assert prompt.text.endswith("Answer: The secret code is")
    body_start = prompt.text.index("\n\n")
    body_end = prompt.text.rindex("Question:")
    position = (prompt.text.index(spec.code) - body_start) / (body_end - body_start)
    assert position == pytest.approx(spec.depth, abs=0.03)


def test_same_seed_and_salt_give_the_same_prompt_and_a_new_salt_changes_the_start():
    spec = make_specs([4000], seed=8)[0]
    first, again = fit(spec, "n1-first"), fit(spec, "n1-first")
    assert first.text == again.text
    other = asyncio.run(fit_prompt(spec, "n1-again", fake_count, like=first))
    assert other.text != first.text and other.tokens == first.tokens == 4000
    assert other.text.split("\n", 1)[1] == first.text.split("\n", 1)[1]  # only the salt line differs
    assert other.tokenize_calls == 1
    longer_salt = asyncio.run(fit_prompt(spec, "n1-again-and-again", fake_count, like=first))
    assert longer_salt.tokens == 4000 and longer_salt.filler_words != first.filler_words


def test_pad_words_close_a_gap_that_whole_words_overshoot():
    # a tokenizer where every filler sentence ends in a 3-token '.': words alone jump past some targets
    async def lumpy(text: str) -> int:
        return fake_token_count(text) + 2 * text.count(".")

    spec = make_specs([2_003], seed=1)[0]
    prompt = fit(spec, "n", lumpy)
    assert asyncio.run(lumpy(prompt.text)) == 2_003
    assert prompt.exact


def test_an_unreachable_length_gives_the_closest_below():
    async def doubled(text: str) -> int:  # every piece two tokens: an odd target cannot be hit
        return 2 * len(text.split())

    spec = make_specs([1_001], seed=1)[0]
    prompt = fit(spec, "n", doubled)
    assert not prompt.exact and prompt.tokens == 1_000


def test_a_length_below_the_fixed_text_is_an_error():
    spec = make_specs([20], seed=1)[0]
    with pytest.raises(OpsError, match="without filler already has"):
        fit(spec, "n")


@pytest.mark.parametrize(
    ("answer", "found"),
    [
        (" K7QD-9XRM.", True),
        ("k7qd 9xrm", True),
        ("The secret code is K7QD9XRM, as stated.", True),
        ("K7QD-9XRN", False),
        ("K7QD", False),
        ("I could not find a code.", False),
        ("", False),
    ],
)
def test_checker_recognises_found_and_not_found(answer, found):
    assert answer_has_code(answer, "K7QD-9XRM") is found


def test_build_prompt_puts_the_needle_between_filler_sentences():
    spec = make_specs([1000], seed=2)[0]
    text = build_prompt(spec, "s", 100)
    assert f". The secret code is {spec.code}. " in text or text.count(spec.code) == 1


def results(out: Path) -> list[dict[str, str]]:
    with (out / "results.csv").open() as handle:
        return list(csv.DictReader(handle))


def test_phases_without_restart_find_every_code(engine, tmp_path, capsys):
    out = tmp_path / "out"
    code = needle_cli.main(["--url", engine.url, "--lengths", "2000,9000", "--seed", "4", "--skip-restart",
                            "--reset-prefix-cache", "--out", str(out)])
    assert code == 0
    rows = results(out)
    assert [(r["length"], r["phase"]) for r in rows] == [
        ("2000", "cold"), ("9000", "cold"), ("2000", "l1"), ("9000", "l1"), ("2000", "cold-again"),
        ("9000", "cold-again")]
    assert all(r["found"] == "yes" and r["prompt_tokens"] == r["length"] for r in rows)
    cold = {r["length"]: r for r in rows if r["phase"] == "cold"}
    again = {r["length"]: r for r in rows if r["phase"] == "cold-again"}
    l1 = {r["length"]: r for r in rows if r["phase"] == "l1"}
    for length in ("2000", "9000"):
        assert cold[length]["cached_tokens"] == again[length]["cached_tokens"] == "0"  # the salt made them cold
        assert int(l1[length]["cached_tokens"]) > 0
        assert l1[length]["served_from_cache"] == "yes"
        assert int(l1[length]["connector_hits"]) >= int(length) - 256  # from the engine's /metrics
        assert again[length]["salt"] == cold[length]["salt"].replace("-first", "-again")
    assert ("/reset_prefix_cache" in [path for path, _ in engine.profile_calls])
    assert "6 of 6 answers found" in capsys.readouterr().out


def test_a_wrong_answer_is_not_found_and_fails_the_run(engine, tmp_path, capsys):
    engine.needle_answer = "wrong"
    code = needle_cli.main(["--url", engine.url, "--lengths", "1500", "--phases", "cold", "--out", str(tmp_path)])
    assert code == 1
    assert results(tmp_path)[0]["found"] == "no"
    assert "1500/cold" in capsys.readouterr().err


def test_dry_run_prompts_are_deterministic(engine, tmp_path):
    texts = []
    for name in ("a", "b"):
        code = needle_cli.main(["--url", engine.url, "--lengths", "1200,3000", "--seed", "6", "--salt", "fixed",
                                "--dry-run", "--out", str(tmp_path / name)])
        assert code == 0
        texts.append((tmp_path / name / "prompts.jsonl").read_text())
    assert texts[0] == texts[1]
    prompts = [json.loads(line) for line in texts[0].splitlines()]
    assert [(p["length"], p["tokens"], p["salt"]) for p in prompts] == [
        (1200, 1200, "fixed-first"), (3000, 3000, "fixed-first"), (1200, 1200, "fixed-again"),
        (3000, 3000, "fixed-again")]
    assert not engine.arrivals  # no completion was sent


def needle_process(engine_url: str, out: Path, stdin: int | None, text_input: str | None = None):
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "needle"), "--url", engine_url, "--lengths", "1500", "--out", str(out)],
        input=text_input, stdin=stdin, capture_output=True, text=True, timeout=120,
    )


def test_the_restart_phase_waits_for_the_operator(engine, tmp_path):
    done = needle_process(engine.url, tmp_path / "out", None, text_input="\n")
    assert done.returncode == 0, done.stderr
    assert "Restart the vLLM engine now" in done.stderr
    assert [r["phase"] for r in results(tmp_path / "out")] == ["cold", "l1", "l2", "cold-again"]


def test_the_restart_phase_without_an_operator_is_an_error(engine, tmp_path):
    done = needle_process(engine.url, tmp_path / "out", subprocess.DEVNULL)
    assert done.returncode == 2
    assert "no operator input" in done.stderr and "--skip-restart" in done.stderr
    assert [r["phase"] for r in results(tmp_path / "out")] == ["cold", "l1"]  # answers so far kept


def test_bad_phase_and_length_values(tmp_path, capsys):
    assert needle_cli.main(["--url", "http://127.0.0.1:1", "--phases", "cold,warm", "--out", str(tmp_path)]) == 2
    assert "unknown ['warm']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        needle_cli.main(["--url", "http://127.0.0.1:1", "--lengths", "12k"])


def test_a_cached_phase_the_cache_did_not_serve_fails_naming_the_counter(engine, tmp_path, capsys):
    engine.cache_serves = False  # every lookup misses, like a wrong remote_url: l1 recomputes and finds the code
    out = tmp_path / "out"
    code = needle_cli.main(["--url", engine.url, "--lengths", "3000", "--skip-restart", "--out", str(out)])
    assert code == 1
    rows = {r["phase"]: r for r in results(out)}
    assert rows["l1"]["found"] == "yes" and rows["l1"]["served_from_cache"] == "no"
    assert rows["l1"]["connector_hits"] == "0"
    assert "the KV connector served 0 of 3000 tokens" in rows["l1"]["evidence"]
    assert rows["cold"]["served_from_cache"] == ""  # cold phases are not judged by the cache
    assert "1 cached-phase answer(s) not served from cache: 3000/l1" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] is False and list(summary["not_served_from_cache"]) == ["3000/l1"]


def test_without_counter_or_cached_tokens_the_phase_fails_naming_both(engine, tmp_path, capsys):
    engine.metrics_enabled = False
    engine.report_cached_tokens = False  # vLLM without --enable-prompt-tokens-details
    out = tmp_path / "out"
    code = needle_cli.main(["--url", engine.url, "--lengths", "3000", "--phases", "cold,l1", "--out", str(out)])
    assert code == 1
    evidence = {r["phase"]: r for r in results(out)}["l1"]["evidence"]
    assert "--enable-prompt-tokens-details" in evidence
    assert "serves no vllm:external_prefix_cache_hits counter" in evidence
    assert "judged by the answers' usage cached_tokens" in capsys.readouterr().err


def test_without_the_counter_usage_cached_tokens_is_the_evidence(engine, tmp_path):
    engine.metrics_enabled = False
    out = tmp_path / "out"
    code = needle_cli.main(["--url", engine.url, "--lengths", "3000", "--phases", "cold,l1", "--out", str(out)])
    assert code == 0
    l1 = {r["phase"]: r for r in results(out)}["l1"]
    assert l1["served_from_cache"] == "yes" and l1["connector_hits"] == ""
    assert l1["evidence"].startswith("usage reports 2816 of 3000 tokens cached")  # 11 whole chunks of 256


def test_an_explicit_metrics_url_without_the_counter_is_an_error(engine, tmp_path, capsys):
    engine.metrics_enabled = False
    code = needle_cli.main(["--url", engine.url, "--lengths", "3000", "--metrics-url", engine.url,
                            "--phases", "cold", "--out", str(tmp_path)])
    assert code == 2
    assert f"no vllm:external_prefix_cache_hits counter at {engine.url}/metrics" in capsys.readouterr().err


def test_the_counter_is_read_from_vllm_prometheus_text():
    from opstools.cache_evidence import counter_total, metrics_url

    text = (
        "# HELP vllm:external_prefix_cache_hits_total External prefix cache hits from KV connector\n"
        "# TYPE vllm:external_prefix_cache_hits_total counter\n"
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 12800.0\n'
        'vllm:external_prefix_cache_hits_total{engine="1",model_name="m"} 256.0\n'
        'vllm:external_prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n'
        'vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 99999.0\n'
    )
    assert counter_total(text, "vllm:external_prefix_cache_hits") == 13056.0
    assert counter_total(text, "vllm:prefix_cache_hits") is None
    assert metrics_url("http://p:8000") == metrics_url("http://p:8000/") == "http://p:8000/metrics"
    assert metrics_url("http://p:9090/custom") == "http://p:9090/custom"
