"""What this machine is and what lmhead does on it (`lmhead info`, and the benchmarks' records).

    cpu()      the CPU: its name, vendor, family and model, the vector flags the kernels are built for, cores, L3
    info()     the CPU, the Python and torch it runs under, the kernels (built or not, and why; which path each
               kind of coded product takes here, measured once per build: kernels/paths.py), the pages a load
               puts its matrices on (models/huge_pages.py), the cache folder
               and what it holds, and the packaged models (installed or how to install them)

Nothing here changes a setting: `info` builds the kernels where they are not built yet (as the first load does),
and reports.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

# the CPU flags the kernels' choices depend on (the records name them with each figure)
FLAG_PREFIXES = ("avx2", "fma", "f16c", "avx512", "amx", "avx_vnni")
# what each matters for, in the order `info` reports them
FEATURES = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX-512 VNNI", "avx_vnni": "AVX-VNNI",
            "amx_int8": "AMX int8"}


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty off Linux)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def l3_bytes() -> int | None:
    """The last-level (L3) cache's size, from sysfs (None where it is not said)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip()
                units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
                return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            continue
    return None


def cpu() -> dict[str, Any]:
    """The CPU's name, vendor, family and model, its kernel-relevant flags, cores and L3 bytes."""
    info = cpuinfo()
    flags = info.get("flags", "").split()
    return {
        "name": info.get("model name") or platform.processor() or "unknown CPU",
        "vendor": info.get("vendor_id", ""),
        "family": int(info["cpu family"]) if info.get("cpu family", "").isdigit() else None,
        "model": int(info["model"]) if info.get("model", "").isdigit() else None,
        "flags": sorted(f for f in flags if f.startswith(FLAG_PREFIXES)),
        "features": {name: flag in flags for flag, name in FEATURES.items()},
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "l3_bytes": l3_bytes(),
    }


def _kernels() -> dict[str, Any]:
    """The kernels: where the build is, whether it runs here, and which path each kind of product takes."""
    from lmhead.kernels import builder, native, paths

    path = builder.library_path()
    out: dict[str, Any] = {"library": str(path), "available": False}
    if os.environ.get("LMHEAD_NATIVE", "1") == "0":
        return out | {"why": "turned off by LMHEAD_NATIVE=0: every product takes torch's float32 path"}
    if builder.compiler() is None:
        return out | {"why": "no C compiler (CC, cc, gcc or clang): every product takes torch's float32 path"}
    if not path.exists():
        print("lmhead: compiling the kernels for this CPU (once)...", file=sys.stderr, flush=True)
    if native.library() is None:
        why = native.refusal() or "the build failed"
        return out | {"why": f"{why}: every product takes torch's float32 path"}
    chosen = paths.chosen()
    return out | {"available": True, "avx2": native.avx2(), "products": paths.describe(),
                  "paths": {kind: dict(v) for kind, v in chosen.items() if isinstance(v, dict)},
                  "how": chosen.get("how")}


def _cache() -> dict[str, Any]:
    from lmhead.cache_folder import cache_root

    root = cache_root()
    parts: dict[str, int] = {}
    for name in ("models", "layouts", "kernels", "meta", "tokenizer", "heads", "features"):
        folder = root / name
        if folder.is_dir():
            parts[name] = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
    free = shutil.disk_usage(root).free if root.exists() else None
    return {"folder": str(root), "bytes": parts, "free_bytes": free}


def _models() -> dict[str, Any]:
    import importlib.util

    from lmhead.models.registry import MODELS

    return {name: {"installed": importlib.util.find_spec(spec.module) is not None, "description": spec.description,
                   "install": spec.install} for name, spec in MODELS.items()}


def info() -> dict[str, Any]:
    """What this machine is and what lmhead does on it (see the module's docstring), as one JSON-ready dict."""
    import torch

    from lmhead import __version__
    from lmhead.models import huge_pages

    return {"lmhead": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu": cpu(), "kernels": _kernels(),
            "weights": huge_pages.describe(), "cache": _cache(), "models": _models()}
