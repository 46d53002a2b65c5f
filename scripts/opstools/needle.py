"""Needle-in-a-haystack prompts at exact token lengths, and the answer checker.

A prompt is a salt line, an instruction, filler sentences of common words
with one needle sentence (``The secret code is K7QD-9XRM.``) at a random
depth, and a question that the model completes with the code::

    Session <salt>.
    Below is a long text. Somewhere in it is a secret code. Remember it.

    <filler ...> The secret code is K7QD-9XRM. <filler ...>

    Question: What is the secret code given in the text above?
    Answer: The secret code is

The code, the depth and the filler words of each prompt come from the seed,
so a seed gives the same prompts every time. The salt decides the first
tokens: a prompt with a salt no earlier request used shares no cache block or
chunk with anything cached (vLLM's prefix cache and LMCache both hash each
block together with everything before it), so it is computed cold. The
salt is random per run unless given.

Exact length: the number of filler words is searched with the server's
``/tokenize`` until the prompt has exactly the target token count; when one
more word overshoots (it starts a new sentence and brings a ``.``), the gap
is closed with single-token pad words before the question.
"""
from __future__ import annotations

import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .common import OpsError
from .wordtext import random_words, words_for_tokens, words_to_text

CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no 0/O, 1/I: unambiguous when read back
INSTRUCTION = "Below is a long text. Somewhere in it is a secret code. Remember it.\n\n"
QUESTION = "\n\nQuestion: What is the secret code given in the text above?\nAnswer: The secret code is"
PAD_WORD = " the"
DEFAULT_LENGTHS = (12_800, 32_768, 65_536, 98_304, 131_072, 166_656)

TokenCounter = Callable[[str], Awaitable[int]]


@dataclass(frozen=True)
class NeedleSpec:
    index: int
    target_tokens: int
    code: str
    depth: float  # 0 = right after the instruction, 1 = right before the question
    filler_seed: int

    def needle_sentence(self) -> str:
        return f"The secret code is {self.code}."


def make_specs(lengths: list[int], seed: int) -> list[NeedleSpec]:
    """One needle per length; code, depth and filler all from ``seed``."""
    rng = random.Random(seed)
    specs = []
    for index, length in enumerate(lengths):
        code = "".join(rng.choice(CODE_ALPHABET) for _ in range(4)) + "-" + "".join(
            rng.choice(CODE_ALPHABET) for _ in range(4)
        )
        specs.append(NeedleSpec(index, length, code, round(rng.uniform(0.0, 1.0), 4), rng.getrandbits(64)))
    return specs


def build_prompt(spec: NeedleSpec, salt: str, filler_words: int, pad_words: int = 0) -> str:
    words = random_words(random.Random(spec.filler_seed), filler_words)
    position = round(spec.depth * filler_words)
    before = words_to_text(words[:position])
    after = words_to_text(words[position:])
    body = " ".join(part for part in (before, spec.needle_sentence(), after) if part)
    return f"Session {salt}.\n{INSTRUCTION}{body}{PAD_WORD * pad_words}{QUESTION}"


@dataclass(frozen=True)
class FittedPrompt:
    spec: NeedleSpec
    salt: str
    text: str
    tokens: int
    filler_words: int
    pad_words: int
    tokenize_calls: int

    @property
    def exact(self) -> bool:
        return self.tokens == self.spec.target_tokens


async def fit_prompt(
    spec: NeedleSpec, salt: str, count: TokenCounter, max_calls: int = 40, like: FittedPrompt | None = None
) -> FittedPrompt:
    """Find filler and pad so the prompt has ``spec.target_tokens`` tokens by ``count``.

    ``like``: a prompt fitted with another salt; its filler and pad are tried
    first, so prompts whose salts count the same differ only in the salt line.
    Returns the closest prompt at or below the target when no exact fit is
    found within ``max_calls`` tokenizer calls (``FittedPrompt.exact`` tells).
    """
    target = spec.target_tokens
    calls = 0
    cache: dict[tuple[int, int], int] = {}

    async def tokens(words: int, pad: int = 0) -> int:
        nonlocal calls
        key = (words, pad)
        if key not in cache:
            calls += 1
            cache[key] = await count(build_prompt(spec, salt, words, pad))
        return cache[key]

    if like is not None and await tokens(like.filler_words, like.pad_words) == target:
        text = build_prompt(spec, salt, like.filler_words, like.pad_words)
        return FittedPrompt(spec, salt, text, target, like.filler_words, like.pad_words, calls)

    base = await tokens(0)
    if base > target:
        raise OpsError(f"needle length {target}: the prompt without filler already has {base} tokens")
    under_words, under_tokens = 0, base
    over_words: int | None = None
    words = words_for_tokens(target - base)
    while calls < max_calls:
        got = await tokens(words)
        if got == target:
            return FittedPrompt(spec, salt, build_prompt(spec, salt, words), got, words, 0, calls)
        if got < target:
            if words >= under_words:
                under_words, under_tokens = words, got
        elif over_words is None or words < over_words:
            over_words = words
        if over_words is not None and over_words - under_words <= 1:
            break
        per_word = (got - base) / words if words else 1.0
        step = round((target - got) / max(per_word, 1e-6)) or (1 if got < target else -1)
        words += step
        if words <= under_words:
            words = under_words + 1
        if over_words is not None and words >= over_words:
            words = (under_words + over_words) // 2 if over_words - under_words > 2 else over_words - 1
    # close the gap below the target with pad words (one token each, usually)
    best_words, best_pad, best_tokens = under_words, 0, under_tokens
    pad = target - under_tokens
    while calls < max_calls and pad > 0:
        got = await tokens(under_words, pad)
        if got == target:
            best_pad, best_tokens = pad, got
            break
        if got < target:
            if got > best_tokens:
                best_pad, best_tokens = pad, got
            pad += max(1, target - got)
        else:
            pad -= max(1, got - target)
            if pad <= best_pad:
                break
    return FittedPrompt(
        spec, salt, build_prompt(spec, salt, best_words, best_pad), best_tokens, best_words, best_pad, calls
    )


def _letters_and_digits(text: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", text.upper())


def answer_has_code(answer: str, code: str) -> bool:
    """Found when the code's letters and digits appear in order in the answer.

    Case, spaces and punctuation are ignored (``k7qd 9xrm`` finds ``K7QD-9XRM``);
    any other character in between, or a wrong one, is not found.
    """
    wanted = _letters_and_digits(code)
    return bool(wanted) and wanted in _letters_and_digits(answer)
