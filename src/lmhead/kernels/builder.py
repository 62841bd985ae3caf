"""Building lmhead's C kernels: where the machine's library lives, compiling it, checking it — without torch.

    SOURCES ──cc -c, one compiler per source at once──▶ objects ──cc -shared──▶ <cache>/kernels/lmhead-<hash>.so
        (a temporary file renamed into place; its size and sha256 written beside it, checked before it is mapped)

This module imports no torch, so that `start()` can begin a build that the cache lacks before the slow imports
and the first read of a new file's tokenizer: a fresh machine's first load compiles while it does the rest.
`kernels/native.py` loads and binds the library (and waits for a build begun here). A process that ends while
its build still runs (an error before it needed the kernels) stops the compilers and removes the build's temporary
files at exit; those of a process killed outright (their names carry its pid) are removed by the next build.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from lmhead.cache_folder import cache_root, writer_alive

__all__ = ["FLAGS", "HEADERS", "SOURCES", "build", "compiler", "intact", "library_path", "start", "wait"]

SOURCES = tuple(Path(__file__).with_name(n) for n in ("coded_kernel.c", "body_kernels.c", "row_kernels.c",
                                                     "decode_kernels.c", "step_kernels.c",
                                                     "experts_kernel.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("simd_math.h", "body_kernels.h", "decode_kernels.h",
                                                     "quant_types.h", "sliced_kernel.h", "experts_kernel.h",
                                                     "row_pieces.h", "kernel_results.h", "groups_kernel.h",
                                                     "groups_screen.h", "thread_shares.h"))
FLAGS = ("-O3", "-march=native", "-fPIC", "-fopenmp")
_TIMEOUT = 180  # seconds for one compiler run

_pending: threading.Thread | None = None
_pending_lock = threading.Lock()
_procs: set[subprocess.Popen] = set()  # the compilers a build runs now (`_abandon` stops them at exit)
_procs_lock = threading.Lock()
_stopping = threading.Event()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path() -> Path:
    """Where this machine's build lives: keyed by the sources and the headers they include, the flags and the CPU
    (-march=native)."""
    digest = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        digest.update(src.read_bytes())
    digest.update((" ".join(FLAGS) + " -shared" + _cpu_flags() + platform.machine()).encode())
    return cache_root() / "kernels" / f"lmhead-{digest.hexdigest()[:24]}.so"


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _start(cmd: list[str]) -> subprocess.Popen | None:
    """A compiler started (None when the process is ending: `_abandon`)."""
    with _procs_lock:
        if _stopping.is_set():
            return None
        # a process group of its own: the driver's children (cc1, as) are stopped with it (`_kill`)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _procs.add(proc)
        return proc


def _finish(proc: subprocess.Popen | None) -> bool:
    """Whether a compiler `_start` started succeeded (killed after _TIMEOUT, or by `_abandon`: failed)."""
    if proc is None:
        return False
    try:
        return proc.wait(timeout=_TIMEOUT) == 0 and not _stopping.is_set()
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.wait()
        return False
    finally:
        with _procs_lock:
            _procs.discard(proc)


def _kill(proc: subprocess.Popen) -> None:
    """A compiler `_start` started, with everything it started (its process group)."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


def _compile(cc: str, flags: tuple[str, ...], folder: Path, out: str) -> bool:
    """Each source to an object in `folder`, every compiler started at once (the sources are independent, and
    the largest alone sets the time), then linked into `out`."""
    objects = [folder / f"{src.stem}.o" for src in SOURCES]
    procs = [_start([cc, *flags, "-c", str(src), "-o", str(obj)]) for src, obj in zip(SOURCES, objects, strict=True)]
    if not all([_finish(proc) for proc in procs]):  # every one waited for
        return False
    return _finish(_start([cc, *flags, "-shared", *map(str, objects), "-lm", "-o", out]))


def _sweep(folder: Path) -> None:
    """Remove the temporary files of builds whose process is gone (`.tmp-<pid>-…`: killed mid-build)."""
    for path in folder.glob(".tmp-*"):
        pid = path.name.split("-")[1]
        if not pid.isdigit() or int(pid) == os.getpid() or writer_alive(int(pid)):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()


def build(target: Path) -> bool:
    """Compile the sources into `target` (a temporary file renamed into place: a concurrent process sees no
    library or the whole one). False when there is no compiler or it fails."""
    cc = compiler()
    if cc is None:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep(target.parent)
    prefix = f".tmp-{os.getpid()}-"
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=prefix, suffix=".so")
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix=prefix + "objects-", dir=target.parent) as objects:
            for flags in (FLAGS, FLAGS[:-1]):  # without OpenMP if the compiler has none: one thread
                if _stopping.is_set():
                    return False
                if _compile(cc, flags, Path(objects), tmp):
                    os.chmod(tmp, 0o755)
                    checksum_path(target).write_text(checksum(Path(tmp)))
                    os.replace(tmp, target)
                    return True
        return False
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def checksum_path(library: Path) -> Path:
    return library.with_name(library.name + ".xxh3")


def checksum(path: Path) -> str:
    return f"{path.stat().st_size}-{hashlib.sha256(path.read_bytes()).hexdigest()}"


def intact(path: Path) -> bool:
    """Whether the cached library is the file its build wrote (size and checksum beside it), before it is mapped."""
    try:
        return checksum_path(path).read_text().strip() == checksum(path)
    except OSError:
        return False


def start() -> None:
    """Begin building the library in a background thread when the cache has no intact one (and the kernels are
    not switched off); `wait()` — which `native.library()` calls — joins it. A no-op when it is built."""
    global _pending
    if os.environ.get("LMHEAD_NATIVE", "1") == "0" or compiler() is None:
        return
    try:
        path = library_path()
        if path.exists() and intact(path):
            return
    except OSError:
        return
    with _pending_lock:
        if _pending is not None:
            return
        if path.exists():  # damaged: `native.library()` says so and rebuilds it itself
            return
        _pending = threading.Thread(target=build, args=(path,), name="lmhead-kernels", daemon=True)
        _pending.start()
        atexit.register(_abandon)


def _abandon() -> None:
    """At exit, a build still running (the process ends before it needed the kernels): its compilers killed and
    its temporary files removed (the build's own cleanup, waited for) — no half-written library, no orphan
    compiler left behind."""
    thread = _pending
    if thread is None or not thread.is_alive():
        return
    with _procs_lock:
        _stopping.set()
        for proc in _procs:
            _kill(proc)
    thread.join(timeout=30)


def wait() -> None:
    """Join a build `start()` began (nothing to do when none was)."""
    global _pending
    with _pending_lock:
        thread, _pending = _pending, None
    if thread is not None and thread is not threading.current_thread():
        thread.join()
