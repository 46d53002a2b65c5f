"""The tiny MLA checkpoint with a character-level tokenizer, for the operator tools.

Run with the engine venv's python: ``python tests/engine/char_model.py TINY_MODEL OUT_DIR``.

The tools write English text (replay's sentences, needle's filler, salt and
code), which the tiny model's word tokenizer (``w0`` .. ``w1999``) reads as
``<unk>`` throughout: every prompt would be the same token ids, so salts
would not make a prompt cold and fresh prompts would share cache chunks.
One token per character keeps distinct texts distinct. The vocabulary keeps
the checkpoint's size (the ids past the characters decode as ``x<i>``), and
the weights are the tiny model's own (linked).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIAL = ("<unk>", "<s>", "</s>")


def make(model: Path, out: Path) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    vocab = {token: i for i, token in enumerate(SPECIAL)}
    for char in ["\n", *map(chr, range(32, 127))]:
        vocab[char] = len(vocab)
    while len(vocab) < config["vocab_size"]:
        vocab[f"x{len(vocab)}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text())
    for item in model.iterdir():
        if item.name not in ("tokenizer.json", "tokenizer_config.json") and not (out / item.name).exists():
            (out / item.name).symlink_to(item)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: char_model.py TINY_MODEL OUT_DIR")
    print(make(Path(sys.argv[1]), Path(sys.argv[2])))
