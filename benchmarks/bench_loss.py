"""Memory and time of the LM-head training loss, forward + backward, float32 on the CPU.

Three ways to compute mean cross-entropy of `hidden [N,D] @ weight[V,D].T` against `targets [N]`, with the
gradients of hidden and weight:

    plain   F.cross_entropy(F.linear(hidden, weight), targets)            — the full [N,V] logits (baseline)
    torch   F.linear_cross_entropy(..., options=LinearCrossEntropyOptions()) — torch's chunked path
    lmhead  lmhead.linear_cross_entropy(hidden, weight, targets)           — default chunk_size

Method. Every (configuration, method, repeat) runs in a fresh subprocess, so no allocator state or
high-water mark carries over. The subprocess builds the inputs, runs a tiny warm-up (thread pool, BLAS
initialisation), then allocates and zero-fills buffers the size of the gradients the inputs will receive
(dHidden [N,D] and dW [V,D]) and reads its resident set size: that RSS is the baseline (inputs + gradient
buffers). It frees those buffers (`.grad` starts as None, as after `zero_grad(set_to_none=True)`), runs
forward + backward once, and reads the peak RSS from `resource.getrusage(RUSAGE_SELF).ru_maxrss` — the
kernel's exact high-water mark, no sampling. Working memory = peak RSS − baseline: what the loss needs beyond
its inputs and the gradients every method must produce (dW is as large as W, whoever computes it). Time is
the wall time of forward + backward; the table shows the median over repeats interleaved across methods
(plain, torch, lmhead, plain, ...) so that load on the shared machine hits all three alike, with one round
only when a round takes longer than --round-limit seconds.

The plain computation holds three [N,V] float32 buffers (log-probabilities, their gradient, the logits'
gradient) at its peak; it is skipped — "skipped: needs X GiB" — when that estimate exceeds the memory
psutil reports available (less a 1 GiB margin) or --max-gib. A run longer than --timeout is stopped, and
that method is not run on the larger configurations.

    python benchmarks/bench_loss.py                 # the three issue configurations
    python benchmarks/bench_loss.py --quick         # small sizes, a minute
    python benchmarks/bench_loss.py --chart docs/loss_memory.png   # + working memory against N (D=576, V=49,152)
    python benchmarks/bench_loss.py --chart docs/loss_memory.png --chart-only   # the chart's points only
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from records import Figure, Recorder, Table  # same folder: run as a script, it is on sys.path

CONFIGS = [(4096, 576, 49152), (4096, 640, 262144), (8192, 640, 262144)]
QUICK_CONFIGS = [(1024, 256, 32000), (2048, 576, 49152)]
CHART = {"d": 576, "v": 49152, "n": [512, 1024, 2048, 4096]}  # SmolLM2-135M's head
QUICK_CHART = {"d": 256, "v": 32000, "n": [256, 512, 1024, 2048]}
ALL_METHODS = ("plain", "torch", "lmhead")
METHODS = list(ALL_METHODS)  # --methods narrows this
GiB = 2**30


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(method: str, n: int, d: int, v: int, threads: int) -> dict:
    """One forward + backward in this (fresh) process; returns time and working memory."""
    import torch
    import torch.nn.functional as F

    from lmhead import linear_cross_entropy

    if threads:
        torch.set_num_threads(threads)

    def loss_fn(h, w, t):
        if method == "plain":
            return F.cross_entropy(F.linear(h, w), t)
        if method == "torch":
            return F.linear_cross_entropy(h, w, t, options=torch.nn.LinearCrossEntropyOptions())
        return linear_cross_entropy(h, w, t)

    g = torch.Generator().manual_seed(0)
    small = [torch.randn(64, 32, generator=g, requires_grad=True),
             torch.randn(500, 32, generator=g, requires_grad=True), torch.randint(0, 500, (64,), generator=g)]
    loss_fn(*small).backward()  # warm-up: thread pool, BLAS, lazy initialisation
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (torch.randn(v, d, generator=g) * d**-0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    inputs_rss = _rss()
    grads = (torch.zeros(n, d), torch.zeros(v, d))  # the gradients' size, pages touched
    baseline = _rss()
    del grads

    start = time.perf_counter()
    loss = loss_fn(hidden, weight, targets)
    loss.backward()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    assert hidden.grad is not None and weight.grad is not None
    return {"time_s": elapsed, "working_bytes": max(0, peak - baseline), "gradient_bytes": baseline - inputs_rss,
            "loss": float(loss), "threads": torch.get_num_threads()}


def plain_need_bytes(n: int, d: int, v: int) -> int:
    """Peak estimate of the plain computation: three [N,V] float32 buffers + inputs + gradients, +5%
    (the three [N,V] buffers are what this script measures at the peak)."""
    return int((3 * n * v + 2 * (n * d + v * d)) * 4 * 1.05)


def run_one(method: str, n: int, d: int, v: int, args: argparse.Namespace) -> dict:
    if method == "plain":
        import psutil

        need = plain_need_bytes(n, d, v)
        limit = psutil.virtual_memory().available - GiB
        if args.max_gib is not None:
            limit = min(limit, int(args.max_gib * GiB))
        if need > limit:
            return {"skipped": f"skipped: needs {need / GiB:.1f} GiB", "need_bytes": need}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, str(n), str(d), str(v),
           "--threads", str(args.threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"timeout > {args.timeout:.0f} s"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"skipped": f"failed: {tail[0][:80]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(configs: list[tuple[int, int, int]], args: argparse.Namespace, repeats: int) -> dict:
    """{(n,d,v): {method: {"times": [...], "working": max bytes, "loss": .., "skipped": ..}}}"""
    results: dict = {}
    timed_out: set[str] = set()  # a method that timed out is not run again on a larger configuration
    for n, d, v in sorted(configs, key=lambda c: c[0] * c[1] * c[2]):
        res = {m: {"times": [], "working": 0} for m in METHODS}
        for m in timed_out:
            res[m]["skipped"] = "skipped: timed out on a smaller size"
        for r in range(repeats):
            round_start = time.perf_counter()
            for m in METHODS:
                if res[m].get("skipped"):
                    continue
                out = run_one(m, n, d, v, args)
                if "skipped" in out:
                    res[m].update(out)
                    if out["skipped"].startswith("timeout"):
                        timed_out.add(m)
                    continue
                res[m]["times"].append(out["time_s"])
                res[m]["working"] = max(res[m]["working"], out["working_bytes"])
                res[m]["loss"] = out["loss"]
                res[m]["threads"] = out["threads"]
                print(f"  N={n} D={d} V={v} {m:6s} run {r + 1}: {out['time_s']:.2f} s, working "
                      f"{out['working_bytes'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
            if time.perf_counter() - round_start > args.round_limit:
                break
        results[(n, d, v)] = res
    return results


def _mem(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / 2**20:.0f} MiB"


COLUMNS = ["N", "D", "V", "plain time", "torch time", "lmhead time", "plain mem", "torch mem", "lmhead mem",
           "lmhead/plain mem", "lmhead/plain time", "lmhead/torch time", "max Δloss"]


def rows(results: dict) -> list[tuple[list[str], list[Figure]]]:
    """The table's cells per configuration, and lmhead's figures against plain and torch behind them."""
    out = []
    for (n, d, v), res in results.items():
        res = {m: res.get(m, {"times": [], "working": 0, "skipped": "not run"}) for m in ALL_METHODS}
        t = {m: statistics.median(res[m]["times"]) if res[m]["times"] else None for m in ALL_METHODS}
        w = {m: res[m]["working"] if res[m]["times"] else None for m in ALL_METHODS}

        def cell(m, kind, res=res, t=t, w=w):
            if res[m].get("skipped") and not res[m]["times"]:
                return res[m]["skipped"]
            return f"{t[m]:.2f} s" if kind == "t" else _mem(w[m])

        def ratio(a, b, kind, t=t, w=w):
            x, y = (w[a], w[b]) if kind == "m" else (t[a], t[b])
            if x is None or y is None or y == 0:
                return "—"
            return f"{x / y:.1%}" if kind == "m" else f"{x / y:.2f}×"

        losses = [res[m]["loss"] for m in ALL_METHODS if "loss" in res[m]]
        dloss = f"{(max(losses) - min(losses)) / abs(losses[0]):.1e}" if len(losses) > 1 else "—"
        figures = []
        for base in ("plain", "torch"):
            shape = f"N={n} D={d} V={v}"
            if t["lmhead"] is not None and t[base] is not None:
                figures.append(Figure(f"lmhead fwd+bwd time, {shape}", t["lmhead"], "s", base, t[base]))
            if w["lmhead"] is not None and w[base] is not None:
                figures.append(Figure(f"lmhead working memory, {shape}", w["lmhead"], "bytes", base, w[base]))
        out.append(([f"{n:,}", str(d), f"{v:,}", cell("plain", "t"), cell("torch", "t"), cell("lmhead", "t"),
                     cell("plain", "m"), cell("torch", "m"), cell("lmhead", "m"), ratio("lmhead", "plain", "m"),
                     ratio("lmhead", "plain", "t"), ratio("lmhead", "torch", "t"), dloss], figures))
    return out


def table(results: dict, record: Table | None = None) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for cells, figures in rows(results):
        lines.append("| " + " | ".join(cells) + " |")
        if record is not None:
            record.row(cells, figures)
    return "\n".join(lines)


def chart(path: str, results: dict, spec: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d, v, ns = spec["d"], spec["v"], spec["n"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    styles = {"plain": ("tab:red", "o"), "torch": ("tab:blue", "s"), "lmhead": ("tab:green", "^")}
    for m in METHODS:
        color, marker = styles[m]
        xs, ys, skipped = [], [], []
        for n in ns:
            r = results[(n, d, v)][m]
            if r["times"]:
                xs.append(n)
                ys.append(r["working"] / 2**20)
            elif "need_bytes" in r:
                skipped.append((n, r["need_bytes"] / 2**20))
        label = {"plain": "plain (F.linear + F.cross_entropy)", "torch": "torch F.linear_cross_entropy (chunked)",
                 "lmhead": "lmhead linear_cross_entropy"}[m]
        ax.plot(xs, ys, marker=marker, color=color, label=label)
        for n, mib in skipped:
            ax.plot([n], [mib], marker="x", color=color, markersize=9, linestyle="none")
            ax.annotate("skipped\n(estimate)", (n, mib), textcoords="offset points", xytext=(-20, 6), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [f"{n:,}" for n in ns])
    ax.set_xlabel("tokens N")
    ax.set_ylabel("working memory, MiB (peak RSS − inputs − gradients)")
    ax.set_title(f"Loss forward+backward working memory, D={d}, V={v:,}, float32, CPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    print(f"chart written to {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"small sizes {QUICK_CONFIGS}")
    p.add_argument("--chart", metavar="PATH", help="also write a PNG of working memory against N")
    p.add_argument("--chart-only", action="store_true", help="with --chart: measure the chart's points only")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds per configuration (default 3)")
    p.add_argument("--round-limit", type=float, default=120.0,
                   help="stop repeating a configuration after a round longer than this (s, default 120)")
    p.add_argument("--timeout", type=float, default=900.0, help="stop one run after this many seconds")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default)")
    p.add_argument("--max-gib", type=float, default=None, help="skip the plain computation above this")
    p.add_argument("--only", metavar="N,D,V", help="one configuration instead of the standard ones")
    p.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated subset of plain,torch,lmhead")
    p.add_argument("--worker", nargs=4, metavar=("METHOD", "N", "D", "V"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        m, n, d, v = args.worker
        print(json.dumps(worker(m, int(n), int(d), int(v), args.threads)))
        return
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not chosen or any(m not in ALL_METHODS for m in chosen):
        p.error(f"--methods must be a subset of {','.join(METHODS)}, got {args.methods!r}")
    METHODS[:] = [m for m in ALL_METHODS if m in chosen]

    import torch

    configs = QUICK_CONFIGS if args.quick else CONFIGS
    if args.only:
        try:
            configs = [tuple(int(x) for x in args.only.split(","))]
            assert len(configs[0]) == 3 and min(configs[0]) > 0
        except (ValueError, AssertionError):
            p.error(f"--only must be N,D,V (three positive ints), got {args.only!r}")
    rec = Recorder("loss")
    print(f"{rec.header()}; torch {torch.__version__}, threads {args.threads or torch.get_num_threads()}; "
          f"fwd+bwd float32, mean loss; median of up to {args.repeats} interleaved runs, each in a fresh process")
    results = {} if args.chart_only else measure(configs, args, args.repeats)
    if results:
        name = "quick" if args.quick and not args.only else "configs" if not args.only else "one"
        print(table(results, rec.table(name, "Fused linear cross-entropy, forward + backward, float32: time and "
                                       "working memory against the plain loss and torch's chunked one", COLUMNS)))
    if args.chart:
        spec = QUICK_CHART if args.quick else CHART
        extra = [(n, spec["d"], spec["v"]) for n in spec["n"] if (n, spec["d"], spec["v"]) not in results]
        results.update(measure(extra, args, 1))
        chart(args.chart, results, spec)
        print("chart points:")
        points = rec.table("chart", f"Working memory against N (D={spec['d']}, V={spec['v']:,}): the chart's "
                           "points", COLUMNS)
        print(table({k: results[k] for k in sorted(results) if k[1:] == (spec["d"], spec["v"])}, points))
    rec.write()


if __name__ == "__main__":
    main()
