"""The process group's agreement and the vocabulary's layout over it: every public function of
``lmhead.distributed`` starts with `agree` (one small all_gather of metadata, so that ranks that disagree raise on
every rank before the first real collective) and `shard_layout` (this rank's columns of the vocabulary)."""

from __future__ import annotations

import datetime
import os
import struct
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def init_distributed(backend: str | None = None, timeout: float = 60.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; return (rank, world_size).

    backend None picks "nccl" when CUDA is available (and calls `torch.cuda.set_device(LOCAL_RANK)`), else
    "gloo". `timeout` (seconds) bounds every collective: a rank that never arrives makes the others raise
    after this long instead of hanging. Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (set by torchrun).
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def check_group(group: Any) -> tuple[int, int]:
    """(rank in group, group size); a clear error when torch.distributed is not set up."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call lmhead.init_distributed() or "
            "torch.distributed.init_process_group('gloo' (CPU) or 'nccl' (GPU), timeout=timedelta(seconds=60)) "
            "on every rank first (torchrun sets the environment)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return rank, dist.get_world_size(group)


def vocab_range(vocab_size: int, rank: int | None = None, world_size: int | None = None,
                group: Any = None) -> tuple[int, int]:
    """The rows [start, end) of the [V,D] head weight that `rank` holds out of `world_size` ranks.

    Split as `torch.tensor_split(torch.arange(V), world_size)`: the first V mod W ranks hold one row more, so
    no shard is empty (V ≥ W required) and none differs from another by more than one row. rank and
    world_size default to this process's place in `group` (the default group when None).
    """
    if rank is None or world_size is None:
        g_rank, g_world = check_group(group)
        rank = g_rank if rank is None else rank
        world_size = g_world if world_size is None else world_size
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if vocab_size < world_size:
        raise ValueError(f"vocab_size must be >= world_size ({world_size}) so that no shard is empty, "
                         f"got {vocab_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    base, extra = divmod(vocab_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def comm_device(group: Any, fallback: torch.device) -> torch.device:
    """NCCL moves CUDA tensors only; gloo takes the inputs' device (CPU)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


def encode_prompt(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return zlib.crc32(repr(value).encode())


def targets_checksum(targets: Tensor) -> int:
    """Cheap fingerprint of replicated targets: ranks fed different batches disagree here."""
    t = targets.reshape(-1).to(torch.int64)
    if t.numel() == 0:
        return 0
    weights = torch.arange(1, t.numel() + 1, device=t.device, dtype=torch.int64) % 1_000_003
    return int(((t % 1_000_003) * weights).sum().item() % (2**61 - 1))


def agree(group: Any, op: str, shared: dict[str, Any], width: int, error: str | None,
           device: torch.device) -> list[int]:
    """One small all_gather of metadata before any real collective; return every rank's local row count.

    `shared` values must be equal on all ranks (V, D, N, options, targets checksum); `width` is this rank's
    number of vocabulary rows; `error` is this rank's own input error, if any. Every rank sees the same
    gathered table, so every rank raises (the same kind of error) or none does — never a hang.
    """
    rank, world = check_group(group)
    keys = sorted(shared)
    row = [zlib.crc32(op.encode()), 0 if error is None else 1, width] + [encode_prompt(shared[k]) for k in keys]
    row = row + [0] * (32 - len(row))
    if len(row) > 32:
        raise AssertionError("too many metadata fields")
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine, group=group)
    rows = [t.tolist() for t in table]
    if error is not None:
        raise ValueError(error)
    bad = [r for r in range(world) if rows[r][1]]
    if bad:
        raise ValueError(f"{op}: rank(s) {bad} rejected their input (see the error on those ranks)")
    if any(r[0] != rows[0][0] for r in rows):
        raise ValueError(f"{op}: the ranks called different operations at the same time (rank {rank} called {op})")
    for i, key in enumerate(keys):
        values = [r[3 + i] for r in rows]
        if len(set(values)) > 1:
            mine_v = shared[key]
            shown = values if isinstance(mine_v, int) and not isinstance(mine_v, bool) else "differ"
            raise ValueError(f"{op}: ranks disagree on {key} (rank {rank} has {mine_v!r}; all ranks: {shown}); "
                             "every rank must pass the same value")
    return [r[2] for r in rows]


def shard_layout(op: str, widths: list[int], vocab_size: int | None, rank: int) -> tuple[int, int, int]:
    """(start, end, V) for this rank from the gathered widths; checks them against `vocab_range`."""
    total = sum(widths)
    if vocab_size is not None:
        world = len(widths)
        expected = [(lambda s: s[1] - s[0])(vocab_range(vocab_size, r, world)) for r in range(world)] \
            if vocab_size >= world else None
        if expected != widths:
            raise ValueError(
                f"{op}: mismatched shards: the ranks hold {widths} vocabulary rows (total {total}) but "
                f"vocab_size={vocab_size} over {world} ranks needs {expected} (see lmhead.vocab_range)")
    start = sum(widths[:rank])
    return start, start + widths[rank], total
