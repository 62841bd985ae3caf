"""Benchmark: lmhead.sample against transformers' warper chain + torch.multinomial, side by side.

For B ∈ {1, 8, 64} and V ∈ {49,152, 262,144}, the median time of
  lmhead     `sample(logits, SamplingConfig(...))` (top-k via torch.topk, top-p / min-p inside the survivors,
             exponential-race draw; top-p alone by a rejection draw from the whole row, no top-p set — but on
             up to 8 rows the exact top-p set one C pass finds where it settles a row, raced over)
  hf         TemperatureLogitsWarper → TopKLogitsWarper → TopPLogitsWarper, softmax, torch.multinomial
  topk(50)   a bare `torch.topk(logits, 50)` on the same tensor: the floor for anything that applies top-k
measured in one process, repeats interleaved (lmhead, hf, topk, lmhead, hf, …), so machine noise hits all
columns alike. Table 1: T=0.8, top-k=50, top-p=0.9. Tables 2-4: T=0.8, top-p=0.9 alone (HF sorts the whole
vocabulary) on Gaussian logits of std 5 — about the spread of Gemma 3 270M's next-token logits (its top-p
0.9 sets hold tens of tokens) —, std 3 (top-p sets of ~2,000 of 262,144 tokens) and std 1
(flat: the top-p set is half the vocabulary). `--only-top-p` skips table 1; `--sizes B,V` picks one size.
The last table: each declared step that the batch path does not run (lmhead.sampling.steps; typical-p, DRY,
mirostat, ...), with the example setting its declaration gives, alone at T=0.8 on one row (B=1) of V = 49,152 and
262,144 (std 5) with a 256-token history: the step's own cost per token and a whole token with it, beside a bare
`torch.topk(row, 50)` on that row (the goal: no step above it) and a token at T=0.8 alone (the path today's
settings take); `--only-steps` prints only that table.
The mixed-batch table: a server round of 16 rows whose 16 clients each sent other settings (temperature, top-k,
top-p, min-p, a few seeded) against 16 rows sharing one setting (the mean over the 16 settings of each one's own
batch), same logits (std 5), V = 49,152 and 262,144 (the goal: mixed ≤ 1.5× shared); the same for 16 settings of
the declared steps beyond them (typical-p, top-nσ, epsilon, eta, DRY, n-grams, top-a, dynamic temperature, with a
256-token history: each step runs once over the rows that run it); `--only-mixed [mixed_batch|mixed_steps]` prints
only those tables (or the one named).
The decode loop's table (`--only-loop [MODEL]`, default smollm2-135m): one plain row a token (greedy, unseeded
top-p, seeded top-p, seeded top-k + top-p, seeded temperature alone) decoded on the real model, the profile's
sampling share of a token with the loop's own draws (native.greedy_rows, native.sample_row,
sampling.draw.seeded_row, sampling.pipeline.sample_plain_rows, the seeded race in C) beside the same rows
drawn by the whole pipeline with torch's race (`plain_choice`), alternated in one process; the tokens compared.

    .venv/bin/python benchmarks/bench_sampling.py [--quick] [--repeats N] [--threads N (default 1)]
                                                  [--only-top-p] [--only-steps] [--only-mixed [NAME]]
                                                  [--only-loop [MODEL]] [--sizes 64,262144]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from records import Figure, Recorder  # same folder: run as a script, it is on sys.path

from lmhead.sampling import SamplingConfig, sample

BATCHES = (1, 8, 64)
VOCABS = (49_152, 262_144)


def hf_chain(temperature: float, top_k: int, top_p: float):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))

    def run(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
        probs = torch.softmax(warpers(ids, logits), dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(1)

    return run


def median_times(fns: dict, repeats: int, budget_s: float) -> dict[str, float]:
    """Median per function over interleaved rounds: at least `repeats` rounds, more (up to 20×) while the
    rounds fit in `budget_s`, so that fast cases get enough samples to beat the machine's noise."""
    for fn in fns.values():  # warm-up: allocator, thread pool, lazy imports
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < repeats or (rounds < 20 * repeats and time.perf_counter() - start < budget_s):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        rounds += 1
    return {name: statistics.median(ts) for name, ts in times.items()}


def fits(batch: int, vocab: int) -> tuple[bool, float]:
    need = batch * vocab * 4 * 10 / 2**30  # logits + HF's sorted copies, softmax, masks
    try:
        import psutil

        return psutil.virtual_memory().available / 2**30 > need + 1, need
    except ImportError:
        return True, need


def table(rec: Recorder, name: str, title: str, cfg: SamplingConfig, repeats: int, scale: float,
          with_topk: bool, sizes: list[tuple[int, int]]) -> None:
    print(f"\n{title}")
    columns = ["B", "V", "lmhead ms", "hf ms", "hf/lmhead"] + (["topk(50) ms", "lmhead/topk"] if with_topk else [])
    record = rec.table(name, title, columns)
    head = f"{'B':>4} {'V':>8} {'lmhead ms':>10} {'hf ms':>10} {'hf/lmhead':>10}"
    if with_topk:
        head += f" {'topk(50) ms':>12} {'lmhead/topk':>12}"
    print(head)
    hf = hf_chain(cfg.temperature, cfg.top_k, cfg.top_p)
    for batch, vocab in sizes:
        ok, need = fits(batch, vocab)
        if not ok:
            print(f"{batch:>4} {vocab:>8}  skipped: needs {need:.1f} GiB")
            record.note(f"B={batch}, V={vocab}: skipped, needs {need:.1f} GiB")
            continue
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * scale
        gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
        fns = {"lmhead": lambda x=logits, g=gen_a: sample(x, cfg, generator=g),
               "hf": lambda x=logits, g=gen_b: hf(x, g)}
        if with_topk:
            fns["topk"] = lambda x=logits: torch.topk(x, 50)
        t = median_times(fns, repeats, budget_s=2.0 if repeats > 5 else 0.5)
        row = (f"{batch:>4} {vocab:>8} {t['lmhead'] * 1e3:>10.2f} {t['hf'] * 1e3:>10.2f} "
               f"{t['hf'] / t['lmhead']:>9.1f}×")
        figures = [Figure(f"lmhead sample, B={batch}, V={vocab}", t["lmhead"] * 1e3, "ms",
                          "transformers warpers + torch.multinomial", t["hf"] * 1e3)]
        if with_topk:
            row += f" {t['topk'] * 1e3:>12.2f} {t['lmhead'] / t['topk']:>11.2f}×"
            figures.append(Figure(f"lmhead sample, B={batch}, V={vocab}", t["lmhead"] * 1e3, "ms",
                                  "torch.topk(logits, 50)", t["topk"] * 1e3, t["lmhead"] / t["topk"]))
        print(row, flush=True)
        record.row(row.split(), figures)


def steps_table(rec: Recorder, repeats: int) -> None:
    """Each declared step the batch path does not run, with its declaration's example setting, at T=0.8 on one row
    (std 5 logits, a 256-token history) of each vocabulary size: the step's own cost (its `apply` on the row the
    chain hands it, as lmhead.sampling.general runs it) and a whole token with it (`sample`), beside a bare
    `torch.topk(row, 50)` and a token at T=0.8 alone (today's path) on the same row, all interleaved."""
    from lmhead.sampling import RowState
    from lmhead.sampling.steps import STEPS, Context

    settings = {n: dict(s.example) for n, s in STEPS.items() if "batch" not in s.backends}
    missing = [n for n, example in settings.items() if not example]
    if missing:
        raise SystemExit(f"bench_sampling: the steps {missing} declare no example setting")
    title = ("Each declared step alone, T=0.8, B=1 (logits std 5, 256 tokens of history): the step's own cost and a "
             "whole token with it (lmhead.sample) beside a bare torch.topk(row, 50) and a token at T=0.8 alone")
    print(f"\n{title}")
    columns = ["step", "V", "step ms", "token ms", "topk(50) ms", "T-only token ms", "step/topk", "token/topk",
               "token/T-only"]
    print(f"{columns[0]:>18} {columns[1]:>7} " + " ".join(f"{c:>12}" for c in columns[2:]))
    record = rec.table("steps", title, columns)
    plain = SamplingConfig(temperature=0.8)
    for vocab in VOCABS:
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 5
        scaled = logits / plain.temperature
        history = torch.randint(0, vocab, (256,), generator=torch.Generator().manual_seed(3)).tolist()
        history[-8:] = history[100:108]  # a repeat for DRY and the n-grams to find
        for name, example in settings.items():
            if "allowed_token_ids" in example:  # every 7th id of this vocabulary
                example = {**example, "allowed_token_ids": tuple(range(0, vocab, 7))}
            cfg = SamplingConfig(temperature=0.8, **example)
            step = STEPS[name]
            row = logits if step.stage <= 2 else scaled  # what the chain hands the step
            ctx = Context(history=history, prompt_len=0, state=RowState(), xtc=True)  # XTC's coin: the cut runs
            gen, state = torch.Generator().manual_seed(1), [RowState()]
            fns = {"step": lambda s=step, r=row, c=cfg, x=ctx: s.apply(r, c, x),
                   "token": lambda x=logits, c=cfg, g=gen, st=state, h=history: sample(
                       x, c, generator=g, prev_tokens=[h], prompt_len=0, state=st),
                   "topk": lambda x=logits: torch.topk(x, 50),
                   "plain": lambda x=logits, g=gen: sample(x, plain, generator=g)}
            t = median_times(fns, repeats, budget_s=1.0)
            cells = [name, vocab, f"{t['step'] * 1e3:.3f}", f"{t['token'] * 1e3:.3f}", f"{t['topk'] * 1e3:.3f}",
                     f"{t['plain'] * 1e3:.3f}", f"{t['step'] / t['topk']:.2f}×", f"{t['token'] / t['topk']:.2f}×",
                     f"{t['token'] / t['plain']:.2f}×"]
            print(f"{cells[0]:>18} {cells[1]:>7} " + " ".join(f"{c:>12}" for c in cells[2:]), flush=True)
            what = f"{name} alone, B=1, V={vocab}"
            record.row(cells, [Figure(f"{what}: the step", t["step"] * 1e3, "ms", "torch.topk(row, 50)",
                                      t["topk"] * 1e3, t["step"] / t["topk"]),
                               Figure(f"{what}: a token", t["token"] * 1e3, "ms", "torch.topk(row, 50)",
                                      t["topk"] * 1e3, t["token"] / t["topk"]),
                               Figure(f"{what}: a token", t["token"] * 1e3, "ms", "a token at T=0.8 alone",
                                      t["plain"] * 1e3, t["token"] / t["plain"])])


MIXED_ROWS = 16


def mixed_configs(rows: int = MIXED_ROWS) -> list[SamplingConfig]:
    """`rows` settings, each other than the rest: temperatures 0.5-1.25, top-k off or 20-90, top-p 0.8-0.95 or
    off, min-p off or 0.02-0.1, every fourth row seeded (the kinds of settings a server round's clients send)."""
    out = []
    for r in range(rows):
        out.append(SamplingConfig(temperature=0.5 + 0.05 * r, top_k=0 if r % 3 == 0 else 20 + 5 * r,
                                  top_p=1.0 if r % 5 == 4 else 0.8 + 0.01 * r,
                                  min_p=0.0 if r % 2 else 0.02 + 0.005 * r, seed=r if r % 4 == 3 else None))
    return out


def mixed_step_configs(rows: int = MIXED_ROWS) -> list[SamplingConfig]:
    """`rows` settings of the declared steps the batch path does not run, each other than the rest: one or two of
    typical-p, top-nσ, epsilon, eta, DRY, no repeated n-grams, top-a, dynamic temperature and XTC per row, with
    temperatures 0.6-1.35, top-k off or 40-75 and min-p off or 0.02-0.05, every fourth row seeded."""
    kinds = [lambda r: dict(typical_p=0.8 + 0.01 * r), lambda r: dict(top_n_sigma=0.8 + 0.1 * r),
             lambda r: dict(epsilon_cutoff=1e-4 * (r + 1)), lambda r: dict(eta_cutoff=1e-4 * (r + 1)),
             lambda r: dict(dry_multiplier=0.5 + 0.1 * r), lambda r: dict(no_repeat_ngram_size=2 + r % 3),
             lambda r: dict(top_a=0.05 + 0.02 * r), lambda r: dict(dynatemp_range=0.2 + 0.05 * r)]
    out = []
    for r in range(rows):
        extra = {**kinds[r % len(kinds)](r), **(kinds[(r + 3) % len(kinds)](r) if r % 2 else {})}
        out.append(SamplingConfig(temperature=0.6 + 0.05 * r, top_k=0 if r % 3 else 40 + 5 * (r // 3),
                                  min_p=0.0 if r % 4 != 1 else 0.02 + 0.01 * (r // 4),
                                  seed=r if r % 4 == 3 else None, **extra))
    return out


# the mixed-batch cases: (record name, what the rows' settings are, their settings, whether the rows read a history)
MIXED_CASES = (("mixed_batch", "today's settings (temperature, top-k, top-p, min-p)", mixed_configs, False),
               ("mixed_steps", "the declared steps beyond them (typical-p, top-nσ, epsilon, eta, DRY, n-grams, "
                "top-a, dynamic temperature; a 256-token history)", mixed_step_configs, True))


def mixed_table(rec: Recorder, repeats: int, which: str | None = None) -> None:
    """16 rows with 16 different settings against 16 rows sharing one setting, same logits, interleaved, for each
    mixed case (`which`: one of them). The shared time is the mean over the 16 settings of 16 rows sharing that one
    (each setting's own cost, so the ratio measures what mixing them costs, not which settings are cheap)."""
    for name, what, build, history in MIXED_CASES:
        if which is not None and name != which:
            continue
        mixed = build()
        title = (f"A round of {MIXED_ROWS} rows: {MIXED_ROWS} different settings of {what} vs {MIXED_ROWS} rows "
                 f"sharing one setting (the mean over the {MIXED_ROWS} settings; logits std 5)")
        print(f"\n{title}")
        columns = ["B", "V", "mixed ms", "shared ms", "mixed/shared"]
        print(" ".join(f"{c:>12}" for c in columns))
        record = rec.table(name, title, columns)
        for vocab in VOCABS:
            logits = torch.randn(MIXED_ROWS, vocab, generator=torch.Generator().manual_seed(0)) * 5
            hist = torch.randint(0, vocab, (MIXED_ROWS, 256), generator=torch.Generator().manual_seed(3))
            hist[:, -8:] = hist[:, 100:108]  # a repeat for DRY and the n-grams to find
            prev = dict(prev_tokens=hist, prompt_len=0) if history else {}
            gen = torch.Generator().manual_seed(1)
            fns = {"mixed": lambda x=logits, g=gen, m=mixed, p=prev: sample(x, m, generator=g, step=0, **p)}
            for r, cfg in enumerate(mixed):
                fns[f"shared{r}"] = lambda x=logits, g=gen, c=cfg, p=prev: sample(x, c, generator=g, step=0, **p)
            t = median_times(fns, repeats, budget_s=4.0 if repeats > 5 else 1.0)
            shared = statistics.fmean(t[f"shared{r}"] for r in range(len(mixed)))
            cells = [MIXED_ROWS, vocab, f"{t['mixed'] * 1e3:.2f}", f"{shared * 1e3:.2f}",
                     f"{t['mixed'] / shared:.2f}×"]
            print(" ".join(f"{c:>12}" for c in cells), flush=True)
            record.row(cells, [Figure(f"sample, {MIXED_ROWS} rows of {MIXED_ROWS} settings ({name}), V={vocab}",
                                      t["mixed"] * 1e3, "ms",
                                      f"{MIXED_ROWS} rows of one setting (mean over the settings)", shared * 1e3,
                                      t["mixed"] / shared)])


# the decode loop's plain rows: (what, the row's settings)
LOOP_ROWS = (("greedy", SamplingConfig(temperature=0.0)),
             ("unseeded top-p", SamplingConfig(temperature=0.8, top_p=0.9)),
             ("seeded top-p", SamplingConfig(temperature=0.8, top_p=0.9, seed=7)),
             ("seeded top-k + top-p", SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, seed=7)),
             ("seeded temperature", SamplingConfig(temperature=0.8, seed=7)))


def loop_table(rec: Recorder, model_name: str, rounds: int, new_tokens: int = 48) -> None:
    """One plain row a token decoded on a real model: the profile's sampling share of a token (ms) with the loop's
    own draws and with the whole pipeline (its fast paths turned off, torch's race), alternated per round."""
    import os

    from bench_decode import PROMPTS, steps_rate, timed_generate

    from lmhead import load_model
    from lmhead.decode import engine
    from lmhead.decode.choice import plain_choice, torch_steps
    from lmhead.sampling import race

    model = load_model(model_name, progress=False)
    loop = (engine.plain_round, race.race_in_c)

    def pipeline_round(logits, configs, history, prompt_len, steps, generator, states=None, unmasked=True):
        """`plain_round` with every row through the whole pipeline (`plain_choice`)."""
        ids, chosen = plain_choice(logits, configs, history, prompt_len, steps, generator, scored=True,
                                   states=states)
        return [[int(t)] for t in ids.tolist()], [[v] for v in chosen.tolist()], None, torch_steps(configs)

    def use(own: bool) -> None:
        engine.plain_round, race.race_in_c = loop if own else (pipeline_round, lambda *a: None)

    title = (f"{model_name}: the decode loop's choice of one plain row a token ({new_tokens} tokens a run, {rounds} "
             "alternated runs, medians) — the profile's sampling share of a token with the loop's own draws and "
             "with the whole pipeline (torch's race), and the steps' tok/s; an unseeded row's draws from the same "
             "generator differ between the two, its distribution does not")
    print(f"\n{title}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    columns = ["row", "loop ms", "pipeline ms", "loop/pipeline", "loop tok/s", "pipeline tok/s", "same tokens"]
    print(" | ".join(columns))
    record = rec.table(f"loop_{model_name.replace('-', '_').replace('.', '_')}", title, columns)
    try:
        for what, config in LOOP_ROWS:
            share: dict[bool, list[float]] = {True: [], False: []}
            rate: dict[bool, list[float]] = {True: [], False: []}
            ids: dict[bool, list[int]] = {}
            for own in (True, False):  # warm-up
                use(own)
                timed_generate(model, PROMPTS[0], 4, config)
            for r in range(rounds):
                for own in ((True, False) if r % 2 == 0 else (False, True)):
                    use(own)
                    profile: dict[str, float] = {}
                    got, wall, first = timed_generate(model, PROMPTS[2], new_tokens, config, profile=profile)
                    spent = sum(v for k, v in profile.items() if k.startswith("sampling"))
                    share[own].append(spent / max(len(got), 1) * 1e3)
                    rate[own].append(steps_rate(got, wall, first))
                    ids[own] = got
            a, b = statistics.median(share[True]), statistics.median(share[False])
            cells = [what, f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}", f"{statistics.median(rate[True]):.1f}",
                     f"{statistics.median(rate[False]):.1f}",
                     "yes" if ids[True] == ids[False] else "no" if config.is_greedy or config.seed is not None
                     else "other draws (unseeded)"]
            print(" | ".join(cells), flush=True)
            record.row(cells, [Figure(f"the decode loop's sampling share, {what} ({model_name})", a, "ms",
                                      "the whole pipeline", b, a / b)])
    finally:
        use(True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 repeats instead of 21")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per measurement (median is reported)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared machine one thread gives stable medians)")
    ap.add_argument("--only-top-p", action="store_true", help="only the top-p-alone tables")
    ap.add_argument("--only-steps", action="store_true", help="only the table of the declared steps' costs")
    ap.add_argument("--only-mixed", nargs="?", const="all", default=None, choices=["all", "mixed_batch", "mixed_steps"],
                    help="only the tables of a batch of 16 different settings vs one shared setting (or the one "
                    "named: mixed_batch, today's settings; mixed_steps, the declared steps beyond them)")
    ap.add_argument("--only-loop", nargs="?", const="smollm2-135m", default=None, metavar="MODEL",
                    help="only the decode loop's table: one plain row a token on MODEL (default smollm2-135m), the "
                    "loop's own draws against the whole pipeline")
    ap.add_argument("--sizes", default=None, help="one size B,V (default: B in 1, 8, 64 × V in 49152, 262144)")
    args = ap.parse_args()
    if args.sizes:
        batch, vocab = (int(v) for v in args.sizes.split(","))
        sizes = [(batch, vocab)]
    else:
        sizes = [(batch, vocab) for vocab in VOCABS for batch in BATCHES]
    torch.set_num_threads(max(1, args.threads))
    repeats = args.repeats or (5 if args.quick else 21)
    rec = Recorder("sampling")
    print(f"{rec.header()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"median of ≥ {repeats} interleaved repeats")
    if args.only_loop:
        loop_table(rec, args.only_loop, args.repeats or (3 if args.quick else 6))
        rec.write()
        return
    if args.only_steps or args.only_mixed:
        if args.only_steps:
            steps_table(rec, repeats)
        else:
            mixed_table(rec, repeats, None if args.only_mixed == "all" else args.only_mixed)
        rec.write()
        return
    if not args.only_top_p:
        table(rec, "top_k_top_p", "T=0.8, top-k=50, top-p=0.9 — lmhead.sample vs HF warpers + multinomial (logits "
              "std 5)", SamplingConfig(temperature=0.8, top_k=50, top_p=0.9), repeats, 5.0, True, sizes)
    for scale, what in ((5.0, "like a language model's"), (3.0, "top-p sets of thousands"),
                        (1.0, "flat: top-p sets of half the vocabulary")):
        table(rec, f"top_p_std{scale:g}", f"T=0.8, top-p=0.9 alone — lmhead (rejection draw) vs HF (full sort) + "
              f"multinomial (logits std {scale:g}, {what})", SamplingConfig(temperature=0.8, top_p=0.9), repeats,
              scale, False, sizes)
    if not args.only_top_p:
        steps_table(rec, repeats)
        mixed_table(rec, repeats)
    rec.write()


if __name__ == "__main__":
    main()
