"""A GGUF file read in place: codes bit-equal to gguf-py's dequantisation, embedding rows from the codes, and
tiny models written as GGUF loaded without conversion, equal to transformers' forward on the same file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from lmhead.models.coded_linear import CodedLinear, coded_available
from lmhead.models.gguf_codes import FOUR_BIT, SUB_TYPES, block_scales, block_subscales, coded_nbytes
from lmhead.models.gguf_file import CODE_TYPES, block_codes
from lmhead.models.quant_types import TYPES


def _random_blocks(kind: str, n: int, seed: int) -> np.ndarray:
    """Random bytes for every field, with finite float16 scales (a NaN scale is no weight anyone stores; the
    declaration's `f16_at`)."""
    rng = np.random.default_rng(seed)
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    assert size == TYPES[kind].nbytes
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in TYPES[kind].f16_at:
        blocks[:, at:at + 2] = rng.uniform(-2, 2, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    for at in TYPES[kind].e8m0_at:  # scales 2^-10 .. 2^7, and the two subnormal ones (2^-128, 2^-127) too
        blocks[:, at] = rng.integers(118, 136, n, dtype=np.uint8)
        blocks[:2, at] = (0, 1)
    return blocks


@pytest.mark.parametrize("kind", sorted(CODE_TYPES))
def test_block_codes_times_their_scales_are_gguf_dequantize_bit_for_bit(kind):
    blocks = _random_blocks(kind, 64, seed=len(kind))
    codes = block_codes(kind, blocks).astype(np.float32)                     # [nb, block]
    scale, offset = block_scales(kind, blocks)                                     # [nb, groups]
    group = codes.shape[1] // scale.shape[1]
    w = codes.reshape(len(blocks), -1, group) * scale[..., None]
    if offset is not None:
        w = w + offset[..., None]
    expected = dequantize(blocks, GGMLQuantizationType[kind]).reshape(w.shape)
    np.testing.assert_array_equal(w.view(np.uint32), expected.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("kind", sorted(SUB_TYPES))
def test_k_quant_sub_scales_times_their_d_are_the_block_scales_bit_for_bit(kind):
    blocks = _random_blocks(kind, 64, seed=len(kind) + 1)
    scale, offset = block_scales(kind, blocks)
    d, sub, dmin, sub_min = block_subscales(kind, blocks)
    assert sub.dtype == np.int8 and d.dtype == np.float32
    bits = lambda a: np.asarray(a, dtype=np.float32).view(np.uint32)  # noqa: E731
    np.testing.assert_array_equal(bits(d[:, None] * sub.astype(np.float32)), bits(scale))
    if offset is None:
        assert dmin is None and sub_min is None
    else:
        np.testing.assert_array_equal(bits(dmin[:, None] * sub_min.astype(np.float32)), bits(offset))


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
@pytest.mark.parametrize("kind", sorted(CODE_TYPES) + ["F16", "BF16", "F32"])
@pytest.mark.parametrize("n", [12, 10])  # 12: blocks of four rows (the decode layout); 10: plain rows
def test_a_matrix_of_every_code_type_read_from_a_file_multiplies_as_its_dequantized_weights(tmp_path, kind, n):
    import gguf

    from lmhead.models.gguf_file import GGUFFile

    per_block, _ = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    k = 2 * max(per_block, 64) + (19 if per_block == 1 else 0)  # float weights: rows not whole vectors too
    if per_block == 1:
        values = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 3
        dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[kind]
        blocks = values.to(dtype).view(torch.uint8).numpy()
    else:
        blocks = _random_blocks(kind, n * k // per_block, seed=n)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_tensor("m.weight", blocks.reshape(n, -1), raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(tmp_path / "m.gguf")
    want = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[kind]).reshape(n, k).astype(np.float32))
    if per_block == 1:
        coded = CodedLinear.dense16(f.weights16("m.weight"))
    else:
        coded = f.coded("m.weight", chunk_rows=4)  # converted in pieces, as a large matrix is
        assert coded.rows4 == (n % 4 == 0)
        assert coded.packed == (kind in FOUR_BIT)  # codes of at most 4 bits (Q2_K, Q3_K too): two to a byte
        assert coded.sub == (kind in SUB_TYPES)  # a K-quant's scales as its blocks hold them
        assert coded.nbytes == coded_nbytes(kind, n * k)  # what the memory estimate counts
        torch.testing.assert_close(f.codes("m.weight").dequantize(), want, rtol=0, atol=0)
    bits = lambda t: t.view(torch.int32)  # noqa: E731  (bit for bit: −0 is not +0)
    assert torch.equal(bits(coded.dequantize()), bits(want))
    assert torch.equal(bits(coded.rows(torch.tensor([n - 1, 0, 3]))), bits(want[[n - 1, 0, 3]]))
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 5, 9):  # decode, the several-row passes, 8 + the rest
        x = torch.randn(m, k, generator=g)
        exact = x.double() @ want.double().T
        # float32 summation error: a small multiple of eps32 times the sum of |terms| of each output
        bound = 2e-6 * (x.double().abs() @ want.double().abs().T) + 1e-7
        assert bool(((coded(x).double() - exact).abs() <= bound).all()), (kind, m)
    del coded, want
    f.close()


def _file_matrix(tmp_path, kind: str, n: int, k: int):
    """A matrix [n, k] of random blocks of `kind` (random float16, bfloat16 or float32 weights for those) written as
    a GGUF file and read back as the decode step holds it (`CodedLinear`)."""
    import gguf

    from lmhead.models.gguf_file import GGUFFile

    per_block, _ = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    if per_block == 1:
        values = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 3
        dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[kind]
        blocks = values.to(dtype).view(torch.uint8).numpy()
    else:
        blocks = _random_blocks(kind, n * k // per_block, seed=n)
    path = tmp_path / f"{kind}-{n}x{k}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("m.weight", blocks.reshape(n, -1), raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    coded = CodedLinear.dense16(f.weights16("m.weight")) if per_block == 1 else f.coded("m.weight", chunk_rows=4)
    f.close()
    return coded


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
@pytest.mark.parametrize("kind", sorted(CODE_TYPES) + ["F16", "BF16", "F32"])
@pytest.mark.parametrize("n, k", [(12, 512), (10, 512), (8, 1024 + 256), (4, 8192)])  # blocks of four rows; plain
def test_a_rows_product_is_the_same_bits_alone_in_any_batch_and_over_any_threads(tmp_path, kind, n, k):
    # batch invariance: a request's logits do not depend on what else a server round, a draft's verification or a
    # prefill chunk multiplies beside it, nor on how the threads share the rows — every row summed in one order
    from lmhead.kernels import native

    per_block, _ = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    if k % max(per_block, 1):
        pytest.skip(f"{kind}'s blocks do not divide K = {k}")
    k = k + (19 if per_block == 1 and n == 10 else 0)  # float weights: rows not whole vectors too
    coded = _file_matrix(tmp_path, kind, n, k)
    lib = native.library()
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731

    def product(x: torch.Tensor, threads: int) -> torch.Tensor:
        y = torch.empty(x.shape[0], n)
        rc = lib.lmhead_coded_matmul(x.data_ptr(), x.shape[0], k, coded.codes.data_ptr(), ptr(coded.scale),
                                     ptr(coded.offset), n, coded.group, coded.flags, y.data_ptr(), threads)
        assert rc == 0
        return y

    x = torch.randn(9, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([product(x[i:i + 1].clone(), 1) for i in range(9)])
    for m in range(1, 10):
        for threads in (1, 2):
            assert torch.equal(product(x[:m].contiguous(), threads).view(torch.int32), alone[:m].view(torch.int32)), \
                (kind, n, k, m, threads)
    assert torch.equal(product(x[3:8].contiguous(), 2).view(torch.int32), alone[3:8].view(torch.int32))


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
@pytest.mark.parametrize("k", [576, 531, 64, 15])
def test_a_float32_matrixs_pairs_are_the_same_bits_in_any_tile_alone_and_over_any_threads(k):
    # float32 weights (an F32 file, a transformers model's own: `Model.use_dense`): query rows go six at a time
    # over four weight rows, the rest fewer at a time, a last weight row alone — every pair summed in one order
    from lmhead.kernels import native

    g = torch.Generator().manual_seed(k)
    n = 37  # chunks of 32 weight rows: a whole one, then a quad and a lone row
    w = torch.randn(n, k, generator=g)
    w[5] = w[0]
    w[36] = w[0]  # the same row in a tile of four and alone
    coded = CodedLinear.dense16(w)
    lib = native.library()

    def product(x: torch.Tensor, threads: int) -> torch.Tensor:
        y = torch.empty(x.shape[0], n)
        assert lib.lmhead_coded_matmul(x.data_ptr(), x.shape[0], k, coded.codes.data_ptr(), None, None, n,
                                       coded.group, coded.flags, y.data_ptr(), threads) == 0
        return y

    x = torch.randn(14, k, generator=g) * torch.logspace(-3, 3, k)  # sums whose order shows in their last bits
    alone = torch.cat([product(x[i:i + 1].clone(), 1) for i in range(14)])
    assert torch.equal(alone[:, 0], alone[:, 5]) and torch.equal(alone[:, 0], alone[:, 36])
    torch.testing.assert_close(alone, (x.double() @ w.double().T).float(), rtol=1e-4, atol=1e-4 * k)
    for m in range(1, 15):
        for threads in (1, 2, 3):
            assert torch.equal(product(x[:m].contiguous(), threads).view(torch.int32),
                               alone[:m].view(torch.int32)), (k, m, threads)


def _resident_mib(f, names) -> float:
    """MiB of the tensors `names` of the GGUFFile `f` resident in this process (/proc/self/pagemap's present
    bit for each page of the map; pages shared with the file's header or another tensor included)."""
    base = np.frombuffer(f._map, dtype=np.uint8).__array_interface__["data"][0]
    page = 4096
    present = 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        for name in names:
            t = f.tensors[name]
            first, last = (base + t.data_offset) // page, (base + t.data_offset + t.n_bytes - 1) // page
            pagemap.seek(first * 8)
            entries = np.frombuffer(pagemap.read((last - first + 1) * 8), dtype=np.uint64)
            present += int(((entries >> np.uint64(63)) & np.uint64(1)).sum())
    return present * page / 2**20


@pytest.mark.skipif(not coded_available() or not Path("/proc/self/pagemap").exists(),
                    reason="no C compiler for the coded kernel, or no /proc/self/pagemap")
def test_a_matrix_converted_in_pieces_leaves_none_of_its_file_pages_resident(tmp_path):
    import gguf

    from lmhead.models.gguf_file import GGUFFile

    n, k = 4096, 512  # Q8_0: 2.2 MB, converted 64 rows (36 KB) at a time
    blocks = _random_blocks("Q8_0", n * k // 32, seed=3)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_tensor("m.weight", blocks.reshape(n, -1), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(tmp_path / "m.gguf")
    coded = f.coded("m.weight", chunk_rows=64)
    # each piece's read maps the pages around it again (the kernel's fault-around), the end of the piece before
    # among them: all of them are dropped, not only the piece just read
    assert _resident_mib(f, ["m.weight"]) < 0.05
    want = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(n, k).astype(np.float32))
    assert torch.equal(coded.dequantize(), want)
    del coded
    f.close()


@pytest.mark.skipif(not coded_available() or not Path("/proc/self/pagemap").exists(),
                    reason="no C compiler for the coded kernel, or no /proc/self/pagemap")
def test_a_body_read_from_its_file_leaves_none_of_the_file_pages_resident(tmp_path, monkeypatch):
    from tiny_gguf import write_tiny_gguf

    from lmhead.models.file_model import file_body, meta_folder, read_meta
    from lmhead.models.gguf_file import GGUFFile

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", kind="IQ4_XS")  # the wide tiny llama: 256-weight rows
    folder, _ = meta_folder("tiny", path, {}, progress=False)
    cfg, _, _ = read_meta(folder)
    f = GGUFFile(path)
    body = file_body(f, cfg)  # two workers: each tensor released while its neighbours are still being read
    assert _resident_mib(f, list(f.tensors)) < 0.05
    del body
    f.close()


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
@pytest.mark.parametrize("lo,hi,group,n,k,offset", [(-128, 128, 32, 12, 64, False), (0, 16, 32, 8, 128, True),
                                                    (-32, 32, 16, 6, 64, False), (-16, 16, 32, 5, 96, True)])
def test_coded_rows_are_the_dequantized_rows_in_every_layout(lo, hi, group, n, k, offset):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    scale = torch.randn(n, k // group, generator=g).half().float()
    off = torch.randn(n, k // group, generator=g).half().float() if offset else None
    coded = CodedLinear(codes, scale, off)
    ids = torch.tensor([[n - 1, 0, 2], [1, 1, n - 2]])
    got = coded.rows(ids)
    assert got.shape == (2, 3, k)
    torch.testing.assert_close(got, coded.dequantize()[ids], rtol=0, atol=0)
    with pytest.raises(IndexError, match="ids must be in"):
        coded.rows(torch.tensor([n]))


# --- whole tiny models --------------------------------------------------------------------------------------


def _load_both(tmp_path, monkeypatch, arch: str, kind: str):
    from tiny_gguf import write_tiny_gguf
    from transformers import AutoModelForCausalLM

    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, kind=kind)
    model = load_model(str(path), progress=False)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    return model, ref


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
@pytest.mark.parametrize("arch,kind", [("llama", "Q8_0"), ("llama", "Q4_1"), ("gemma3", "Q8_0"), ("qwen2", "Q5_0"),
                                       ("qwen3", "Q4_0"), ("llama", "F16"), ("llama", "Q2_K"), ("llama", "Q3_K"),
                                       ("qwen2", "IQ4_NL"), ("llama", "IQ4_XS"), ("gemma3", "BF16"),
                                       ("gemma2", "Q8_0"), ("gemma2", "Q5_1"), ("phi3", "Q8_0"), ("phi3", "F16"),
                                       ("llama", "F32"), ("qwen3", "F32"), ("llama", "MXFP4")])
@pytest.mark.slow
def test_a_tiny_gguf_runs_from_its_file_with_transformers_numbers(tmp_path, monkeypatch, arch, kind):
    model, ref = _load_both(tmp_path, monkeypatch, arch, kind)
    assert model.lean is not None and model.lean.embed is None  # the embedding's rows read from the file's codes
    assert model.lean._step_descs() is not None  # every block matrix coded: the whole decode step in C
    assert "_hf_model" not in model.__dict__ or model.__dict__["_hf_model"] is None  # nothing converted
    ids = torch.tensor([model.encode("The cat sat on the mat. The dog")])
    with torch.no_grad():
        expected = ref(ids).logits
    torch.testing.assert_close(model.logits(ids), expected, rtol=1e-4, atol=1e-4)
    # the step-by-step path (the one the logit lens takes) gives the C step's hidden states
    positions = torch.arange(ids.shape[1])[None]
    step_by_step = model.lean(ids, positions, model.lean.new_cache(1, ids.shape[1]), layers=[])
    torch.testing.assert_close(step_by_step, model.hidden_states(ids), rtol=1e-5, atol=1e-5)
    greedy = [s.token_id for s in model.generate("The cat sat", max_new_tokens=12,
                                                 config=__import__("lmhead").SamplingConfig(temperature=0))]
    start = torch.tensor([model.encode("The cat sat")])
    want = ref.generate(start, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, start.shape[1]:].tolist()
    assert greedy == want[:len(greedy)] and len(greedy) >= 1
    # the embedding rows the decode step reads from the codes are the file's dequantised rows
    if model.lean.embed_codes is not None:
        torch.testing.assert_close(model.lean.embedding(ids), ref.get_input_embeddings().weight.detach()[ids],
                                   rtol=0, atol=0)


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
@pytest.mark.parametrize("kind,wide", [("Q4_K", "Q8_0"), ("Q2_K", "Q8_0")])
def test_a_fused_product_of_two_types_keeps_each_type_in_its_own_layout_with_transformers_numbers(
        tmp_path, monkeypatch, kind, wide):
    """A file whose v and down are of a wider type than q, k, gate and up (llama.cpp's Q4_K_M keeps them in Q6_K):
    q and k stay 4-bit codes beside v's 8-bit ones, as row blocks of one product, instead of one layout of 8-bit
    codes for all three; the C step walks the blocks (one row and several), and the numbers are transformers'."""
    from tiny_gguf import assert_matches_reference, write_tiny_gguf
    from transformers import AutoModelForCausalLM

    from lmhead import load_model
    from lmhead.models.row_blocks import RowBlocks

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "mixed.gguf", "llama", kind=kind, types={"attn_v": wide, "ffn_down": wide})
    model = load_model(str(path), progress=False)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    cfg, qkv = ref.config, model.lean.layers[0].coded["qkv"]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert isinstance(qkv, RowBlocks)
    assert [b.out_features for b in qkv.blocks] == [(cfg.num_attention_heads + cfg.num_key_value_heads) * head_dim,
                                                    cfg.num_key_value_heads * head_dim]
    assert qkv.blocks[0].packed and not qkv.blocks[1].packed
    assert qkv.blocks[0].nbytes < qkv.blocks[0].out_features * qkv.in_features  # under a byte a weight
    assert model.lean._step_descs() is not None  # the whole decode step in C, over the blocks
    ids = torch.tensor([model.encode("The cat sat on the mat. The dog")])
    with torch.no_grad():
        want = ref(ids).logits
    assert_matches_reference(model, ref, ids, want)
    positions = torch.arange(ids.shape[1])[None]
    step_by_step = model.lean(ids, positions, model.lean.new_cache(1, ids.shape[1]), layers=[])
    assert torch.equal(step_by_step, model.hidden_states(ids))  # the C step's several rows: the blocks' own bits
    torch.testing.assert_close(qkv.dequantize(), torch.cat([b.dequantize() for b in qkv.blocks]), rtol=0, atol=0)
    again = load_model(str(path), progress=False)  # mapped from the layout cache, block by block
    assert torch.equal(again.logits(ids), model.logits(ids))


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
def test_a_type_without_a_code_kernel_is_dequantized_at_load_and_said_once_on_stderr(tmp_path, monkeypatch, capsys):
    from lmhead.models import file_model

    # every type the files are written in has a kernel: F32's taken away stands for one that has none
    monkeypatch.setattr(file_model, "DENSE_TYPES", {k: v for k, v in file_model.DENSE_TYPES.items() if k != "F32"})
    model, ref = _load_both(tmp_path, monkeypatch, "llama", "F32")
    said = [line for line in capsys.readouterr().err.splitlines() if "no code kernel" in line]
    assert len(said) == 1 and "(F32): dequantized to float32 at load" in said[0], said
    ids = torch.tensor([model.encode("The cat sat on the mat.")])
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), ref(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
def test_a_phi3_files_rope_factors_are_said_once_on_stderr_and_the_numbers_stay_transformers(tmp_path, monkeypatch,
                                                                                              capsys):
    from tiny_gguf import write_tiny_gguf
    from transformers import AutoModelForCausalLM

    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "long.gguf", "phi3", rope_factors=True)
    model = load_model(str(path), progress=False)
    said = [line for line in capsys.readouterr().err.splitlines() if "rope factors" in line]
    assert len(said) == 1 and "rope_factors_long.weight, rope_factors_short.weight" in said[0], said
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([model.encode("The cat sat on the mat.")])
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), ref(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
def test_the_exact_head_of_a_file_model_makes_its_float32_weight_only_when_asked(tmp_path, monkeypatch):
    model, ref = _load_both(tmp_path, monkeypatch, "llama", "Q8_0")
    head = model.exact_head
    assert not head.materialized
    h = torch.randn(3, head.d_model)
    logits = head(h)
    assert not head.materialized
    torch.testing.assert_close(head.weight, ref.get_output_embeddings().weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(logits, h @ head.weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
def test_the_float32_weight_first_read_under_inference_mode_is_a_normal_tensor(tmp_path, monkeypatch):
    model, ref = _load_both(tmp_path, monkeypatch, "llama", "Q8_0")
    with torch.inference_mode():
        w = model.exact_head.weight
    assert not w.is_inference()
    torch.testing.assert_close(w, ref.get_output_embeddings().weight.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("values,why", [
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope' rope"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
     "partial_rotary_factor 0.75"),
    ({"model_type": "llama", "hidden_act": "relu"}, "activation 'relu'"),
    ({"model_type": "gpt2"}, "model type 'gpt2'"),
    ({"model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh",
      "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, None),
])
def test_a_config_the_lean_body_does_not_compute_is_named(values, why):
    from lmhead.models.config import ModelConfig
    from lmhead.models.file_model import file_refusal

    values = {"hidden_act": "silu", **values}
    got = file_refusal(ModelConfig(values))
    assert (got is None) if why is None else (why in got), got


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
def test_a_file_the_lean_body_refuses_runs_through_transformers_said_once_on_stderr(tmp_path, monkeypatch, capsys):
    from tiny_gguf import write_tiny_gguf
    from transformers import AutoModelForCausalLM

    from lmhead import load_model
    from lmhead.models import file_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(file_model, "file_refusal", lambda cfg: "a test's rope")
    path = write_tiny_gguf(tmp_path / "refused.gguf", "phi3")
    model = load_model(str(path), progress=False)
    said = [line for line in capsys.readouterr().err.splitlines() if "lean body does not run" in line]
    assert said == ["lmhead: refused.gguf: the lean body does not run a test's rope; running transformers' body on "
                    "a float32 conversion"], said
    assert model.gguf_path is None  # converted, not read from the file
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([model.encode("The cat sat on the mat.")])
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), ref(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_second_load_of_a_gguf_reads_only_its_cached_config_and_tokenizer(tmp_path, monkeypatch):
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model
    from lmhead.models import file_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    load_model(str(path), progress=False)
    calls = []
    monkeypatch.setattr(file_model, "_write_meta", lambda *a: calls.append(a))
    load_model(str(path), progress=False)
    assert calls == []
    assert not list((tmp_path / "cache" / "models").glob("*/model.safetensors"))  # no float32 copy on disk


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_a_second_load_of_a_gguf_maps_the_matrices_the_first_laid_out_with_the_same_numbers(tmp_path, monkeypatch,
                                                                                            kind):
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model
    from lmhead.models.gguf_file import GGUFFile

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", kind=kind)
    first = load_model(str(path), progress=False)
    ids = torch.tensor([first.encode("The cat sat on the mat.")])
    want = first.logits(ids)
    laid = sorted(p.name for p in (tmp_path / "cache" / "layouts").glob("*/*.bin"))
    assert "blk.0.attn_q.weight+blk.0.attn_k.weight+blk.0.attn_v.weight.bin" in laid, laid
    monkeypatch.setattr(GGUFFile, "coded_rows", lambda *a: pytest.fail("a matrix laid out again"))
    again = load_model(str(path), progress=False)
    assert torch.equal(again.logits(ids), want)
    a, b = again.lean.layers[0].coded["qkv"], first.lean.layers[0].coded["qkv"]
    assert (a.four_bit, a.rows4, a.half, a.sub, a.flags) == (b.four_bit, b.rows4, b.half, b.sub, b.flags)
    assert torch.equal(a.codes, b.codes)


def test_layouts_of_files_gone_or_changed_are_removed_when_a_new_one_is_laid_out(tmp_path, monkeypatch, capsys):
    import os

    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    changed, gone, kept = (write_tiny_gguf(tmp_path / f"{n}.gguf", "llama", seed=i)
                           for i, n in enumerate(("changed", "gone", "kept")))
    for path in (changed, gone, kept):
        load_model(str(path), progress=False)
    layouts = tmp_path / "cache" / "layouts"
    before = {p.name for p in layouts.iterdir()}
    assert len(before) == 3
    (tmp_path / "cache" / "experts" / "0123").mkdir(parents=True)  # the earlier format's folder
    gone.unlink()
    st = changed.stat()
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # another key for the same path
    capsys.readouterr()
    load_model(str(changed), progress=False)
    after = {p.name for p in layouts.iterdir()}
    assert len(after) == 2 and len(after & before) == 1  # kept's own, and changed's new one
    assert not (tmp_path / "cache" / "experts").exists()
    said = [line for line in capsys.readouterr().err.splitlines() if "removed" in line]
    assert len(said) == 1 and "3 laid-out models" in said[0], said


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
@pytest.mark.parametrize("kind", ["Q4_K", "IQ4_XS"])
def test_a_dense_k_quant_holds_its_scales_as_its_blocks_do_where_the_build_converts_sixteen_with_the_same_bits(
        tmp_path, monkeypatch, kind):
    """Groups of 32 keep d·sub as the blocks hold them where the build makes sixteen an instruction (AVX-512), float32
    numbers per group otherwise; the products are the same bits either way (d·sub is exact in float32)."""
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model
    from lmhead.kernels import native
    from lmhead.models.gguf_codes import coded_nbytes
    from lmhead.models.gguf_file import dense_sub

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", kind=kind)
    monkeypatch.setenv("LMHEAD_GROUPS16", "0")  # the four-row layout's two ways (by groups: tests/test_groups16.py)
    got = {}
    for wide in (True, False):
        monkeypatch.setattr(native, "sub_sixteen", lambda wide=wide: wide)
        monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / f"cache-{wide}"))
        model = load_model(str(path), progress=False)
        o = model.lean.layers[0].coded["o"]
        assert o.sub is wide
        # the memory check counts the layout the loader chose (one decision: gguf_file.dense_sub)
        assert coded_nbytes(kind, o.out_features * o.in_features, dense_sub(kind, o.in_features)) == o.nbytes
        ids = torch.tensor([model.encode("The cat sat on the mat.")])
        got[wide] = (o.nbytes, model.logits(ids))
    assert got[True][0] < got[False][0]
    assert torch.equal(got[True][1], got[False][1])


def test_layouts_of_an_earlier_format_are_removed_and_the_file_laid_out_again(tmp_path, monkeypatch, capsys):
    """A folder laid out by an earlier FORMAT (its file unchanged: no later key names it) is removed when a load
    lays the file out in the current one — it would hold its gigabytes of disk for nothing."""
    import json

    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model
    from lmhead.models import layout_cache

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    load_model(str(path), progress=False)
    layouts = tmp_path / "cache" / "layouts"
    (old,) = layouts.iterdir()
    source = json.loads((old / "source.json").read_text())
    assert source["format"] == layout_cache.FORMAT
    source.pop("format")  # as the earlier format wrote it
    (old / "source.json").write_text(json.dumps(source))
    monkeypatch.setattr(layout_cache, "FORMAT", layout_cache.FORMAT + 1)
    capsys.readouterr()
    load_model(str(path), progress=False)
    (new,) = layouts.iterdir()
    assert new != old and list(new.glob("*.bin"))
    said = [line for line in capsys.readouterr().err.splitlines() if "removed" in line]
    assert len(said) == 1 and "earlier format" in said[0], said


def test_a_gguf_loaded_with_the_layout_cache_off_writes_no_layouts(tmp_path, monkeypatch):
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LMHEAD_LAYOUT_CACHE", "0")
    load_model(str(write_tiny_gguf(tmp_path / "tiny.gguf", "llama")), progress=False)
    assert not (tmp_path / "cache" / "layouts").exists()


def test_the_first_read_of_a_file_makes_its_start_tables_after_its_tokenizer_is_released(tmp_path, monkeypatch):
    from tiny_gguf import write_tiny_gguf
    from transformers import AutoTokenizer

    from lmhead.models.file_model import meta_folder, read_meta
    from lmhead.models.start_tokenizer import CHECK_TEXTS, LazyTokenizer, TokenizerTables, read_tables, tables_path

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    folder, made = meta_folder("tiny", path, {}, progress=False)
    assert isinstance(made, TokenizerTables)  # not transformers' tokenizer: it was released before they were made
    _, tokenizer, _ = read_meta(folder, made)
    assert isinstance(tokenizer, LazyTokenizer) and tokenizer._full is None
    assert read_tables(tables_path(folder)) is not None  # written for the next start
    want = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in CHECK_TEXTS:
        assert tokenizer.encode(text) == want.encode(text)


def test_a_gguf_without_a_tensor_its_architecture_needs_is_a_clear_error(tmp_path, monkeypatch):
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model
    from lmhead.models import ModelError

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "cut.gguf", "llama", drop="blk.1.ffn_down.weight")
    with pytest.raises(ModelError, match=r"cut\.gguf: the file has no tensor 'blk\.1\.ffn_down\.weight'"):
        load_model(str(path), progress=False)


def test_a_gguf_larger_than_the_memory_available_is_refused_before_it_loads(tmp_path, monkeypatch):
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model
    from lmhead.models import ModelError, file_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LMHEAD_IGNORE_MEMORY", raising=False)
    path = write_tiny_gguf(tmp_path / "big.gguf", "llama")
    monkeypatch.setattr(file_model, "available_memory", lambda: 1024)
    with pytest.raises(ModelError, match=r"big\.gguf: loading it needs about .* GiB of memory and 0\.0 GiB is"):
        load_model(str(path), progress=False)


def test_a_supported_file_whose_kernels_are_missing_is_not_converted_past_the_memory_available(tmp_path,
                                                                                                monkeypatch):
    # without the coded kernel the file's model is transformers' float32 conversion: refused with its estimate
    # before it starts where it cannot fit (a mixture of experts' conversion is many times its file)
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model
    from lmhead.models import ModelError, file_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LMHEAD_IGNORE_MEMORY", raising=False)
    path = write_tiny_gguf(tmp_path / "big.gguf", "llama")
    monkeypatch.setattr(file_model, "supports_file", lambda arch: False)
    monkeypatch.setattr(file_model, "available_memory", lambda: 1024)
    with pytest.raises(ModelError, match=r"big\.gguf: no C compiler for the coded kernel .*; transformers' float32 "
                                         r"model of it needs about .* GiB of memory and 0\.0 GiB is available"):
        load_model(str(path), progress=False)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_transformers_reads_the_same_config_and_tokenizer_through_the_header_reader(tmp_path, arch):
    from tiny_gguf import write_tiny_gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from lmhead.models.gguf_meta import header_reader

    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", arch))
    with header_reader():
        ours = load_gguf_checkpoint(path, return_tensors=False)
        again = load_gguf_checkpoint(path, return_tensors=False)  # the parsed header, kept for the block
    assert ours == load_gguf_checkpoint(path, return_tensors=False) == again
    import gguf

    assert gguf.GGUFReader.__module__.startswith("gguf")  # restored after the block
    reader = pytest.importorskip("transformers.integrations.gguf.reader")
    original = reader.read_gguf_metadata
    for arrays in ((), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")):
        with header_reader():
            ours = reader.read_gguf_metadata(path, arrays)
            ours[0]["tokenizer.ggml.token_type"].append(-1)  # a caller's change stays its own
            again = reader.read_gguf_metadata(path, arrays)
        assert reader.read_gguf_metadata is original  # restored after the block
        theirs = original(path, arrays)
        ours[0]["tokenizer.ggml.token_type"].pop()
        assert ours == theirs == again
        assert {k: type(v) for k, v in ours[0].items()} == {k: type(v) for k, v in theirs[0].items()}
    from transformers import AutoTokenizer

    folder, name = str(Path(path).parent), Path(path).name
    with header_reader():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert tokenizer.backend_tokenizer.to_str() == \
        AutoTokenizer.from_pretrained(folder, gguf_file=name).backend_tokenizer.to_str()
