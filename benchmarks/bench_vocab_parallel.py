"""Per-rank memory of the vocab-parallel head + fused loss, for world sizes 1, 2, 4 (gloo, this machine).

    .venv/bin/python benchmarks/bench_vocab_parallel.py                       # N=2048, D=640, V=262144, fp32
    .venv/bin/python benchmarks/bench_vocab_parallel.py --tokens 512 --vocab 49152 --worlds 1 2

Each world size runs in fresh processes (torch.multiprocessing spawn, one process per rank). On every rank:
RSS after start-up (torch imported, group up, one tiny warm-up call) → inputs (replicated hidden [N,D] +
targets, this rank's weight shard [V/W, D]) → forward + backward of `vocab_parallel_linear_cross_entropy`.
Columns, per rank (the largest over the ranks): `head+loss` = peak RSS above start-up (weight shard + its
gradient + the loss's working memory); `working` = that minus the bytes of the inputs and of the gradients
they receive (dW is as large as the shard, whoever computes it). The ratio is against one process (world 1).
`--plain` adds one process computing the full [N,V] logits and `F.cross_entropy` (skipped when the machine
does not have the memory).
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import resource
import socket
import time

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from records import Figure, Recorder, Table  # same folder: run as a script, it is on sys.path

MB = 2**20


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB


def _weight_rows(start: int, end: int, args: argparse.Namespace, block: int = 4096) -> torch.Tensor:
    """Rows [start, end) of one fixed [V,D] weight, drawn block by block: every world size sees the same
    weight, and no rank ever holds more than its shard plus one block."""
    out = torch.empty(end - start, args.width)
    for b in range(start // block, (end + block - 1) // block):
        rows = torch.randn(min(block, args.vocab - b * block), args.width,
                           generator=torch.Generator().manual_seed(1000 + b)) * args.width ** -0.5
        lo, hi = max(start, b * block), min(end, b * block + rows.shape[0])
        out[lo - start:hi - start] = rows[lo - b * block:hi - b * block]
    return out


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    from lmhead.distributed import vocab_parallel_linear_cross_entropy, vocab_range

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    # warm-up on tiny tensors: one-off library start-up (threads, gloo buffers) is not the head's memory
    tiny = torch.randn(8, 4, requires_grad=True)
    vocab_parallel_linear_cross_entropy(tiny, torch.randn(3, 4, requires_grad=True),
                                        torch.zeros(8, dtype=torch.long)).backward()
    base = _rss()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.width, generator=g).requires_grad_()  # same on every rank
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    start, end = vocab_range(args.vocab, rank, world)
    shard = _weight_rows(start, end, args).requires_grad_()
    inputs = _nbytes(hidden, targets, shard)
    grads = _nbytes(hidden, shard)  # dHidden and dW
    dist.barrier()
    t0 = time.perf_counter()
    loss = vocab_parallel_linear_cross_entropy(hidden, shard, targets)
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = max(_peak(), _rss())
    out.put({"rank": rank, "rows": end - start, "shard": shard.numel() * shard.element_size(),
             "head_loss": peak - base, "working": peak - base - inputs - grads, "seconds": seconds,
             "loss": loss.item()})
    dist.barrier()
    dist.destroy_process_group()


def _plain_main(args: argparse.Namespace, out: mp.Queue) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    tiny = torch.randn(8, 4, requires_grad=True)
    torch.nn.functional.cross_entropy(tiny @ torch.randn(3, 4).t(), torch.zeros(8, dtype=torch.long)).backward()
    base = _rss()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.width, generator=g).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    weight = _weight_rows(0, args.vocab, args).requires_grad_()
    inputs = _nbytes(hidden, targets, weight)
    grads = _nbytes(hidden, weight)
    t0 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(hidden @ weight.t(), targets)
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = max(_peak(), _rss())
    out.put({"rank": 0, "rows": args.vocab, "shard": weight.numel() * 4, "head_loss": peak - base,
             "working": peak - base - inputs - grads, "seconds": seconds, "loss": loss.item()})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, args: argparse.Namespace, plain: bool = False) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    if plain:
        procs = [ctx.Process(target=_plain_main, args=(args, out))]
    else:
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    try:
        while len(results) < len(procs):
            try:
                results.append(out.get(timeout=5))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a rank of world {world} failed") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--plain", action="store_true", help="also one process with the full [N,V] logits")
    args = p.parse_args()

    n, d, v = args.tokens, args.width, args.vocab
    need = (2 * v * d + 3 * n * v) * 4  # weight + dW + shards' inputs, or logits + grad + softmax for plain
    avail = psutil.virtual_memory().available
    if (2 * v * d + 2 * n * d) * 4 * 1.5 > avail:
        print(f"skipped: needs {2 * v * d * 4 * 1.5 / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available")
        return
    rec = Recorder("vocab_parallel")
    print(rec.header())
    title = f"vocab-parallel head + fused loss, fp32 forward+backward: N={n}, D={d}, V={v}; gloo; memory per rank"
    print(f"{title} = the largest over the ranks")
    table = rec.table("worlds", title, ["setup", "rows/rank", "shard MB", "head+loss MB", "vs 1 process",
                                        "working MB", "fwd+bwd s", "loss"])
    header = (f"{'setup':<24}{'rows/rank':>10}{'shard MB':>10}{'head+loss MB':>14}{'vs 1 process':>14}"
              f"{'working MB':>12}{'fwd+bwd s':>11}{'loss':>12}")
    print(header)
    print("-" * len(header))
    rows = []
    if args.plain:
        if need * 1.3 > avail:
            print(f"{'1 process, full logits':<24}skipped: needs {need / 2**30:.1f} GiB, "
                  f"{avail / 2**30:.1f} GiB available")
        else:
            rows.append(("1 process, full logits", _run(1, args, plain=True)))
            _print_row(table, *rows[-1], None)
    first = None
    for world in args.worlds:
        res = _run(world, args)
        label = f"{world} rank{'s' if world > 1 else ''}, fused loss"
        head_loss = max(r["head_loss"] for r in res)
        first = first if first is not None else head_loss
        _print_row(table, label, res, first)
    note = ("head+loss = peak RSS above start-up: weight shard + dW + working memory; working = head+loss minus "
            "the inputs' and gradients' bytes")
    print(note)
    table.note(note)
    rec.write()


def _print_row(table: Table, label: str, res: list[dict], first: int | None) -> None:
    head_loss = max(r["head_loss"] for r in res)
    ratio = f"{head_loss / first:.2f}x" if first else "-"
    losses = {round(r["loss"], 6) for r in res}
    loss = f"{res[0]['loss']:.6f}" + ("" if len(losses) == 1 else " (ranks differ!)")
    print(f"{label:<24}{max(r['rows'] for r in res):>10}{max(r['shard'] for r in res) / MB:>10.0f}"
          f"{head_loss / MB:>14.0f}{ratio:>14}{max(r['working'] for r in res) / MB:>12.0f}"
          f"{max(r['seconds'] for r in res):>11.2f}{loss:>12}")
    table.row([label, max(r["rows"] for r in res), f"{max(r['shard'] for r in res) / MB:.0f}", f"{head_loss / MB:.0f}",
               ratio, f"{max(r['working'] for r in res) / MB:.0f}", f"{max(r['seconds'] for r in res):.2f}", loss],
              [Figure(f"{label}: head+loss memory per rank", head_loss, "bytes", "1 process", first,
                      head_loss / first if first else None)])


if __name__ == "__main__":
    main()
