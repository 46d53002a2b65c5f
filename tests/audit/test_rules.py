"""The audit's rules without a compiler: classification, targets, allowlist parsing."""
from __future__ import annotations

from pathlib import Path

import pytest

from distbuild.host.audit import AllowEntry, Arch, classify, load_allowlist, parse_arch
from distbuild.errors import DistBuildError

B300 = Arch(103)


@pytest.mark.parametrize(
    "kind, arch, expected",
    [
        ("sass", "sm_103", "native"),
        ("sass", "sm_103a", "native"),
        ("sass", "sm_103f", "native"),
        ("sass", "sm_100f", "family"),
        ("sass", "sm_100", "same-major"),
        ("sass", "sm_100a", "not-runnable"),  # the mistake users make: 10.0a code does not run on B300
        ("sass", "sm_90a", "not-runnable"),
        ("sass", "sm_90", "not-runnable"),
        ("sass", "sm_120", "not-runnable"),
        ("sass", "sm_110f", "not-runnable"),
        ("ptx", "compute_100", "ptx-only"),
        ("ptx", "compute_90", "ptx-only"),
        ("ptx", "compute_100f", "ptx-only"),
        ("ptx", "compute_103a", "ptx-only"),
        ("ptx", "compute_100a", "not-runnable"),
        ("ptx", "compute_120", "not-runnable"),
        ("ptx", "compute_103f", "ptx-only"),
    ],
)
def test_classify_for_b300(kind: str, arch: str, expected: str) -> None:
    assert classify(kind, parse_arch(arch), B300) == expected


def test_newer_minor_does_not_run_on_older_gpu() -> None:
    assert classify("sass", parse_arch("sm_103"), Arch(100)) == "not-runnable"
    assert classify("sass", parse_arch("sm_103f"), Arch(100)) == "not-runnable"
    assert classify("ptx", parse_arch("compute_103"), Arch(100)) == "not-runnable"


@pytest.mark.parametrize("text, expected", [("sm_103", Arch(103)), ("sm_100f", Arch(100, "f")),
                                            ("compute_90a", Arch(90, "a")), ("10.3", Arch(103)), ("103", Arch(103))])
def test_parse_arch(text: str, expected: Arch) -> None:
    assert parse_arch(text) == expected


def test_parse_arch_rejects_junk() -> None:
    with pytest.raises(DistBuildError, match="not a CUDA architecture"):
        parse_arch("blackwell")


def test_allowlist_needs_a_reason(tmp_path: Path) -> None:
    path = tmp_path / "allow.txt"
    path.write_text("# vLLM's FA3 is Hopper-only\n*/_vllm_fa3_C.abi3.so  Hopper-only FA3, never loaded on B300\n"
                    "\n*/flash_attn_2*.so\n")
    with pytest.raises(DistBuildError, match=r"allow\.txt:4: allowlist entry '\*/flash_attn_2\*\.so' has no reason"):
        load_allowlist(path)


def test_allowlist_globs(tmp_path: Path) -> None:
    path = tmp_path / "allow.txt"
    path.write_text("*/vllm_flash_attn/_vllm_fa3_C.abi3.so   Hopper-only FA3\nlibptx*.so  JIT is fine here\n"
                    "/usr/lib/libx.so  absolute paths are rootfs paths\n")
    fa3, ptx, absolute = load_allowlist(path)
    assert fa3.reason == "Hopper-only FA3" and fa3.where.endswith("allow.txt:1")
    assert fa3.covers("usr/lib/python3.11/site-packages/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")
    assert not fa3.covers("usr/lib/python3.11/site-packages/vllm/_C.abi3.so")
    assert ptx.covers("opt/lib/libptx100.so")  # no slash: matches the file name anywhere
    assert absolute.covers("usr/lib/libx.so")
    assert AllowEntry("a/*.so", "r", "x:1").covers("a/b/c.so")  # '*' crosses '/'


def test_missing_allowlist_file(tmp_path: Path) -> None:
    with pytest.raises(DistBuildError, match="allowlist not found"):
        load_allowlist(tmp_path / "nope.txt")
