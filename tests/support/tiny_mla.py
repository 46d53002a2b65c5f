"""A tiny random-weight DeepSeek-V2-style MLA checkpoint and a word-level tokenizer.

Run with the engine venv's python (its transformers is the one vLLM loads
the checkpoint with):

    python tests/support/tiny_mla.py OUT_DIR

vLLM's CPU MLA backend supports only head size 576 (512 latent + 64 rope),
so ``kv_lora_rank`` and ``qk_rope_head_dim`` are the real model's; everything
else is as small as the architecture allows. The weights are random but
seeded, and larger than the usual init so the logits depend on the KV the
model attends to: ``--load-format dummy`` gives uniform logits, with which any
KV, right or wrong, yields the same output.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

KV_LORA_RANK = 512      # the latent part of vLLM's CPU MLA head size (576)
ROPE_HEAD_DIM = 64      # the rope part
NUM_LAYERS = 2
VOCAB_WORDS = 2000
SPECIAL = ("<unk>", "<s>", "</s>")
SEED = 1234


def word(i: int) -> str:
    """The i-th word of the tokenizer's vocabulary (one token each)."""
    return f"w{i}"


def make_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL)}
    vocab.update({word(i): len(SPECIAL) + i for i in range(VOCAB_WORDS)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 4096, "clean_up_tokenization_spaces": False,
    }, indent=1))


def make_model(out: Path) -> None:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=len(SPECIAL) + VOCAB_WORDS,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS,
        first_k_dense_replace=NUM_LAYERS,   # every layer dense: no MoE kernels needed
        n_routed_experts=2,
        n_shared_experts=1,
        num_experts_per_tok=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_HEAD_DIM,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=4096,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = DeepseekV2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def make(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    make_model(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_mla.py OUT_DIR")
    print(make(Path(sys.argv[1])))
