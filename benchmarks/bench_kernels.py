"""The C kernels' pieces side by side with what they replace, in one process (the load average printed).

    .venv/bin/python benchmarks/bench_kernels.py [--repeats 5] [--quick]

1. The coded product (`CodedLinear`, kernels/coded_kernel.c) at 1-32 query rows on the packaged models' shapes
   (synthetic codes in the layouts the models load: Q8_0-like int8 with float16 scales for Gemma 3's head,
   packed 4-bit with offsets for the MLP matrices): ms per call and per row — one row waits on memory, several
   on arithmetic.
2. Gemma 3's head shape at 8-512 rows: the codes against F.linear over the float32 matrix they encode (what
   `LMHead.PRODUCT_MAX_ROWS` chooses between).
3. `Vocab.topk` on rows of 262,144 logits: the threshold pass (`kernels.native.topk`) against torch.topk.
4. The decode loop's raw scores: `kernels.native.row_scores` against log_softmax + a count.
5. A server round's choice for 8 rows of 262,144 logits (half greedy, half seeded top-k 40, as bench_server.py
   sends them): `decode.choice.plain_choice` with and without the draws' logprobs, the rows interleaved (each
   read in place) and side by side (one view per group).
6. One decode row's choice in C against the torch pipeline it replaces, on language-model-like rows (40 tokens
   lifted over randn × 2) of 49,152 (SmolLM2) and 262,144 (Gemma 3) logits: a plain greedy row
   (`native.greedy_rows` against `plain_choice` + `row_scores`) and an unseeded T = 0.8 top-p 0.9 row, scored
   (`plain_choice` with `sampling.top_p.NATIVE_TOP_P_ROWS` 8 — `native.top_p_row` — and 0, the torch windows).
7. The screened head (`CodedLinear.screen`: each row's top k exact, the rest below) against the exact product
   on Gemma 3's head shape (synthetic Q8_0-like codes, rows of randn × 2.5 with an outlier column, as final hidden
   states have), 1-8 rows, k = 2 (greedy) and 41 (top-k 40): where `decode.logits.SCREEN_MIN_ROWS` comes from —
   in the integer path by groups' layout (what a load makes of a Q8_0 head where the path is chosen) and in the
   four-row layout, on the same codes, the two layouts interleaved repeat by repeat.
Best of --repeats, each variant timed in turn.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from records import Figure, Recorder  # same folder: run as a script, it is on sys.path

from lmhead.kernels import native
from lmhead.models.coded_linear import CodedLinear


def best_ms(fn, repeats: int, inner: int = 1) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best * 1e3


def coded(n: int, k: int, four_bit: bool, g: torch.Generator, groups16: bool = False) -> CodedLinear:
    ng = k // 32
    if four_bit:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, ng, generator=g) * 0.01 + 1e-3
        offset = -8 * scale
    else:
        codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale, offset = (torch.rand(n, ng, generator=g) * 0.01 + 1e-3).half().float(), None
    return CodedLinear(codes, scale, offset, groups16=groups16)


def load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer row counts, no 512-row head")
    args = ap.parse_args()
    if native.library() is None:
        raise SystemExit("the C kernels are not built here (no compiler, or LMHEAD_NATIVE=0)")
    g = torch.Generator().manual_seed(0)
    rec = Recorder("kernels")
    print(f"{rec.header()}; torch threads {torch.get_num_threads()}")
    try:
        sections(args, g, rec)
    finally:
        rec.write()


def sections(args: argparse.Namespace, g: torch.Generator, rec: Recorder) -> None:

    rows = [1, 3, 8, 16] if args.quick else [1, 2, 3, 4, 6, 8, 16, 32]
    print("\n1. coded product, ms per call (ms per row)")
    t1 = rec.table("coded_product", "The coded product (CodedLinear) on the packaged models' shapes: ms per call and "
                   "per row", ["matrix", "rows", "ms per call", "ms per row", "load"])
    shapes = {"Gemma head 262144x640 int8": (262144, 640, False), "Gemma gate_up 4096x640 4-bit": (4096, 640, True),
              "Gemma down 640x2048 4-bit": (640, 2048, True), "SmolLM2 gate_up 3072x576 4-bit": (3072, 576, True)}
    for name, (n, k, four_bit) in shapes.items():
        lin = coded(n, k, four_bit, g)
        inner = max(1, int(3e7 / (n * k)))
        cells = []
        for m in rows:
            x = torch.randn(m, k, generator=g)
            ms = best_ms(lambda lin=lin, x=x: lin(x), args.repeats, inner)
            cells.append(f"{m}: {ms:.2f} ({ms / m:.2f})")
            t1.row([name, m, f"{ms:.2f}", f"{ms / m:.2f}", load()[5:]], [Figure(f"{name}, {m} rows", ms, "ms")])
        print(f"  {name:32} " + "  ".join(cells) + f"  [{load()}]", flush=True)

    print("\n2. Gemma head shape: the codes against F.linear over the float32 matrix they encode (ms)")
    t2 = rec.table("head_codes_vs_linear", "Gemma 3's head shape: the codes against F.linear over the float32 matrix "
                   "they encode (ms)", ["rows", "codes", "F.linear", "F.linear / codes", "load"])
    lin = coded(262144, 640, False, g)
    weight = lin.dequantize()
    for m in ([8, 32, 128] if args.quick else [8, 32, 128, 512]):
        x = torch.randn(m, 640, generator=g)
        a = best_ms(lambda x=x, lin=lin: lin(x), max(1, args.repeats // 2))
        b = best_ms(lambda x=x, w=weight: F.linear(x, w), max(1, args.repeats // 2))
        print(f"  {m:4} rows: codes {a:8.1f}  F.linear {b:8.1f}  F.linear / codes {b / a:5.2f}  [{load()}]",
              flush=True)
        t2.row([m, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}", load()[5:]],
               [Figure(f"coded head, {m} rows", a, "ms", "F.linear over float32", b)])
    del weight, lin

    print("\n3. top-k over rows of 262,144 logits (randn x 3): torch.topk against the threshold pass (ms)")
    t3 = rec.table("topk", "top-k over rows of 262,144 logits: torch.topk against the threshold pass (ms)",
                   ["rows", "k", "torch.topk", "threshold", "ratio", "load"])
    for b in (1, 4, 16):
        x = torch.randn(b, 1 << 18, generator=g) * 3
        for k in (41, 257):
            a = best_ms(lambda x=x, k=k: torch.topk(x, k, dim=-1), args.repeats, 10)
            got = native.topk(x, k)
            t = best_ms(lambda x=x, k=k: native.topk(x, k), args.repeats, 10) if got is not None else float("nan")
            print(f"  {b:2} rows, k {k:3}: torch.topk {a:6.3f}  threshold {t:6.3f}  ratio {a / t:5.2f}"
                  + ("" if got is not None else "  (declined: torch.topk is used)") + f"  [{load()}]", flush=True)
            t3.row([b, k, f"{a:.3f}", f"{t:.3f}" if got is not None else "declined", f"{a / t:.2f}", load()[5:]],
                   [Figure(f"threshold top-{k}, {b} rows", t, "ms", "torch.topk", a)] if got is not None else [])

    print("\n4. raw logprob normaliser and rank: log_softmax + count against row_scores (ms)")
    t4 = rec.table("row_scores", "Raw logprob normaliser and rank over 262,144 logits: log_softmax + count against "
                   "row_scores (ms)", ["rows", "torch", "row_scores", "ratio", "load"])
    for b in (1, 8, 32):
        x = torch.randn(b, 1 << 18, generator=g) * 3
        ids = torch.randint(0, 1 << 18, (b,), generator=g)

        def plain(x=x, ids=ids):
            torch.log_softmax(x, dim=-1).gather(1, ids[:, None])
            (x > x.gather(1, ids[:, None])).sum(dim=-1)

        a = best_ms(plain, args.repeats, 5)
        t = best_ms(lambda x=x, ids=ids: native.row_scores(x, ids), args.repeats, 5)
        print(f"  {b:2} rows: torch {a:6.2f}  row_scores {t:6.2f}  ratio {a / t:5.2f}  [{load()}]", flush=True)
        t4.row([b, f"{a:.2f}", f"{t:.2f}", f"{a / t:.2f}", load()[5:]],
               [Figure(f"row_scores, {b} rows", t, "ms", "log_softmax + count", a)])

    print("\n5. an 8-row server round's choice (plain_choice; greedy and seeded top-k 40 rows) (ms)")
    t5 = rec.table("server_round", "An 8-row server round's choice over 262,144 logits (greedy and seeded top-k 40 "
                   "rows), ms", ["rows", "ids", "ids + logprobs", "load"])
    from lmhead.decode.choice import plain_choice
    from lmhead.sampling import SamplingConfig

    x = torch.randn(8, 1 << 18, generator=g) * 3
    greedy = SamplingConfig(temperature=0.0)
    orders = {"interleaved": [greedy if r % 2 == 0 else SamplingConfig(temperature=0.8, top_k=40, seed=r)
                              for r in range(8)]}
    orders["side by side"] = sorted(orders["interleaved"], key=lambda c: c.seed is not None)
    for name, cfgs in orders.items():
        a = best_ms(lambda c=cfgs: plain_choice(x, c, None, [8] * 8, [3] * 8, None), args.repeats, 5)
        t = best_ms(lambda c=cfgs: plain_choice(x, c, None, [8] * 8, [3] * 8, None, scored=True), args.repeats, 5)
        print(f"  {name:12}: ids {a:6.2f}  ids + logprobs {t:6.2f}  [{load()}]", flush=True)
        t5.row([name, f"{a:.2f}", f"{t:.2f}", load()[5:]],
               [Figure(f"plain_choice with logprobs, {name}", t, "ms", "plain_choice, ids only", a)])

    print("\n6. one decode row's choice: the C passes against the torch pipeline (ms)")
    t6 = rec.table("decode_row", "One decode row's choice: the C passes against the torch pipeline (ms)",
                   ["logits", "row", "torch", "C", "ratio", "load"])
    from lmhead.sampling import top_p as sampling  # the module that holds the C pass's row limit

    greedy_cfg, top_p = [SamplingConfig(temperature=0.0)], [SamplingConfig(temperature=0.8, top_p=0.9)]
    for width in (49152, 1 << 18):
        row = torch.randn(1, width, generator=g) * 2
        lifted = torch.randperm(width, generator=g)[:40]
        row[0, lifted] += 12 * torch.rand(40, generator=g) + 4

        def greedy_torch(row=row):
            ids, _ = plain_choice(row, greedy_cfg, None, [8], [3], None, scored=True)
            native.row_scores(row, ids)

        a = best_ms(greedy_torch, args.repeats, 10)
        t = best_ms(lambda row=row: native.greedy_rows(row), args.repeats, 10)
        print(f"  {width:6} logits, greedy: pipeline + row_scores {a:6.3f}  greedy_rows {t:6.3f}  ratio {a / t:5.2f}"
              f"  [{load()}]", flush=True)
        t6.row([width, "greedy", f"{a:.3f}", f"{t:.3f}", f"{a / t:.2f}", load()[5:]],
               [Figure(f"greedy_rows, {width} logits", t, "ms", "plain_choice + row_scores", a)])
        gen = torch.Generator().manual_seed(0)
        timed = {}
        for rows in (0, sampling.NATIVE_TOP_P_ROWS):
            saved, sampling.NATIVE_TOP_P_ROWS = sampling.NATIVE_TOP_P_ROWS, rows
            try:
                timed[rows] = best_ms(lambda row=row, gen=gen: plain_choice(row, top_p, None, [8], [3], gen,
                                                                             scored=True), args.repeats, 10)
            finally:
                sampling.NATIVE_TOP_P_ROWS = saved
        a, t = timed[0], timed[sampling.NATIVE_TOP_P_ROWS]
        print(f"  {width:6} logits, top-p 0.9: torch windows {a:6.3f}  top_p_row {t:6.3f}  ratio {a / t:5.2f}"
              f"  [{load()}]", flush=True)
        t6.row([width, "T 0.8, top-p 0.9", f"{a:.3f}", f"{t:.3f}", f"{a / t:.2f}", load()[5:]],
               [Figure(f"top_p_row, {width} logits", t, "ms", "torch windows", a)])


    print("\n7. the screened head against the exact product, Gemma 3's head shape (ms per call)")
    t7 = rec.table("screen", "The screened head against the exact product, Gemma 3's head shape (ms per call; "
                   "the layout by groups, as loads make a Q8_0 head where that path is chosen, and the four-row "
                   "layout, on the same codes)",
                   ["rows", "layout", "exact", "screen k=2", "exact / k=2", "screen k=41", "exact / k=41",
                    "four-row / by groups", "load"])
    heads = {"four-row": coded(262144, 640, False, torch.Generator().manual_seed(7))}
    by_groups = coded(262144, 640, False, torch.Generator().manual_seed(7), groups16=True)
    if by_groups.by_groups:
        heads = {"by groups": by_groups, **heads}
    if not all(h.screens for h in heads.values()):
        print("  (no screen here: the library was built without AVX2)")
        return
    for m in ([1, 2, 4, 8] if args.quick else [1, 2, 3, 4, 5, 8]):
        x = torch.randn(m, 640, generator=g) * 2.5
        x[:, 7] = 60.0
        # the layouts interleaved, repeat by repeat (a drifting machine slows both alike); best of the repeats
        best = {name: [float("inf")] * 3 for name in heads}
        with torch.inference_mode():
            for r in range(args.repeats + 1):  # the first round a warm-up
                for name in (list(heads) if r % 2 else list(heads)[::-1]):
                    head = heads[name]
                    for i, k in enumerate((0, 2, 41)):  # 0: the exact product
                        t = time.perf_counter()
                        head.screen(x, [k] * m) if k else head(x)
                        if r:
                            best[name][i] = min(best[name][i], (time.perf_counter() - t) * 1e3)
        got = {name: tuple(v) for name, v in best.items()}
        for name, (exact, two, wide) in got.items():
            four = got["four-row"]
            vs = (f"{four[0] / exact:.2f} / {four[1] / two:.2f} / {four[2] / wide:.2f}" if name != "four-row"
                  else "-")
            print(f"  {m} rows, {name:9}: exact {exact:6.2f}  screen k=2 {two:6.2f} ({exact / two:4.2f}x)  k=41 "
                  f"{wide:6.2f} ({exact / wide:4.2f}x)  four-row / this (exact / k=2 / k=41) {vs}  [{load()}]",
                  flush=True)
            t7.row([m, name, f"{exact:.2f}", f"{two:.2f}", f"{exact / two:.2f}×", f"{wide:.2f}",
                    f"{exact / wide:.2f}×", vs, load()[5:]],
                   [Figure(f"screen k=2, {m} rows, {name}", two, "ms", "exact product", exact),
                    Figure(f"screen k=41, {m} rows, {name}", wide, "ms", "exact product", exact)])


if __name__ == "__main__":
    main()
