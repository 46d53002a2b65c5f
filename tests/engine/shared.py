"""The prefill engine that the correctness protocol, the L2-loss scenarios and the operator
tools (profile-capture included) share.

configs/prefill on the CPU overlay, plus what these scenarios need on top:

* the tiny checkpoint with a character-level tokenizer (char_model.py): the
  tools write English text; the id prompts of the L2 scenarios do not care;
* ``--enable-prompt-tokens-details`` (the preset's own): the server's
  ``cached_tokens`` is evidence for the tools;
* LMCache's ``remote_url`` pointing at ``resp_hook.ExistsHookProxy`` in front
  of one real Valkey (rank 0's: at TP 1 the preset's ``{rank}`` template names
  that one instance; a concrete URL because the ``{rank}`` template is patch
  0006 and the pristine build must reach the same Valkey in the proofs);
* a read-only root, as the chart runs the engines (``readOnlyRootFilesystem``):
  only HOME, the caches and the temp folder are writable and /tmp is a tmpfs
  (tests/support/read_only_root.py), so every scenario on this engine shows
  that vLLM and LMCache serve without writing anywhere else;
* a fixed port, so a restart (needle's l2 phase) keeps the URL (its NIXL
  side-channel port, like every engine's, is the harness's: engine_env).

Who changes its state restores it: the L2 cases leave Valkey holding what
they stored, the Valkey-killed case brings a new Valkey (and proxy) up on the
same ports and checks that LMCache uses it again.
"""
from __future__ import annotations

from pathlib import Path

from tests.engine.resp_hook import ExistsHookProxy
from tests.support import cpu_overlay
from tests.support.engine import EngineError, EngineServer, clear_l1, stable_port
from tests.support.ports import free_port_block
from tests.support.valkey import ValkeyServer, start_valkey


# Measured with a busy loop on one of the two cores, 20 races: a lookup's EXISTS reached Valkey
# up to 17.2 s after its request (2 of 20 over 13 s, the rest under 0.3 s); pristine LMCache's
# remote backend gives up on that lookup after blocking_timeout_secs, the scheduler after
# lookup_timeout_ms. Both are bounds on hangs here, so both sit well above that.
LOOKUP_TIMEOUT_MS = 60_000
BLOCKING_TIMEOUT_S = 60


class SharedPrefill:
    def __init__(self, engines, model: Path, workdir: Path):
        self.engines = engines
        self.workdir = workdir
        self.valkey: ValkeyServer = start_valkey(workdir, port=stable_port())
        self.proxy = ExistsHookProxy(self.valkey, port=stable_port())
        self.api_port = free_port_block(2)
        self.port = stable_port()
        self.spec = cpu_overlay.cpu_spec("prefill", model, free_port_block(1), label="prefill-shared",
                                         api_port=self.api_port)
        self.spec.lmcache_config["remote_url"] = self.proxy.url
        # The cases here read a lookup or GET that gave up from LMCache's log, never from the clock,
        # so these bounds only have to stay above how late a loaded host finishes a healthy lookup
        # (the preset's 4 s and 5 s gave up on healthy lookups under load). A lookup or GET that
        # never answers still gives up, after a minute.
        self.spec.lmcache_config["lookup_timeout_ms"] = LOOKUP_TIMEOUT_MS
        self.spec.lmcache_config["blocking_timeout_secs"] = BLOCKING_TIMEOUT_S
        self.spec.read_only_root = True
        if self.spec.vllm_config.get("enable-prompt-tokens-details") is not True:
            raise EngineError("configs/prefill/vllm.yaml: enable-prompt-tokens-details is not true; the "
                              "tools' cached_tokens evidence needs it")
        self.lookup_timeout_s = self.spec.lmcache_config["lookup_timeout_ms"] / 1000
        try:
            self.server: EngineServer = engines.start(self.spec, port=self.port)
        except BaseException:
            self.close()
            raise

    def clear_l1(self) -> int:
        return clear_l1(self.server, self.api_port)

    def restart(self) -> None:
        """Stop the engine and start it again behind the same URL (L1 goes, Valkey stays)."""
        self.engines.stop(self.server)
        self.server = self.engines.start(self.spec, port=self.port)

    def kill_valkey(self) -> None:
        """Valkey dies: its process killed, the proxy's connections ended and its port closed."""
        self.valkey.process.kill()
        self.valkey.process.wait(timeout=10)
        self.proxy.close()

    def new_valkey(self) -> None:
        """An empty Valkey and proxy on the same ports (a restarted Valkey pod)."""
        self.valkey = start_valkey(self.workdir, port=self.valkey.port)
        self.proxy = ExistsHookProxy(self.valkey, port=self.proxy.port)

    def close(self) -> None:
        self.proxy.close()
        self.valkey.stop()
