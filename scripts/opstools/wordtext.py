"""Prompt text made of common English words, so token counts are roughly known.

Every word below is a lowercase English word of 2-7 letters. Written with a
leading space (" water"), each is expected to be one token in the byte-pair
vocabularies of current large models (about 150k entries); this was not
checked against GLM-5.3's tokenizer (the repository has no model files), so
the estimate below is only rough until measured. Text is built as
sentences of :data:`WORDS_PER_SENTENCE` words ending in ``"."``, so a text of
``n`` words is about ``n + ceil(n / WORDS_PER_SENTENCE)`` tokens. That estimate
is what the generator calls ``approx_prompt_tokens``; ``--tokenize-url``
replaces it by a measured ratio, and the needle tool fits exact lengths
against the server's ``/tokenize``.
"""
from __future__ import annotations

import math
import random

WORDS_PER_SENTENCE = 12

VOCABULARY: tuple[str, ...] = tuple(
    dict.fromkeys(
    """
    the of and to in is was for on that with as by at from his her they this
    had not are but have one all were when there can more which their will
    time new said each would about many then them some two out what other
    into has its like him see now could people may first than been who over
    only way most made after also did just make well back good much year
    long day where through down before should work while old right great
    same found still hand high place small end large house world under form
    part last point never home water room city light night hours state side
    open road kind head stone early river paper field north south east west
    money table music story plan order voice green black white red blue
    ready tree bird horse mark ship train glass bread salt iron wood river
    garden window winter summer spring autumn letter market number answer
    reason lake hill cloud rain snow wind fire earth metal coffee milk
    apple orange sugar basket bottle chair floor door wall roof bridge
    street village island forest desert ocean valley castle tower church
    school doctor farmer teacher writer sister brother mother father friend
    child baby king queen army camp boat coat shirt shoe hat ring clock
    watch phone camera engine wheel track signal radio screen button cable
    """.split()
    )
)


def random_words(rng: random.Random, count: int) -> list[str]:
    """``count`` words drawn uniformly from :data:`VOCABULARY`."""
    return rng.choices(VOCABULARY, k=count)


def words_to_text(words: list[str]) -> str:
    """Join words into sentences of :data:`WORDS_PER_SENTENCE` words, each ending in '.'.

    The formatting depends only on a word's position, so two word lists with
    a common prefix give texts with a common prefix.
    """
    sentences = []
    for start in range(0, len(words), WORDS_PER_SENTENCE):
        sentences.append(" ".join(words[start : start + WORDS_PER_SENTENCE]) + ".")
    return " ".join(sentences)


def approx_tokens(word_count: int) -> int:
    """Estimated tokens of :func:`words_to_text` for ``word_count`` words."""
    return word_count + math.ceil(word_count / WORDS_PER_SENTENCE)


def words_for_tokens(tokens: float, tokens_per_word: float | None = None) -> int:
    """Words needed for about ``tokens`` tokens.

    ``tokens_per_word`` is a measured ratio (sentence dots included); by default
    the estimate of :func:`approx_tokens` is inverted.
    """
    if tokens_per_word is None:
        tokens_per_word = (WORDS_PER_SENTENCE + 1) / WORDS_PER_SENTENCE
    return max(1, round(tokens / tokens_per_word))
