"""build/lock/router.txt: the P/D router's image installs image.txt's own files, nothing else."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "build"))

from distbuild import pins  # noqa: E402
from distbuild.errors import DistBuildError  # noqa: E402
from distbuild.host import lock  # noqa: E402

LOCKS = REPO / "build" / "lock"


def test_the_router_closure_is_within_the_image_closure_and_carries_the_pinned_router() -> None:
    router = lock.read_lock(LOCKS / "router.txt")
    lock.check_within(router, lock.read_lock(LOCKS / "image.txt"), "router.txt", "image.txt")
    pin = next(p for p in pins.load(REPO / "build" / "pins.toml") if p.name == lock.ROUTER)
    assert lock.Locked(lock.ROUTER, pin.version, pin.filename, pin.sha256) in router
    # The router needs none of the serving stack.
    assert not {"torch", "vllm", "nixl-cu13"} & {x.name for x in router}


def test_an_entry_that_differs_from_the_image_closure_is_named() -> None:
    image = lock.read_lock(LOCKS / "image.txt")
    aiohttp = next(x for x in image if x.name == "aiohttp")
    other = lock.Locked("aiohttp", "0.0.1", "aiohttp-0.0.1-py3-none-any.whl", "0" * 64)
    with pytest.raises(DistBuildError, match=r"router\.txt is not within image\.txt: aiohttp "
                                             rf"aiohttp-0\.0\.1-py3-none-any\.whl \(image\.txt: {aiohttp.filename}\)"):
        lock.check_within([other], image, "router.txt", "image.txt")


def test_a_file_without_locked_entries_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "router.txt"
    path.write_text("vllm-router==0.1.17\n")
    with pytest.raises(DistBuildError, match=rf"{path}: no locked requirement"):
        lock.read_lock(path)


def test_the_router_lock_renders_back_to_the_committed_file() -> None:
    committed = (LOCKS / "router.txt").read_text()
    assert lock.render_router(lock.read_lock(LOCKS / "router.txt")) == committed
