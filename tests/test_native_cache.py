"""The compiled kernel library in the cache is checked before it is mapped: a damaged one is rebuilt, not run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmhead.models import native

_PROBE = "from lmhead.models import native; lib = native.library(); print('loaded' if lib is not None else 'none')"


@pytest.mark.skipif(native._compiler() is None or native.library() is None, reason="no C compiler")
def test_a_truncated_kernel_library_is_rebuilt_with_one_line_not_a_bus_error(tmp_path):
    env = {**os.environ, "LMHEAD_CACHE": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and first.stdout.strip() == "loaded", first.stderr
    (lib,) = (tmp_path / "kernels").glob("lmhead-*.so")
    lib.write_bytes(lib.read_bytes()[:4096])  # cut short, as a full disk or a killed copy leaves it
    again = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.strip() == "loaded", again.stderr
    assert "do not match their checksum; building them again" in again.stderr
    assert len([line for line in again.stderr.splitlines() if line.startswith("lmhead:")]) == 1
    assert native._intact(lib)
