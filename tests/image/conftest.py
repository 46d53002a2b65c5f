"""The serving image's tests: Dockerfile lint and consistency, the in-image tools
(image/imagectl), the image build tool (build/distbuild: engine, lock,
image) and a real container build of the first stages (test_build.py)."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for path in (REPO / "build", REPO / "image"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
