"""A compressed LM head whose greedy token and top-k are provably those of the full-precision head.

At decode time the head is a matrix-vector product that reads the whole weight `W [V,D]` for one hidden
vector (for Gemma 3 270M, 671 MB of fp32 per generated token). `CompressedHead` keeps a compressed copy of
`W` (int8 with one scale per row, or 4-bit groups with a scale and an offset per group) next to the
full-precision weight it shares, and per row of hidden states, in this order:

1. approximate logits `ŷ = kernel(x̂)` [N,V] (+ bias, in fp32), x̂ the activation as the kernel sees it
   (`kernels.py`: oneDNN's int8 inner product with uint8 activations and column scales chosen on calibration
   hidden states, or torch's int8pack / int4pack kernels with bf16 activations);
2. a rigorous per-logit error bound `|ŷ_i − y_i| ≤ b_i`, where `y_i` is what the fp32 head computes
   (`bound.py`, with the derivation): the weight error (exact row norms of `w_i − ŵ_i`, measured at
   compression time by `quantize.py`) times the activation, the activation's rounding, the fp32 accumulation
   of both the kernel and the fp32 reference, and the rounding of the kernel's output;
3. candidates: every token whose upper bound `ŷ_i + b_i` reaches the k-th largest lower bound `ŷ_j − b_j`.
   Every other token is provably below at least k tokens, so the true top-k are among the candidates;
4. re-score the candidates with the full-precision rows (`F.linear(h, W[candidates])`) and write them in;
5. near-tie guard: the fp32 head's BLAS call may sum in another order (values differ by ~1e-6), so if the
   top two re-scored values are closer than the worst-case rounding of both evaluations, the full fp32 head
   serves the call (`stats["tie_fallback_rows"]`);
6. softcap (monotone, so the order is kept) last.

The returned logits therefore hold the fp32 values (to fp32 rounding) of every candidate, and every
non-candidate's approximate value lies strictly below the k-th of them: `argmax` is the fp32 head's in
every case, and `topk(≤ k)` and any cut that keeps the top tokens (top-k sampling with k ≤ exact_k) give
the fp32 head's tokens unless two of them are closer than fp32 rounding (`topk_exact(strict=True)` rules
that out too). If a row has more than `max_rescore` candidates, or the call more than `max_rows` rows, the
full fp32 head serves it (`stats["fallback_rows"]`, `stats["full_rows"]`). Penalties and negative logit
biases only lower logits, so greedy decoding with them stays exact unless all exact_k top tokens are pushed
below the approximate tail; a positive logit_bias on a tail token sees its approximate value. Probabilities
are within `probability_error_bound` of the fp32 head's. This head is for inference: `forward` computes no
gradients through the compressed path (`loss` uses the full weight).

Layout:
    kernels.py    the CPU matrix kernels (int8pack, int4pack, oneDNN int8) and oneDNN's self-test
    quantize.py   column scales, int8 / int4 quantisation, the row norms of the error, the cached-state format
    bound.py      the error bound, candidates, near-tie gap and probability bound: pure functions
    head.py       `CompressedHead` (the nn.Module: the six steps above, statistics) and `HEAD_MODES`

Why a package apart from `head.py`: `LMHead` is the plain projection that is the ground truth; this head has
a different storage and its own exactness machinery, and mixing the two would make the reference harder to
read and to trust. Choosing a head for a loaded model ("auto"), calibration and the disk cache of the
compressed tensors are `lmhead.models.heads`' job; this package knows nothing of models.
"""

from lmhead.compressed.head import HEAD_MODES, CompressedHead
from lmhead.compressed.kernels import onednn_int8_usable
from lmhead.compressed.quantize import SMOOTHING_ALPHA, column_scales

__all__ = ["HEAD_MODES", "SMOOTHING_ALPHA", "CompressedHead", "column_scales", "onednn_int8_usable"]
