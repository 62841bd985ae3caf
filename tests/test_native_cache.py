"""The compiled kernel library in the cache is checked before it is mapped: a damaged one is rebuilt, not run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmhead.kernels import builder, native

_PROBE = "from lmhead.kernels import native; lib = native.library(); print('loaded' if lib is not None else 'none')"


@pytest.mark.skipif(builder.compiler() is None or native.library() is None, reason="no C compiler")
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
    assert builder.intact(lib)


_BACKGROUND = """
import threading
from lmhead.kernels import builder
builder.start()
started = [t.name for t in threading.enumerate() if t.name == "lmhead-kernels"]
builder.start()  # a second call while it builds starts nothing
again = [t.name for t in threading.enumerate() if t.name == "lmhead-kernels"]
from lmhead.kernels import native
print(len(started), len(again), native.library() is not None)
"""


@pytest.mark.skipif(builder.compiler() is None or native.library() is None, reason="no C compiler")
def test_a_build_begun_in_the_background_is_joined_by_the_first_load_and_not_repeated(tmp_path):
    env = {**os.environ, "LMHEAD_CACHE": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", _BACKGROUND], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and first.stdout.split() == ["1", "1", "True"], first.stderr
    files = sorted(p.name for p in (tmp_path / "kernels").iterdir())
    assert len(files) == 2 and files[0].endswith(".so") and files[1].endswith(".so.xxh3"), files  # no leftovers
    assert builder.intact(tmp_path / "kernels" / files[0])
    built = subprocess.run([sys.executable, "-c", _BACKGROUND], env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0 and built.stdout.split() == ["0", "0", "True"], built.stderr  # nothing to build


def test_every_source_and_header_beside_the_builder_is_compiled_or_in_the_build_key():
    # a header left out of the key would let a stale library of other structs or constants be mapped
    folder = builder.SOURCES[0].parent
    assert sorted(folder.glob("*.c")) == sorted(builder.SOURCES)
    assert sorted(folder.glob("*.h")) == sorted(builder.HEADERS)


_MISMATCH = """
import ctypes
sizeof = ctypes.sizeof
ctypes.sizeof = lambda t: sizeof(t) + (8 if getattr(t, "__name__", "") == "StepArgs" else 0)  # a field too many
from lmhead.kernels import native
print("loaded" if native.library() is not None else "none")
"""


@pytest.mark.skipif(builder.compiler() is None or native.library() is None, reason="no C compiler")
def test_an_argument_struct_of_another_size_than_its_mirror_turns_the_kernels_off_with_one_line():
    # a call through a struct laid out otherwise would read and write the wrong memory: refused before any call
    run = subprocess.run([sys.executable, "-c", _MISMATCH], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "none", run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("lmhead:")]
    assert len(lines) == 1 and "lmhead_step_args is" in lines[0] and "running without them" in lines[0], lines
