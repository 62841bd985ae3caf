"""The GGUF codes path: the C kernel against the dequantised matrix, codes found from a weight (and refused
when they cannot give it back), the lean body and the head reading codes equal to their float32 products, and
falling back once the weights change."""

from __future__ import annotations

import pytest
import torch
from reference import coded_weight
from tiny import tiny_model

from lmhead.models.coded_linear import CodedLinear, coded_available
from lmhead.models.gguf_codes import Codes, fuse_codes, module_codes
from lmhead.models.quant_types import LEVELS

pytestmark = pytest.mark.skipif(not coded_available(), reason="no C compiler: the coded kernel is not built")


def _codes(n: int, k: int, group: int, offset: bool, seed: int = 0, low: int = -32, high: int = 32) -> Codes:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(low, high, (n, k), generator=g, dtype=torch.int8)
    # scales as GGUF makes them: a half-precision number times a small integer (exact in float32)
    scale = (torch.rand(n, k // group, generator=g) * 0.02).half().float() * torch.randint(1, 64, (n, k // group),
                                                                                          generator=g).float()
    off = -(torch.rand(n, k // group, generator=g) * 0.1).half().float() if offset else None
    return Codes(codes, scale, off, "test")


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17])  # every pass width: 1-3, 4-8, 8 + the rest
@pytest.mark.parametrize("n", [67, 68])  # 68: groups of 32 stored in blocks of four rows (their own loops)
def test_kernel_equals_the_dequantised_product(group, offset, rows, n):
    c = _codes(n, 4 * group + 2 * group, group, offset, seed=rows)
    x = torch.randn(rows, c.codes.shape[1], generator=torch.Generator().manual_seed(1))
    lin = CodedLinear(c.codes, c.scale, c.offset)
    assert lin.rows4 == (n == 68)  # groups of 16 too (Q6_K, Q3_K; Q2_K with offsets)
    got = lin(x)
    w = coded_weight(c.codes, c.scale, c.offset)
    want = x.double() @ w.T
    # float32 summation error: a small multiple of eps32 times the sum of |terms| of each output
    bound = 2e-6 * (x.double().abs() @ w.abs().T) + 1e-7
    assert bool(((got.double() - want).abs() <= bound).all()), float(((got.double() - want).abs() / bound).max())


def test_batched_shapes_and_empty_rows():
    c = _codes(40, 64, 32, True)
    lin = CodedLinear(c.codes, c.scale, c.offset)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(3))
    w = coded_weight(c.codes, c.scale, c.offset).double()
    got = lin(x)
    assert got.shape == (2, 3, 40)
    # float32 summation error, bounded by the sum of |terms| (weights up to ~40: an absolute 1e-5 was luck)
    bound = 2e-6 * (x.double().abs() @ w.abs().T) + 1e-7
    assert bool(((got.double() - x.double() @ w.T).abs() <= bound).all())
    assert lin(torch.randn(0, 64)).shape == (0, 40)


def test_a_product_whose_buffers_cannot_be_had_says_so_apart_from_arguments_it_refuses():
    # the kernels' results: -1 for arguments refused (a caller's bug), NO_MEMORY where a buffer could not be had
    # (MemoryError in Python) — the C step's callers raise one or the other, not a MemoryError for both
    from lmhead.kernels import native
    from lmhead.kernels.abi import NO_MEMORY

    lib = native.library()
    c = _codes(4, 64, 32, True, low=0, high=16)
    pack = CodedLinear(c.codes, c.scale, c.offset, four_bit="unsigned")
    x, y = torch.randn(1, 64), torch.empty(1, 4)
    args = (pack.codes.data_ptr(), pack.scale.data_ptr(), pack.offset.data_ptr(), 4, 32)
    # the query's group sums of 2^50 rows: a buffer no machine has (read before any row is)
    assert lib.lmhead_coded_matmul(x.data_ptr(), 2**50, 64, *args, pack.flags, y.data_ptr(), 1) == NO_MEMORY
    assert lib.lmhead_coded_matmul(x.data_ptr(), 1, 64, *args, pack.flags | native.F16, y.data_ptr(), 1) == -1


def test_bad_codes_are_clear_errors():
    with pytest.raises(TypeError, match="codes must be a 2-D int8 tensor"):
        CodedLinear(torch.zeros(4, 32), torch.ones(4, 1))
    with pytest.raises(ValueError, match="group size must be a multiple of 16"):
        CodedLinear(torch.zeros(4, 24, dtype=torch.int8), torch.ones(4, 3))
    with pytest.raises(ValueError, match="offset must have scale's shape"):
        CodedLinear(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1), torch.ones(4, 2))


def test_a_weight_changed_in_place_falls_back_to_its_own_numbers():
    c = _codes(8, 32, 32, False)
    weight = c.dequantize().clone()
    lin = CodedLinear(c.codes, c.scale, None, weight)
    x = torch.randn(1, 32)
    assert lin.current()
    with torch.no_grad():
        weight.mul_(2.0)  # an optimizer step in place
    assert not lin.current()
    torch.testing.assert_close(lin(x), x @ weight.T)


def test_module_codes_refuse_codes_that_do_not_give_the_weight_back():
    c = _codes(8, 64, 32, True)
    weight = c.dequantize()
    assert module_codes({"w": c}, "w", weight) is c
    other = weight.clone()
    other[3, 5] += 1e-3
    assert module_codes({"w": c}, "w", other) is None
    assert module_codes({"w": c}, "w", weight[:, :32]) is None
    assert module_codes({}, "w", weight) is None


def test_codes_are_found_from_the_weight_and_the_gguf_scales():
    from lmhead.models.gguf_codes import codes_from_weight

    c = _codes(6, 64, 32, True, low=0, high=16)
    weight = c.dequantize()
    found = codes_from_weight(weight, c.scale, c.offset, "Q4_1")
    assert found is not None and torch.equal(found.codes, c.codes)
    # a scale that is not the weight's: no codes (never an approximation)
    assert codes_from_weight(weight, c.scale * 1.5, c.offset, "Q4_1") is None


def test_fused_codes_of_different_groups_and_offsets_give_the_stacked_matrix():
    parts = [_codes(4, 64, 32, False, seed=1), _codes(3, 64, 16, True, seed=2), _codes(5, 64, 32, True, seed=3)]
    fused = fuse_codes(parts)
    assert fused.group == 16
    torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0)


def _coded_tiny(arch: str):
    """A tiny model whose linear weights are replaced by GGUF-like numbers (scale per 16 weights × int8 code),
    and their codes under the keys `gguf_codes` uses."""
    hf_model, tokenizer = tiny_model(arch, layers=2)
    codes = {}
    names = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    with torch.no_grad():
        for i, block in enumerate(hf_model.base_model.layers):
            for name, parent in names.items():
                lin = getattr(getattr(block, parent), name)
                w = lin.weight
                scale = (w.view(w.shape[0], -1, 16).abs().amax(-1) / 127).half().float().clamp_min(1e-4)
                q = torch.round(w.view(w.shape[0], -1, 16) / scale[..., None]).clamp(-127, 127)
                lin.weight.copy_((q * scale[..., None]).view_as(w))
                codes[f"layers.{i}.{parent}.{name}"] = Codes(q.to(torch.int8).view_as(w), scale, None, "test")
        emb = hf_model.get_input_embeddings().weight
        scale = (emb.view(emb.shape[0], -1, 16).abs().amax(-1) / 127).half().float().clamp_min(1e-4)
        q = torch.round(emb.view(emb.shape[0], -1, 16) / scale[..., None]).clamp(-127, 127)
        emb.copy_((q * scale[..., None]).view_as(emb))
        codes["embed_tokens"] = Codes(q.to(torch.int8).view_as(emb), scale, None, "test")
    return hf_model, tokenizer, codes


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_lean_body_reading_codes_equals_transformers(arch):
    from lmhead.models.lean import LeanBody

    hf_model, _, codes = _coded_tiny(arch)
    lean = LeanBody(hf_model)
    assert lean.use_codes(codes) == 7 * 2
    ids = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_model.base_model(input_ids=ids).last_hidden_state
    cache = lean.new_cache(2, 20)
    got = [lean(ids[:, :6], torch.arange(6).expand(2, -1), cache)]
    for t in range(6, 12):
        got.append(lean(ids[:, t:t + 1], torch.full((2, 1), t), cache))
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-5, rtol=0)
    assert lean.nbytes > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decode_call_in_c_equals_the_general_path(arch, monkeypatch):
    """`LeanBody._decode_native` (the cache's bookkeeping, embedding, rope rows and masks in C) against the
    general path (torch ops, then `lmhead_step`): the same hidden states and cache, bit for bit, through a
    left-padded prefill, one-token steps, three-token verifications, columns a rejected draft leaves invalid,
    and past Gemma's sliding window (8 in the tiny config)."""
    from lmhead.models.lean import LeanBody

    hf_model, _, codes = _coded_tiny(arch)
    lean = LeanBody(hf_model)
    lean.use_codes(codes)
    general = LeanBody._decode_native
    used = []

    def run(fast: bool):
        def decode(self, *args):
            out = general(self, *args) if fast else None
            used.append(out is not None)
            return out

        monkeypatch.setattr(LeanBody, "_decode_native", decode)
        g = torch.Generator().manual_seed(0)
        cache = lean.new_cache(2, 40)
        ids = torch.randint(4, 300, (2, 6), generator=g)
        valid = torch.ones(2, 6, dtype=torch.bool)
        valid[1, :2] = False
        positions = (valid.cumsum(1) - 1).clamp(min=0)
        out = [lean(ids, positions, cache, valid)]
        nxt = positions[:, -1] + 1
        for step in range(12):
            t = 3 if step % 3 == 0 else 1
            out.append(lean(torch.randint(4, 300, (2, t), generator=g), nxt[:, None] + torch.arange(t), cache))
            nxt = nxt + t
            if step == 4:
                cache.invalidate(0, cache.length - 2)
        return out, cache

    with torch.no_grad():
        lean(torch.tensor([[5]]), torch.tensor([[0]]), lean.new_cache(1, 4))  # makes the rope tables
        want, want_cache = run(False)
        used.clear()
        got, got_cache = run(True)
    assert all(used) and len(used) == 13
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for name in ("keys", "values", "valid", "positions", "tokens"):
        assert torch.equal(getattr(got_cache, name), getattr(want_cache, name)), name
    assert got_cache.length == want_cache.length


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rows_of_a_larger_cache_decode_as_a_cache_of_their_own(arch):
    """The C step over `StaticCache.view`'s rows (rows 1 and 2 of 4: each layer's block `layer_stride` numbers from
    the next, not two rows' worth) gives a two-row cache's hidden states and columns, bit for bit, past Gemma's
    sliding window (8), and leaves the rows around them as they were."""
    from lmhead.models.lean import LeanBody

    hf_model, _, codes = _coded_tiny(arch)
    lean = LeanBody(hf_model)
    lean.use_codes(codes)

    def run(cache):
        g = torch.Generator().manual_seed(0)
        out = [lean(torch.randint(4, 300, (2, 6), generator=g), torch.arange(6).expand(2, -1), cache)]
        for t in range(6, 14):
            out.append(lean(torch.randint(4, 300, (2, 1), generator=g), torch.full((2, 1), t), cache))
        return out

    with torch.no_grad():
        lean(torch.tensor([[5]]), torch.tensor([[0]]), lean.new_cache(1, 4))  # makes the rope tables
        alone = lean.new_cache(2, 20)
        want = run(alone)
        big = lean.new_cache(4, 20)
        view = big.view(1, 3)
        assert view.layer_stride == 2 * alone.layer_stride and lean._checked_descs(view, 1) is not None
        got = run(view)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for name in ("keys", "values"):
        assert torch.equal(getattr(view, name), getattr(alone, name)), name
        assert not bool(getattr(big, name)[:, [0, 3]].any())
    for name in ("valid", "positions", "tokens"):
        assert torch.equal(getattr(view, name), getattr(alone, name)), name
        assert not bool(getattr(big, name)[[0, 3]].any())


def test_decode_calls_from_two_threads_at_once_equal_each_alone():
    """The C decode call reuses its buffers per thread: two generations on one model at once (ctypes lets go of
    the GIL during the call) give each its own hidden states."""
    import threading

    from lmhead.models.lean import LeanBody

    hf_model, _, codes = _coded_tiny("gemma3")
    lean = LeanBody(hf_model)
    lean.use_codes(codes)

    def decode(seed: int, out: list) -> None:
        g = torch.Generator().manual_seed(seed)
        cache = lean.new_cache(1, 40)
        with torch.no_grad():
            for t in range(30):
                out.append(lean(torch.randint(4, 300, (1, 1), generator=g), torch.tensor([[t]]), cache))

    alone = {seed: [] for seed in (1, 2)}
    for seed, out in alone.items():
        decode(seed, out)
    together = {seed: [] for seed in (1, 2)}
    threads = [threading.Thread(target=decode, args=(seed, out)) for seed, out in together.items()]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for seed in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(together[seed], alone[seed], strict=True))


def test_decode_call_in_c_declines_what_the_general_path_rejects():
    from lmhead.models.lean import LeanBody

    hf_model, _, codes = _coded_tiny("llama")
    lean = LeanBody(hf_model)
    lean.use_codes(codes)
    cache = lean.new_cache(1, 8)
    with torch.no_grad():
        lean(torch.tensor([[5, 6]]), torch.tensor([[0, 1]]), cache)
        vocab = lean.embed.shape[0]
        assert lean._decode_native(torch.tensor([[vocab]]), torch.tensor([[2]]), cache, None) is None
        assert lean._decode_native(torch.tensor([[7]]), torch.tensor([[10**6]]), cache, None) is None  # no rope row
        assert cache.length == 2 and not bool(cache.valid[0, 2])  # nothing written
        with pytest.raises(IndexError):
            lean(torch.tensor([[vocab]]), torch.tensor([[2]]), cache)


def test_head_product_is_used_for_decode_calls_only_and_equals_the_weight():
    from lmhead.head import LMHead

    hf_model, _, codes = _coded_tiny("llama")
    weight = hf_model.get_input_embeddings().weight
    head = LMHead.from_weight(weight)
    c = codes["embed_tokens"]
    calls = []

    class Counting(CodedLinear):
        def __call__(self, x):
            calls.append(x.shape)
            return super().__call__(x)

    head.product = Counting(c.codes, c.scale, None, weight)
    hidden = torch.randn(1, 3, weight.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(head(hidden), hidden @ weight.T, rtol=1e-5, atol=1e-5)
        assert len(calls) == 1
        head(torch.randn(1, head.PRODUCT_MAX_ROWS + 1, weight.shape[1]))  # a long call (evaluation): the plain product
        assert len(calls) == 1
    loss_input = torch.randn(1, 2, weight.shape[1], requires_grad=True)
    head(loss_input).sum().backward()  # autograd: the plain product, gradients flow
    assert len(calls) == 1 and loss_input.grad is not None


@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("n", [45, 48])
def test_unsigned_4bit_codes_are_packed_two_per_byte_and_give_the_same_product(rows, n):
    c = _codes(n, 128, 32, True, seed=rows, low=0, high=16)
    lin = CodedLinear(c.codes, c.scale, c.offset)
    assert lin.packed and lin.codes.numel() == c.codes.numel() // 2
    assert torch.equal(lin.dequantize(), c.dequantize())
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2))
    w = coded_weight(c.codes, c.scale, c.offset)
    bound = 2e-6 * (x.double().abs() @ w.abs().T) + 1e-7
    assert bool(((lin(x).double() - x.double() @ w.T).abs() <= bound).all())
    wide = _codes(4, 64, 32, False, low=-9, high=8)
    assert not CodedLinear(wide.codes, wide.scale).packed  # past 4 bits: one per byte


@pytest.mark.parametrize("rows", [1, 2, 5, 9])  # decode, the several-row passes, 8 + the rest
@pytest.mark.parametrize("n, k", [(45, 128), (48, 128), (48, 192)])  # plain rows; blocks of four (192: an odd unit)
def test_signed_4bit_codes_without_offsets_are_packed_two_per_byte_and_give_the_same_product(rows, n, k):
    c = _codes(n, k, 32, False, seed=rows, low=-8, high=8)
    scale = torch.where(torch.arange(n)[:, None] % 2 == 0, -c.scale, c.scale)  # negative d: code 0 is −0
    lin = CodedLinear(c.codes, scale)
    assert lin.four_bit == "signed" and lin.codes.numel() == c.codes.numel() // 2
    want = Codes(c.codes, scale, None, "test").dequantize()
    assert torch.equal(lin.dequantize().view(torch.int32), want.view(torch.int32))  # −0 stays −0
    assert torch.equal(lin.rows(torch.arange(n)).view(torch.int32), want.view(torch.int32))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2))
    w = coded_weight(c.codes, scale)
    bound = 2e-6 * (x.double().abs() @ w.abs().T) + 1e-7
    assert bool(((lin(x).double() - x.double() @ w.T).abs() <= bound).all())


@pytest.mark.parametrize("rows", [1, 2, 5, 9])
@pytest.mark.parametrize("n, k", [(45, 128), (48, 128), (48, 192)])
@pytest.mark.parametrize("low, high, offset", [(-4, 3, False), (0, 3, True), (-8, 7, True)])  # Q3_K, Q2_K, any
def test_signed_4bit_codes_in_groups_of_16_are_packed_two_per_byte_and_give_the_same_product(rows, n, k, low,
                                                                                             high, offset):
    c = _codes(n, k, 16, offset, seed=rows, low=low, high=high + 1)
    lin = CodedLinear(c.codes, c.scale, c.offset)
    assert lin.four_bit == "signed" and lin.group == 16 and lin.codes.numel() == c.codes.numel() // 2
    assert lin.rows4 == (n % 4 == 0)
    want = c.dequantize()
    assert torch.equal(lin.dequantize(), want)
    assert torch.equal(lin.rows(torch.arange(n)), want)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2))
    w = coded_weight(c.codes, c.scale, c.offset)
    bound = 2e-6 * (x.double().abs() @ w.abs().T) + 1e-7
    assert bool(((lin(x).double() - x.double() @ w.T).abs() <= bound).all())


@pytest.mark.parametrize("rows", [1, 2, 5, 9])
@pytest.mark.parametrize("n, k", [(45, 128), (48, 128), (48, 192)])
@pytest.mark.parametrize("table", sorted(LEVELS))
def test_level_tables_are_packed_as_their_indices_and_give_the_same_product(rows, n, k, table):
    g = torch.Generator().manual_seed(rows)
    codes = torch.from_numpy(LEVELS[table])[torch.randint(0, 16, (n, k), generator=g)]
    scale = _codes(n, k, 32, False, seed=rows).scale * torch.where(torch.arange(n)[:, None] % 2 == 0, -1.0, 1.0)
    lin = CodedLinear(codes, scale, four_bit=table)
    assert lin.four_bit == table and lin.codes.numel() == codes.numel() // 2
    assert CodedLinear(codes, scale).four_bit is None  # "auto" reads ranges only: levels stay one byte per code
    want = Codes(codes, scale, None, table).dequantize()
    assert torch.equal(lin.dequantize().view(torch.int32), want.view(torch.int32))
    assert torch.equal(lin.rows(torch.arange(n)).view(torch.int32), want.view(torch.int32))
    x = torch.randn(rows, k, generator=g)
    w = coded_weight(codes, scale)
    bound = 2e-6 * (x.double().abs() @ w.abs().T) + 1e-7
    assert bool(((lin(x).double() - x.double() @ w.T).abs() <= bound).all())
    with pytest.raises(ValueError, match="not its levels"):
        CodedLinear(codes.clone().fill_(5), scale, four_bit=table)  # 5 is a level of no table
    with pytest.raises(ValueError, match="four_bit must be"):
        CodedLinear(codes, scale, four_bit="nibbles")


@pytest.mark.parametrize("four_bit, low, high", [("unsigned", -1, 15), ("signed", -8, 8)])
def test_codes_outside_a_chosen_4bit_layout_are_refused_not_packed_into_other_numbers(four_bit, low, high):
    c = _codes(4, 64, 32, False, low=low, high=high + 1)
    with pytest.raises(ValueError, match=f"four_bit='{four_bit}': codes must be in"):
        CodedLinear(c.codes, c.scale, four_bit=four_bit)
    with pytest.raises(ValueError, match="codes must be in"):
        CodedLinear.from_chunks(4, 64, c.scale, None, [(0, c.codes)], four_bit)


@pytest.mark.parametrize("rows", [1, 4, 9])
@pytest.mark.parametrize("low, high", [(0, 16), (-16, 16)])
@pytest.mark.parametrize("n", [37, 40])
def test_float16_scales_are_kept_as_float16_and_give_the_same_product(rows, low, high, n):
    c = _codes(n, 192, 32, True, seed=rows, low=low, high=high)
    c = Codes(c.codes, c.scale.half().float(), c.offset, c.kind)  # Q4_1/Q5_0/Q8_0: d and m are float16 numbers
    lin = CodedLinear(c.codes, c.scale, c.offset)
    assert lin.half and lin.scale.dtype == torch.float16 and lin.packed == (low == 0)
    assert torch.equal(lin.dequantize(), c.dequantize())
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(3))
    w = coded_weight(c.codes, c.scale, c.offset)
    bound = 2e-6 * (x.double().abs() @ w.abs().T) + 1e-7
    assert bool(((lin(x).double() - x.double() @ w.T).abs() <= bound).all())
    k_quant = _codes(5, 64, 32, True, seed=1)  # a float16 d times a 6-bit sub-scale: not a float16 number
    assert not CodedLinear(k_quant.codes, k_quant.scale, k_quant.offset).half


@pytest.mark.parametrize("act", [0, 1])  # 0: Gemma's tanh-approximated GELU, 1: Llama's SiLU
def test_native_gated_activation_equals_torch_over_a_wide_range(act):
    from lmhead.kernels import native

    fn = (lambda t: torch.nn.functional.gelu(t, approximate="tanh")) if act == 0 else torch.nn.functional.silu
    g = torch.Generator().manual_seed(4)
    f = 1003  # the vectorised loop and its scalar tail
    gate = torch.cat([torch.linspace(-120, 120, f - 3), torch.tensor([0.0, 1e-30, -1e-30])])
    gu = torch.cat([gate, torch.randn(f, generator=g)])[None]
    out = torch.empty(1, f)
    native.library().lmhead_gated(gu.data_ptr(), out.data_ptr(), 1, f, act)
    want = fn(gate.double()) * gu[0, f:].double()
    assert bool(out.isfinite().all())
    # float32 rounding of the activation and the product, per element (a few ulp of |gate·up|; GELU's far
    # negative tail is a cancellation in torch's float32 formula too)
    bound = 1e-6 * gu[0, f:].double().abs() * (1 + gate.double().abs())
    assert bool(((out[0].double() - want).abs() <= bound).all())


def test_lean_body_sees_weights_changed_in_place_from_the_next_cache():
    """The step checks its weights once per cache (a generation), not every step: a weight changed in place
    after a generation is read by the next one — by the codes while they match it, by the weight once not."""
    from lmhead.models.lean import LeanBody

    hf_model, _, codes = _coded_tiny("llama")
    lean = LeanBody(hf_model)
    lean.use_codes(codes)
    ids = torch.randint(4, 300, (1, 8), generator=torch.Generator().manual_seed(1))

    def decode() -> torch.Tensor:
        cache = lean.new_cache(1, 10)
        return torch.cat([lean(ids[:, t:t + 1], torch.tensor([[t]]), cache) for t in range(8)], dim=1)

    def want() -> torch.Tensor:
        with torch.no_grad():
            return hf_model.base_model(input_ids=ids).last_hidden_state

    torch.testing.assert_close(decode(), want(), atol=1e-5, rtol=0)
    block = hf_model.base_model.layers[1]
    with torch.no_grad():
        block.input_layernorm.weight.mul_(1.5)  # a norm: the step's descriptors are rebuilt
        block.mlp.down_proj.weight.mul_(2.0)  # a coded matrix's weight: its codes no longer give it back
    torch.testing.assert_close(decode(), want(), atol=1e-5, rtol=0)
