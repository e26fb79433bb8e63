"""Build the core's native test executable with AddressSanitizer + UBSan and run it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sanitizers_supported(tmp: Path) -> bool:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        return False
    src = tmp / "probe.cpp"
    src.write_text("int main() { return 0; }\n")
    r = subprocess.run([cxx, "-fsanitize=address,undefined", str(src), "-o", str(tmp / "probe")],
                       capture_output=True)
    return r.returncode == 0 and subprocess.run([str(tmp / "probe")]).returncode == 0


def test_core_under_asan_and_ubsan(tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    if not _sanitizers_supported(tmp_path):
        pytest.skip("this compiler cannot build and run -fsanitize=address,undefined programs")
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DPYMEMPLAN_PYTHON=OFF",
                    "-DPYMEMPLAN_NATIVE_TESTS=ON", "-DPYMEMPLAN_SANITIZE=ON",
                    "-DCMAKE_BUILD_TYPE=Debug"], check=True, capture_output=True)
    r = subprocess.run(["cmake", "--build", str(build), "-j2", "--target", "core_tests"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    # 30,000 operations per program: 13 s under the sanitizers here, against 27 s for 50,000
    # (the time grows faster than the operations, and each periodic program is restarted four
    # times); the long runs are the fuzz benchmark's.
    r = subprocess.run([str(build / "core_tests"), "30000"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all core tests passed" in r.stdout
    assert "runtime error" not in r.stderr  # UBSan reports go to stderr
