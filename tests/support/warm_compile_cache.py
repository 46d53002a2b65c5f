"""Compile what vLLM compiles on the first request with logprobs, into the Inductor cache.

Run with the engine venv's python, with ``TORCHINDUCTOR_CACHE_DIR`` set to the
cache the engines will use:

    TORCHINDUCTOR_CACHE_DIR=DIR python tests/support/warm_compile_cache.py VOCAB [VOCAB ...]

vLLM 0.31.0 serves a request that asks for logprobs through
``batched_count_greater_than`` (vllm/v1/sample/ops/logprobs.py), a
``torch.compile`` function even under ``--enforce-eager``; on the CPU platform
Inductor compiles it to C++, and with a cold cache the first such request
spends over a minute on two cores precompiling Inductor's C++ header and the
kernel, inside the request, past the tests' request timeouts. This compiles it
for each vocabulary size the tests' models have (the compiled graph keeps the
vocabulary dimension static), as the sampler calls it, so that the engines
find it in the cache. It prints the seconds each took.
"""
from __future__ import annotations

import sys
import time


def main(vocab_sizes: list[int]) -> int:
    import torch
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    for vocab in vocab_sizes:
        started = time.monotonic()
        for batch in (1, 2):
            logprobs = torch.log_softmax(torch.randn(batch, vocab, dtype=torch.float32), dim=-1)
            token_logprobs = logprobs.gather(-1, torch.zeros(batch, 1, dtype=torch.int64))
            # as Sampler.gather_logprobs marks them: the batch dimension symbolic
            torch._dynamo.decorators.mark_unbacked(logprobs, 0)
            torch._dynamo.decorators.mark_unbacked(token_logprobs, 0)
            ranks = batched_count_greater_than(logprobs, token_logprobs)
            expected = (logprobs >= token_logprobs).sum(-1)
            if not torch.equal(ranks, expected):
                print(f"vocab {vocab}: the compiled function disagrees with eager torch", file=sys.stderr)
                return 1
        print(f"vocab {vocab}: {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2 or not all(arg.isdigit() for arg in sys.argv[1:]):
        print(f"usage: {sys.argv[0]} VOCAB [VOCAB ...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main([int(arg) for arg in sys.argv[1:]]))
