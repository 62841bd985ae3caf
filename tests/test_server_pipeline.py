"""The page's in-browser pipeline (server/static/pipeline.js, with the steps' table steps.js) against lmhead.sampling
over the full vocabulary.

The page runs every declared step itself over all V logits, from the server's declaration
(`lmhead.sampling.steps.describe`). Its numbers are checked here for every step, the presets and a user's order,
with the prompt as the history (as the explainer runs them): the probabilities (float64 in JS, the library's float32
steps: rtol 1e-4, atol 1e-7), the tokens kept, the entropy, each step's count of tokens cut and the step that cut
each token (XTC's coin landing, as the explainer marks it). The page's files are ES modules: Node runs copies of
them in a folder marked as modules.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lmhead.sampling import SamplingConfig, entropy, probabilities, process_logits

STATIC = Path(__file__).parents[1] / "src" / "lmhead" / "server" / "static"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="needs Node.js to run the page's JavaScript outside a browser")


@pytest.fixture(scope="module")
def modules(tmp_path_factory) -> Path:
    """A folder holding copies of the page's modules that Node loads as ES modules (its package.json says so)."""
    folder = tmp_path_factory.mktemp("page")
    for f in STATIC.glob("*.js"):
        shutil.copy(f, folder / f.name)
    (folder / "package.json").write_text('{"type": "module"}')
    return folder


def _node(script: str, modules: Path, data: object, timeout: int) -> object:
    """Run `script` (an ES module that imports ./pipeline.js, reads JSON on stdin, writes JSON) beside the modules."""
    runner = modules / "runner.js"
    runner.write_text(script)
    proc = subprocess.run([NODE, str(runner)], input=json.dumps(data), capture_output=True, text=True,
                          timeout=timeout, check=True)
    return json.loads(proc.stdout)


def _logits(vocab: int, seed: int) -> torch.Tensor:
    """A peaked head and a long flat tail, like a language model's next-token logits."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(vocab, generator=g, dtype=torch.float64) * 2.0
    z[torch.randperm(vocab, generator=g)[:20]] += torch.linspace(9.0, 3.0, 20, dtype=torch.float64)
    return z.float()


# --- every declared step: pipeline.js over the whole row ------------------------------------------------------

CHAIN_RUNNER = """
import * as P from "./pipeline.js";
import { readFileSync } from "node:fs";
{
  const { decl, row, history, settings, eos } = JSON.parse(readFileSync(0, "utf8"));
  const x = Float64Array.from(row);
  const out = settings.map((st) => {
    try {
      const r = P.runChain(decl, x, st, { history }, eos);
      return { probs: Array.from(r.probs), kept: r.kept, entropy: r.entropy, steps: r.steps, cutBy: r.cutBy,
               xtc: r.xtc, missing: r.missing };
    } catch (e) { return { error: e.message }; }
  });
  process.stdout.write(JSON.stringify(out));
}
"""


def _declared_settings(top: list[int]) -> list[dict]:
    """Each step on its own at a few settings, with others, in the presets and a user's order; greedy rows."""
    return [
        dict(typical_p=0.5), dict(typical_p=0.9, temperature=0.7), dict(top_n_sigma=1.0),
        dict(top_n_sigma=0.5, temperature=1.5), dict(xtc_probability=0.5, xtc_threshold=0.05),
        dict(xtc_probability=1.0, xtc_threshold=0.02), dict(xtc_probability=0.5, xtc_threshold=0.6),
        dict(dry_multiplier=0.8), dict(dry_multiplier=2.0, dry_base=3.0, dry_allowed_length=1),
        dict(dry_multiplier=1e4, dry_base=1e4, dry_allowed_length=1),  # a penalty beyond float32: the tokens cut
        dict(dry_multiplier=0.8, dry_penalty_last_n=6), dict(dry_multiplier=0.5, dry_sequence_breakers=[top[2]]),
        dict(mirostat=1), dict(mirostat=2), dict(mirostat=2, mirostat_tau=2.0),
        dict(mirostat=1, mirostat_tau=3.0, temperature=0.8), dict(mirostat=2, top_k=3, typical_p=0.5),
        dict(dynatemp_range=0.5), dict(dynatemp_range=1.0, dynatemp_exponent=2.0, temperature=0.8),
        dict(dynatemp_range=1.0, temperature=0.5), dict(epsilon_cutoff=3e-4), dict(epsilon_cutoff=0.02),
        dict(eta_cutoff=3e-4), dict(eta_cutoff=0.05), dict(top_a=0.2), dict(top_a=0.9, temperature=1.5),
        dict(no_repeat_ngram_size=1), dict(no_repeat_ngram_size=2),
        dict(no_repeat_ngram_size=3), dict(bad_words=[[top[1], top[2]], [top[4]]]), dict(allowed_token_ids=top[:12]),
        dict(min_tokens=3), dict(min_tokens=2, stop_token_ids=[top[0]]), dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.8, presence_penalty=0.5, frequency_penalty=0.3),
        dict(logit_bias={str(top[20]): 5.0, str(top[1]): -2.0}, banned_tokens=[top[0]]),
        dict(samplers="llama.cpp", top_k=40, top_p=0.9, temperature=0.7, min_p=0.05),
        dict(samplers="transformers", typical_p=0.8, top_k=20, no_repeat_ngram_size=2),
        dict(samplers=["top_k", "temperature", "min_p"], top_k=8, temperature=2.0, min_p=0.1),
        dict(samplers="typ_p;temp;xtc", typical_p=0.7, temperature=0.5, xtc_probability=0.3, xtc_threshold=0.05),
        dict(samplers=["temperature"], top_k=3, dry_multiplier=1.0),  # a step left out of the order does not run
        dict(temperature=0.0, dry_multiplier=1.0), dict(temperature=0.0, typical_p=0.5, banned_tokens=[top[0]]),
        dict(top_k=5, typical_p=0.5, top_n_sigma=1.0, epsilon_cutoff=1e-3, temperature=1.4),
        dict(temperature=0.7, top_k=12, top_p=0.8, min_p=0.05, repetition_penalty=1.2),
        dict(allowed_token_ids=top[:50], mirostat=1),  # fewer tokens than mirostat's m: its fit keeps them all
        dict(top_p=0.95, temperature=2.0), dict(top_p=0.999),  # top-p sets wider than a first window
    ]


def _config(st: dict, eos: list[int]):
    from lmhead.sampling.steps.masks import withhold_stops

    kw = dict(st)
    for name in ("banned_tokens", "allowed_token_ids", "stop_token_ids", "dry_sequence_breakers"):
        if name in kw:
            kw[name] = tuple(kw[name])
    if "bad_words" in kw:
        kw["bad_words"] = tuple(tuple(w) for w in kw["bad_words"])
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
    return withhold_stops(SamplingConfig(**kw), eos)


def _cuts(z: torch.Tensor, cfg, history: list[int]) -> tuple[list[tuple[str, int]], list[str | None]]:
    """Each step's count of tokens cut and the first step that cut each token (the explainer's cut_by: the
    declared steps one by one, XTC's coin landing; "bias" for logit_bias; "greedy" for the argmax's rivals)."""
    from lmhead.sampling.steps import Context

    ctx = Context(history=history, prompt_len=len(history), xtc=True)
    x = z[None].float()
    counts, cut_by = [], [None] * z.numel()
    before = torch.isfinite(x[0])
    for s in cfg.steps():
        x = s.apply(x, cfg, ctx)
        now = torch.isfinite(x[0])
        gone = (before & ~now).nonzero().flatten().tolist()
        counts.append((s.name, len(gone)))
        for t in gone:
            cut_by[t] = "bias" if s.name == "logit_bias" else s.name
        before = now
    if cfg.is_greedy:
        top = int(x[0].argmax())
        cut_by = [c if c is not None or t == top else "greedy" for t, c in enumerate(cut_by)]
    return counts, cut_by


@pytest.mark.parametrize("vocab", [5000, 300])
def test_the_pages_declared_steps_equal_the_librarys_over_the_whole_row(vocab, modules):
    from lmhead.sampling.steps import describe

    z = _logits(vocab, seed=vocab + 1)
    top = torch.topk(z, 60).indices.tolist()
    # a prompt that repeats itself: DRY, the n-grams and bad words find something to cut
    history = [top[i] for i in (0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 0, 1, 2, 3, 9, 0, 1)]
    eos = [top[3]]
    settings = _declared_settings(top)
    if vocab == 300:  # ties: the top-k / top-p groups and XTC's least probable top choice (the highest id stays)
        z[top[2:5]] = float(z[top[2]])
        p = torch.softmax(z.double(), 0)
        threshold = float(p[top[2]] + p[top[5]]) / 2
        settings += [dict(xtc_probability=0.5, xtc_threshold=threshold), dict(top_k=3),
                     dict(top_p=float(p[top[:3]].sum())),
                     dict(top_p=0.99, xtc_probability=1.0, xtc_threshold=threshold, typical_p=0.95)]
    results = _node(CHAIN_RUNNER, modules, {"decl": describe(), "row": z.double().tolist(), "history": history,
                                            "settings": settings, "eos": eos}, timeout=300)
    prev = torch.tensor([history])
    for st, res in zip(settings, results, strict=True):
        assert "error" not in res and not res["missing"], (st, res.get("error"), res.get("missing"))
        cfg = _config(st, eos)
        want = probabilities(z[None], cfg, prev_tokens=prev, prompt_len=len(history))[0].double()
        processed = process_logits(z[None], cfg, prev_tokens=prev, prompt_len=len(history))
        torch.testing.assert_close(torch.tensor(res["probs"], dtype=torch.float64), want, rtol=1e-4, atol=1e-7,
                                   msg=lambda m, st=st: f"{st}: {m}")
        assert res["kept"] == int(torch.isfinite(processed).sum()), st
        assert res["entropy"] == pytest.approx(float(entropy(processed)), rel=1e-4, abs=1e-6), st
        counts, cut_by = _cuts(z, cfg, history)
        assert [(s["name"], s["cut"]) for s in res["steps"]] == counts, st
        kept = torch.isfinite(processed[0]).tolist()
        assert [c if not k else None for c, k in zip(res["cutBy"], kept, strict=True)] == \
               [c if not k else None for c, k in zip(cut_by, kept, strict=True)], st


def test_the_pages_order_is_the_librarys(modules):
    """Presets, a user's names (llama.cpp's and transformers' spellings), and the errors the library gives."""
    from lmhead.sampling.steps import describe

    script = """
import * as P from "./pipeline.js";
import { readFileSync } from "node:fs";
const decl = JSON.parse(readFileSync(0, "utf8"));
const ask = [null, "lmhead", "llama.cpp", "transformers", "typ_p;temp;top-k", ["Top-P", "min-p", "nucleus"],
             "dynatemp;xtc", ["beam"], ["top_k", "k"]];
const order = (a) => { try { return P.orderOf(decl, a); } catch (e) { return "error"; } };
process.stdout.write(JSON.stringify(ask.map(order)));
"""
    got = _node(script, modules, describe(), timeout=60)
    asked = [None, "lmhead", "llama.cpp", "transformers", "typ_p;temp;top-k", ["Top-P", "min-p", "nucleus"],
             "dynatemp;xtc", ["beam"], ["top_k", "k"]]
    for a, g in zip(asked, got, strict=True):
        try:
            want = SamplingConfig(samplers=a).samplers
        except ValueError:
            want = "error"
        assert g == (list(want) if isinstance(want, tuple) else want), a


def test_the_pages_step_table_names_declared_steps_and_their_parameters(modules):
    """steps.js holds one entry per declared step it previews, by the declared name; a parameter it shows first is
    one its step declares. (A step with no entry is allowed: the page shows the server's numbers for it.)"""
    from lmhead.sampling.steps import describe

    script = """
import { STEPS } from "./steps.js";
process.stdout.write(JSON.stringify(Object.fromEntries(Object.entries(STEPS).map(
  ([name, s]) => [name, { controls: Object.keys(s.controls || {}), boundary: !!s.boundary }]))));
"""
    table = _node(script, modules, None, timeout=60)
    declared = {s["name"]: s for s in describe()["steps"]}
    assert set(table) <= set(declared)
    for name, entry in table.items():
        assert set(entry["controls"]) <= set(declared[name]["params"]), name
    shown = [p for entry in table.values() for p in entry["controls"]]
    assert shown == ["temperature", "top_k", "top_p", "min_p"] and len(set(shown)) == len(shown)
