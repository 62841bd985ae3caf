"""examples/finetune.py: lmhead's loss and the plain loss train the same way (real model, short run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.model


def test_finetune_steps_match_the_plain_loss(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text((ROOT / "docs" / "explain.md").read_text(encoding="utf-8"), encoding="utf-8")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "finetune.py"), str(text), "--model", "smollm2-135m",
         "--steps", "2", "--seq-len", "32", "--lr", "1e-4", "--json"],
        capture_output=True, text=True, timeout=1200,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.startswith("skipped"):
        pytest.skip(out.stdout.strip())
    results = json.loads(out.stdout.strip().splitlines()[-1])
    ours, plain = results["lmhead"]["losses"], results["plain"]["losses"]
    assert len(ours) == len(plain) == 2
    # Step 1 is the same computation; step 2 also checks that the gradients (hence the update) agree.
    for a, b in zip(ours, plain, strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    assert ours[1] != ours[0]  # the weights did move
