"""lm-evaluation-harness as a client: `lm_eval --model local-completions` against `lmhead serve`'s app (uvicorn
on 127.0.0.1, a free port) on SmolLM2-135M, and lm-eval's own `hf` backend on the same weights (the GGUF file
lmhead reads, dequantised by transformers' loader: the numbers lmhead's exactness is defined against), over
the small multiple-choice task in tests/data/lmeval: every item's per-choice loglikelihood equal to 1e-4 and
the accuracy identical.

lm-eval's loglikelihood requests send token-id prompts with `echo: true, logprobs: 1, max_tokens: 1` and sum the
prompt tokens' logprobs past the context; its remote tokenizer reads /tokenize, /detokenize and /tokenizer_info.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import ServerThread, real_model

from lmhead.server import create_app

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.model  # lm-eval twice over a real model: minutes, not for `make test-fast`

TASKS = Path(__file__).parent / "data" / "lmeval"
TASK = "lmhead_tiny_mc"


def _lm_eval(out: Path, model: str, model_args: str, *extra: str) -> tuple[dict, dict[int, list[float]]]:
    """Run the lm_eval CLI on the task; → (its accuracy, per doc the choices' loglikelihoods)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK,
           "--include_path", str(TASKS), "--output_path", str(out), "--log_samples", "--batch_size", "1", *extra]
    done = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()]
    lls = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in samples}
    return results["results"][TASK], lls


def test_lm_eval_local_completions_scores_equal_its_hf_backend_on_the_same_weights(tmp_path):
    model = real_model("smollm2-135m")
    with ServerThread(create_app(model)) as server:
        args = (f"model={model.name},base_url={server.url}/v1/completions,tokenizer_backend=remote,"
                f"num_concurrent=1,max_retries=1,tokenized_requests=True")
        served, served_ll = _lm_eval(tmp_path / "served", "local-completions", args)
    gguf = model.gguf_path
    hf, hf_ll = _lm_eval(tmp_path / "hf", "hf", f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32",
                         "--device", "cpu")
    assert sorted(served_ll) == sorted(hf_ll) and len(served_ll) == 16
    for doc, lls in served_ll.items():
        assert len(lls) == 4 and all(ll < 0 for ll in lls) and len(set(lls)) == 4, lls
        assert lls == pytest.approx(hf_ll[doc], abs=1e-4), doc
    assert served["acc,none"] == hf["acc,none"]
