"""The page's in-browser pipeline (server/static/app.js) against lmhead.sampling over the full vocabulary.

The page gets the top-N candidates' logits and the log-sum-exp of all V logits, and reruns temperature → top-k →
top-p → min-p → softmax in JavaScript when a slider moves. It claims "exact" whenever the kept set lies inside the
candidates (or the normaliser is known), and shows bounds otherwise. These tests run app.js's functions in Node on
logits with a long tail and check both claims against `lmhead.sampling.probabilities` / `entropy` computed on all
V logits: exact numbers equal the truth, and bounds contain it.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lmhead.sampling import SamplingConfig, entropy, probabilities, process_logits

APP_JS = Path(__file__).parents[1] / "src" / "lmhead" / "server" / "static" / "app.js"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="needs Node.js to run the page's JavaScript outside a browser")

RUNNER = """
const { compute } = require(process.argv[1]);
let input = "";
process.stdin.on("data", (c) => (input += c));
process.stdin.on("end", () => {
  const { data, settings } = JSON.parse(input);
  const out = settings.map((st) => {
    const c = compute(data, st);
    return { probs: Array.from(c.probs), cut: c.cut, exactProbs: c.exactProbs, entropy: c.entropy,
             keptCount: c.keptCount, keptCountExact: c.keptCountExact, keptMass: c.keptMass };
  });
  process.stdout.write(JSON.stringify(out));
});
"""

SETTINGS = [dict(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in itertools.product(
    (0.0, 0.3, 0.7, 1.0, 1.5, 2.0), (0, 1, 5, 50), (1.0, 0.5, 0.9, 0.99), (0.0, 0.05, 0.2))]


def _logits(vocab: int, seed: int) -> torch.Tensor:
    """A peaked head and a long flat tail, like a language model's next-token logits."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(vocab, generator=g, dtype=torch.float64) * 2.0
    z[torch.randperm(vocab, generator=g)[:20]] += torch.linspace(9.0, 3.0, 20, dtype=torch.float64)
    return z.float()


def _page_data(z: torch.Tensor, n: int, scaled_t: float | None = None) -> dict:
    """What the page holds after /api/predict: candidates by logit, lse, and the scaled lse at the asked T."""
    vals, _ = torch.sort(z.double(), descending=True)
    lse = float(torch.logsumexp(z.double(), 0))
    return {"z": vals[:n].tolist(), "V": z.numel(), "lse": lse,
            "rawP": (vals[:n] - lse).exp().tolist(),
            "scaledT": scaled_t, "scaledLse": float(torch.logsumexp(z.double() / scaled_t, 0)) if scaled_t else None}


def _run_page(data: dict, settings: list[dict]) -> list[dict]:
    proc = subprocess.run([NODE, "-e", RUNNER, str(APP_JS)], input=json.dumps({"data": data, "settings": settings}),
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(proc.stdout)


def _truth(z: torch.Tensor, st: dict) -> tuple[torch.Tensor, float, int]:
    cfg = SamplingConfig(**st)
    probs = probabilities(z[None].double().float(), cfg)[0].double()
    order = torch.argsort(z, descending=True, stable=True)
    processed = process_logits(z[None], cfg)[0]
    return probs[order], float(entropy(processed)), int(torch.isfinite(processed).sum())


@pytest.mark.parametrize("vocab,n", [(5000, 200), (300, 300)])
def test_page_pipeline_is_exact_where_it_says_so_and_bounds_the_truth_elsewhere(vocab, n):
    z = _logits(vocab, seed=vocab)
    results = _run_page(_page_data(z, n), SETTINGS)
    exact_seen = bounded_seen = 0
    for st, res in zip(SETTINGS, results, strict=True):
        truth, h_true, kept_true = _truth(z, st)
        lo, hi = res["entropy"]["lo"], res["entropy"]["hi"]
        assert lo - 1e-4 <= h_true <= hi + 1e-4, (st, lo, h_true, hi)
        if res["exactProbs"]:
            exact_seen += 1
            torch.testing.assert_close(torch.tensor(res["probs"], dtype=torch.float64), truth[:n],
                                       rtol=1e-4, atol=1e-6, msg=lambda m, st=st: f"{st}: {m}")
            kept_page = [c is None for c in res["cut"]]
            assert kept_page == (truth[:n] > 0).tolist(), st
        else:
            bounded_seen += 1
            assert n < vocab, "with the whole vocabulary sent, every number must be exact"
        if st["temperature"] > 0:  # the kept tokens' share of the temperature-scaled distribution
            kept = probabilities(z[None], SamplingConfig(**st))[0] > 0
            mass = float(torch.softmax(z.double() / st["temperature"], 0)[kept].sum())
            m_lo, m_hi = res["keptMass"]
            assert m_lo - 1e-6 <= mass <= m_hi + 1e-6, (st, m_lo, mass, m_hi)
        if res["keptCountExact"] and res["exactProbs"]:
            assert res["keptCount"] == kept_true, st
        if vocab == n:
            assert abs(hi - lo) < 1e-9, st
    assert exact_seen > len(SETTINGS) // 2
    if n < vocab:
        assert bounded_seen > 0  # e.g. T=2 with no cut: the flattened tail is not known without the server


def test_page_is_exact_at_the_temperature_the_server_computed():
    """With the server's scaled log-sum-exp for this T, probabilities with no cut are exact too."""
    z = _logits(5000, seed=7)
    for t in (0.5, 1.5):
        st = dict(temperature=t, top_k=0, top_p=1.0, min_p=0.0)
        res = _run_page(_page_data(z, 200, scaled_t=t), [st])[0]
        truth, h_true, _ = _truth(z, st)
        assert res["exactProbs"]
        torch.testing.assert_close(torch.tensor(res["probs"], dtype=torch.float64), truth[:200], rtol=1e-4, atol=1e-7)
        assert res["entropy"]["lo"] - 1e-4 <= h_true <= res["entropy"]["hi"] + 1e-4
