"""The compiled kernel library in the cache is checked before it is mapped: a damaged one is rebuilt, not run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmhead.kernels import builder, native

_PROBE = "from lmhead.kernels import native; lib = native.library(); print('loaded' if lib is not None else 'none')"


@pytest.mark.skipif(builder.compiler() is None or native.library() is None, reason="no C compiler")
@pytest.mark.slow
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
@pytest.mark.slow
def test_a_build_begun_in_the_background_is_joined_by_the_first_load_and_not_repeated(tmp_path):
    env = {**os.environ, "LMHEAD_CACHE": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", _BACKGROUND], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and first.stdout.split() == ["1", "1", "True"], first.stderr
    # the library, its checksum and (where the integer path is built) the paths chosen for it: no leftovers
    files = sorted(p.name for p in (tmp_path / "kernels").iterdir() if not p.name.endswith(".so.paths.json"))
    assert len(files) == 2 and files[0].endswith(".so") and files[1].endswith(".so.xxh3"), files
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
@pytest.mark.slow
def test_an_argument_struct_of_another_size_than_its_mirror_turns_the_kernels_off_with_one_line():
    # a call through a struct laid out otherwise would read and write the wrong memory: refused before any call
    run = subprocess.run([sys.executable, "-c", _MISMATCH], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "none", run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("lmhead:")]
    assert len(lines) == 1 and "lmhead_step_args is" in lines[0] and "running without them" in lines[0], lines


_OTHER_LEVELS = """
from lmhead.kernels import native
native.LEVELS[native.IQ4] = native.LEVELS[native.IQ4][::-1]  # a mirror that disagrees with quant_types.h
print("loaded" if native.library() is not None else "none")
"""


@pytest.mark.skipif(builder.compiler() is None or native.library() is None, reason="no C compiler")
@pytest.mark.slow
def test_a_level_table_or_flag_other_than_the_headers_turns_the_kernels_off_with_one_line():
    # codes packed as indices of one table and multiplied as another's would be other numbers: refused at load
    run = subprocess.run([sys.executable, "-c", _OTHER_LEVELS], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "none", run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("lmhead:")]
    assert len(lines) == 1 and f"level table of flag {native.IQ4}" in lines[0], lines
    assert native._facts_mismatch(native.library()) is None  # the mirror as it is matches


_FAILS_CHECK = """
import shutil, sys
from pathlib import Path
from lmhead.kernels import builder, native, self_test
def build(target):  # the working library copied in its place: a build of the same sources
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(sys.argv[1], target)
    builder.checksum_path(target).write_text(builder.checksum(Path(target)))
    return True
builder.build = build
self_test.failed_check = lambda lib: "attend_test"  # as a miscompiled attention would
print("loaded" if native.library() is not None else "none")
print(native.refusal())
from lmhead import machine
print(machine._kernels()["why"])
"""


@pytest.mark.skipif(builder.compiler() is None or native.library() is None, reason="no C compiler")
def test_kernels_failing_their_self_test_are_rebuilt_once_then_turned_off_with_one_line_naming_the_check(tmp_path):
    # a refused library silently meant torch's float32 path at a fraction of the speed: the user is told which
    # check failed, and `lmhead info` says the same
    env = {**os.environ, "LMHEAD_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", _FAILS_CHECK, str(builder.library_path())], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    loaded, refusal, why = run.stdout.strip().splitlines()
    assert loaded == "none" and refusal == "their self-test failed (attend_test)"
    assert why == "their self-test failed (attend_test): every product takes torch's float32 path"
    lines = [line for line in run.stderr.splitlines() if line.startswith("lmhead:")]
    assert len(lines) == 1 and "failed their self-test (attend_test); running without them" in lines[0], lines
    assert native.refusal() is None  # this process's library passed


def test_activation_codes_other_than_the_headers_are_a_mismatch(monkeypatch):
    # a dense MLP's SiLU run as GELU (or gpt-oss's clamped SwiGLU as SiLU) would be other numbers: the codes are
    # checked value by value with the flags and level tables
    lib = native.library()
    if lib is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(native, "ACT_VALUES", (1, 0, 2))
    assert "activation codes are (0, 1, 2)" in native._facts_mismatch(lib)


_ABANDON = """
import sys, time
from lmhead.kernels import builder
builder.start()
time.sleep(1.0)  # the compilers are running
sys.exit(3)  # the process ends with an error before it needs the kernels
"""


def _fake_compiler(tmp_path, body: str) -> dict[str, str]:
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\necho $$ >> {tmp_path / 'pids'}\n{body}\n")
    cc.chmod(0o755)
    return {**os.environ, "LMHEAD_CACHE": str(tmp_path / "cache"), "CC": str(cc), "LMHEAD_NATIVE": "1"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_process_ending_mid_build_stops_its_compilers_and_leaves_no_temporary_files(tmp_path):
    env = _fake_compiler(tmp_path, "exec sleep 120")  # a compiler that takes minutes
    run = subprocess.run([sys.executable, "-c", _ABANDON], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == len(builder.SOURCES)  # every source's compiler had started
    assert not any(_alive(pid) for pid in pids)  # killed, not left running after the process
    assert sorted(p.name for p in (tmp_path / "cache" / "kernels").iterdir()) == []  # no half-written library


def test_the_temporary_files_of_a_build_killed_outright_are_removed_by_the_next_build(tmp_path):
    env = _fake_compiler(tmp_path, "exit 1")  # the next build fails at once: only its sweep is looked at
    folder = tmp_path / "cache" / "kernels"
    folder.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (folder / f".tmp-{dead.pid}-abc.so").write_bytes(b"\0" * 4096)
    (folder / f".tmp-{dead.pid}-objects-xyz").mkdir()
    (folder / f".tmp-{dead.pid}-objects-xyz" / "coded_kernel.o").write_bytes(b"\0")
    live = folder / f".tmp-{os.getpid()}-other.so"  # a build of a process still running: kept
    live.write_bytes(b"")
    probe = ("from lmhead.kernels import builder; "
             "print(builder.build(builder.library_path()))")
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr
    assert sorted(p.name for p in folder.iterdir()) == [live.name]
