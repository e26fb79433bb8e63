"""The CUDA driver declarations the plugin makes by hand match the toolkit's cuda.h."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cuda_include() -> Path | None:
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and (Path(base) / "include" / "cuda.h").is_file():
            return Path(base) / "include"
    return None


def test_driver_types_and_values_match_cuda_h():
    include = _cuda_include()
    if include is None:
        pytest.skip("no CUDA toolkit headers (cuda.h) to check against")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    r = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", f"-I{include}",
                        f"-I{ROOT / 'csrc' / 'devices'}", str(ROOT / "tests" / "native" / "cuda_abi_check.cpp")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
