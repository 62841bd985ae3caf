"""A GGUF model run straight from its file: the body and the head over the file's own codes, nothing converted.

    GGUF file ──once: transformers reads its config and tokenizer──▶ <cache>/meta/<key>/ (config.json,
        generation_config.json, tokenizer files, manifest; a few MB) ──every load──▶ ModelConfig + tokenizer
    GGUF file ──memory map──▶ each matrix's blocks ──integer codes + group scales (gguf_file.py)──▶ CodedLinear
        ──▶ LeanBody.from_parts (embedding rows read from the codes) + CodedHead (the exact head)
    F16, BF16, F32 matrices ──their weights as they are──▶ CodedLinear.dense16 (converted exactly in the product)
    other types (IQ* but IQ4_NL/IQ4_XS) ──gguf-py's dequantize, once at load──▶ float32

The numbers are the dequantised file (gguf-py's `dequantize`, what transformers' loader uses): every code is
read from the blocks' bits and gives that value back exactly; tensor layouts follow transformers' GGUF loader
(Llama's q/k rows un-permuted for its rope, Gemma's norms stored as 1 + w, Phi-3's q/k/v and gate/up each
one matrix already). transformers' float32 model is built only when asked for (`Model.hf_model`: the conversion
cache of `loading.py`), never to generate.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmhead.models import cache, huge_pages, layout_cache
from lmhead.models.arch import FILE_ARCHITECTURES, ArchSpec, arch_of, refusal
from lmhead.models.coded_linear import CodedLinear, coded_available
from lmhead.models.config import ModelConfig
from lmhead.models.convert import eos_ids
from lmhead.models.errors import ModelError
from lmhead.models.expert_layout import expert_nbytes
from lmhead.models.file_experts import moe_config, read_moe
from lmhead.models.gguf_codes import FOUR_BIT, Codes, coded_nbytes, fuse_codes
from lmhead.models.gguf_file import CODE_TYPES, DENSE_TYPES, GGUFFile, dense_sub
from lmhead.models.heap import one_arena, trim_heap
from lmhead.models.quant_types import TYPES
from lmhead.models.row_blocks import RowBlocks
from lmhead.models.start_tokenizer import CHECK_TEXTS, start_tokenizer, tables_from, tables_plan

__all__ = ["FILE_ARCHITECTURES", "file_body", "file_refusal", "meta_folder", "supports_file"]
_TOKENIZER_CHECK = CHECK_TEXTS[0]


def supports_file(architecture: str) -> bool:
    return architecture in FILE_ARCHITECTURES and coded_available()


_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
                "silu": torch.nn.functional.silu}


def file_refusal(cfg: ModelConfig) -> str | None:
    """What of the config transformers read from a file the lean body does not compute (then transformers' body
    runs it), or None."""
    why = refusal(cfg)
    act = cfg.hidden_activation or cfg.hidden_act
    if why is None and act not in _ACTIVATIONS:
        why = f"the activation {act!r}"
    return why


# --- config and tokenizer, once per file ------------------------------------------------------------------


def meta_folder(key: str, gguf: Path, facts: dict[str, Any], progress: bool = True, keep: Path | None = None
                ) -> tuple[Path, Any]:
    """(`<cache>/meta/<key>`, the tokenizer's start tables — or, where it has none, the tokenizer read back — when
    it was built now, else None): the config,
    generation config and tokenizer transformers reads from `gguf`, built once (checked against its manifest on
    every load; rebuilt when `facts` — where the file came from — changed).
    `keep`: a GGUF file made for this load (a packaged model assembled from its chunks), moved into the folder
    as model.gguf."""
    folder = cache.meta_dir() / key
    if _usable(folder, facts) is None:
        return folder, None
    with cache.lock(f"meta-{key}"):
        reason = _usable(folder, facts)
        if reason is None:
            return folder, None
        cache.remove_stale_tmp(f"meta-{key}")
        tmp = cache.new_tmp_dir(f"meta-{key}")
        try:
            if progress:
                print(f"lmhead: reading {gguf.name}'s config and tokenizer (once; cached in {folder})",
                      file=sys.stderr, flush=True)
            out = tmp / "out"
            out.mkdir()
            tokenizer = _write_meta(gguf, out)
            weights = f"{gguf.stat().st_size}-{cache.fast_checksum_file(gguf)}"
            if keep is not None:
                shutil.move(str(keep), out / "model.gguf")
            cache.write_manifest(out, {"name": key, "source": facts, "weights_sha256": weights, "kind": "gguf-meta"})
            cache.publish(out, folder)
        except OSError as exc:
            need = (keep.stat().st_size if keep is not None and keep.exists() else 0) + 64 * 2**20
            raise cache.disk_error(exc, folder.parent, need) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder, tokenizer


def _usable(folder: Path, facts: dict[str, Any]) -> str | None:
    reason = cache.verify(folder)
    if reason is not None:
        return reason
    built = (cache.read_manifest(folder) or {}).get("source", {})
    changed = [k for k, v in facts.items() if built.get(k) != v]
    return f"the source changed ({', '.join(changed)})" if changed else None


def _write_meta(gguf: Path, out: Path) -> Any:
    """Write `gguf`'s config, generation config and tokenizer into `out`; the tokenizer as read back from `out`
    (checked to encode a test text as transformers' GGUF tokenizer does) as its start tables, which the load then
    uses (`start_tokenizer`), or itself where it has none."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from lmhead.models.gguf_meta import gpt_oss_config, header_reader
    from lmhead.models.hf_tokenizer import fast_tokenizer, no_progress_bars

    try:
        with no_progress_bars(), header_reader():
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:
        raise ModelError(f"transformers could not read the config and tokenizer of {gguf}: "
                         f"{type(exc).__name__}: {exc}") from exc
    if getattr(config, "quantization_config", None) is not None:
        delattr(config, "quantization_config")
    gpt_oss_config(gguf, config)
    config.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id = eos_ids(generation.eos_token_id, tokenizer)
    generation.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for extra in ("special_tokens_map.json",):  # not read back: fast_tokenizer takes tokenizer_config.json
        (out / extra).unlink(missing_ok=True)
    want = tokenizer(_TOKENIZER_CHECK)["input_ids"]
    del tokenizer  # released before the saved one is read: a large vocabulary's tokenizer is hundreds of MB
    trim_heap()
    saved = fast_tokenizer(out)
    if saved(_TOKENIZER_CHECK)["input_ids"] != want:
        raise ModelError(f"the tokenizer saved from {gguf} does not encode a test text as transformers' GGUF "
                         "tokenizer does")
    # the start tables made from a plan taken of it, after it is released: the parsed JSON they are made from
    # (hundreds of MB for a large vocabulary) not beside the tokenizer (hundreds more while it is built)
    plan = tables_plan(saved)
    if plan is None:
        return saved
    del saved
    trim_heap()
    tables = tables_from(plan)
    del plan
    return tables if tables is not None else fast_tokenizer(out)


def read_meta(folder: Path, tokenizer: Any = None) -> tuple[ModelConfig, Any, list[int]]:
    """(config, tokenizer, end-of-sequence ids) of a meta folder (`tokenizer`: the folder's, or its start tables,
    already made by `meta_folder`)."""
    from lmhead.models.hf_tokenizer import fast_tokenizer

    cfg = ModelConfig.from_file(folder / "config.json")
    generation = json.loads((folder / "generation_config.json").read_text())
    tokenizer = start_tokenizer(folder, lambda: fast_tokenizer(folder), tokenizer)
    return cfg, tokenizer, _ids(generation.get("eos_token_id"), cfg.eos_token_id)


def _ids(*values: Any) -> list[int]:
    out: list[int] = []
    for value in values:
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if i is not None and int(i) not in out:
                out.append(int(i))
    return out


# --- the weights ---------------------------------------------------------------------------------------------

def _linears(arch: ArchSpec) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The lean body's four products and the file's matrices each is (fused when several, in this order)."""
    return (("qkv", arch.gguf_qkv), ("o", ("attn_output",)), ("gate_up", arch.gguf_gate_up), ("down", ("ffn_down",)))


class _Reader:
    """Tensors of the file as the lean body wants them: transformers' layout, codes where the kernel takes them."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig) -> None:
        self.f, self.cfg = f, cfg
        self.layouts = layout_cache.folder_for(f.path)  # matrices laid out by an earlier load, mapped
        self.arch = arch_of(cfg)
        self.permute = self.arch.permute_qk  # transformers' LlamaTensorProcessor un-permutes q and k
        self.dequantized: list[str] = []

    def has(self, name: str) -> bool:
        return name in self.f.tensors

    def _perm(self, name: str, rows: int) -> np.ndarray | None:
        if not self.permute or not (".attn_q." in name or ".attn_k." in name):
            return None
        heads = self.cfg.num_attention_heads if ".attn_q." in name else self.cfg.num_key_value_heads
        dim = rows // heads // 2
        return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)

    def _dense(self, name: str) -> torch.Tensor:
        """The tensor as float32 in transformers' layout (Gemma's norms stored as 1 + w: w, as transformers
        computes it; Llama's q/k rows un-permuted), its pages released."""
        t = self.f.dequantize(name)
        if self.arch.unit_offset_norm and "norm.weight" in name:
            t = torch.from_numpy(t.numpy() - 1)
        perm = self._perm(name, t.shape[0])
        self.f.release(name)
        return t[torch.from_numpy(perm)].contiguous() if perm is not None else t

    def vector(self, name: str) -> torch.Tensor | None:
        """A norm or bias as float32, or None where the file has none."""
        return self._dense(name) if name in self.f.tensors else None

    def codes(self, name: str) -> Codes | None:
        if self.f.type_of(name) not in CODE_TYPES:
            return None
        c = self.f.codes(name)
        perm = self._perm(name, c.codes.shape[0])
        if perm is not None:
            p = torch.from_numpy(perm)
            c = Codes(c.codes[p], c.scale[p], None if c.offset is None else c.offset[p], c.kind)
        return c

    def matrix(self, name: str) -> torch.Tensor:
        """A matrix of a type without codes, dequantized (said once per load on stderr)."""
        self.dequantized.append(f"{name} ({self.f.type_of(name)})")
        return self._dense(name)

    def coded(self, name: str) -> CodedLinear | None:
        """One matrix as the coded kernel's (converted piece by piece), or None for a type without codes: the
        embedding or the head (the integer path by groups' layout where it is eligible, as a block's matrices: its
        one-row product is the decode step's, its rows the C step reads and its screen serves Q8_0 and Q5_0
        heads: a type whose codes the screen reads a byte each keeps them so, `_screened`)."""
        kind = self.f.type_of(name)
        return self.linear([name], head=True)[0] if kind in DENSE_TYPES or kind in CODE_TYPES else None

    def weights16(self, name: str) -> torch.Tensor:
        w = self.f.weights16(name)
        perm = self._perm(name, w.shape[0])
        return w[torch.from_numpy(perm)] if perm is not None else w

    def linear(self, names: list[str], head: bool = False
               ) -> tuple[CodedLinear | RowBlocks | None, torch.Tensor | None]:
        """(codes, None) for matrices the coded kernel takes, else (None, the float32 rows concatenated). A matrix
        of codes laid out by an earlier load of the file is mapped from the layout cache (`layout_cache`). Matrices
        of different code types (Q4_K_M's q and k beside its Q6_K v) are row blocks, each run of one type in that
        type's own layout (`RowBlocks`), not one layout wide enough for all. An eligible matrix takes the integer path
        by groups' layout (`models/groups16.py`)."""
        runs = self._runs(names)
        if len(runs) > 1:
            return RowBlocks([self.linear(run)[0] for run in runs]), None
        got = layout_cache.cached_linear(self.layouts, "+".join(names), lambda: self._linear(names, head))
        if isinstance(got, CodedLinear):
            for n in names:  # the file's pages of these tensors are not wanted (mapped: kept for GGUFFile.sweep)
                self.f.release(n)
            return got, None
        return None, got

    def _runs(self, names: list[str]) -> list[list[str]]:
        """`names` as runs of one code type each, where they are all of code types (else one run: the fused
        float or mixed path)."""
        kinds = [self.f.type_of(n) for n in names]
        if len(set(kinds)) == 1 or not set(kinds) <= CODE_TYPES:
            return [names]
        runs = [[names[0]]]
        for name, kind, before in zip(names[1:], kinds[1:], kinds, strict=False):
            if kind == before:
                runs[-1].append(name)
            else:
                runs.append([name])
        return runs

    def _linear(self, names: list[str], head: bool = False) -> CodedLinear | torch.Tensor:
        """`head`: the embedding or the head, whose codes stay a byte each where its screen reads them so."""
        kinds = {self.f.type_of(n) for n in names}
        planes = len(kinds) == 1 and not (head and _screened(next(iter(kinds))))
        sizes = [self.f.shape(n) for n in names]
        if (len(kinds) == 1 and kinds <= CODE_TYPES and len({k for _, k in sizes}) == 1
                and all(rows % 4 == 0 for rows, _ in sizes[:-1])):
            # one type: the parts' rows read into one layout piece by piece (q/k rows in transformers' order)
            return self.f.coded_rows(names, [self._perm(n, rows) for n, (rows, _) in zip(names, sizes, strict=True)],
                                     groups16=True, planes=planes)
        if len(kinds) == 1 and kinds <= DENSE_TYPES.keys():  # F16, BF16 or F32 rows, as they are
            parts, arena = [self.weights16(n) for n in names], huge_pages.current()
            return CodedLinear.dense16(torch.cat(parts) if arena is None else arena.cat(parts))
        found = [self.codes(n) for n in names]
        if all(c is not None for c in found):
            fused = fuse_codes(found)
            kinds = {c.kind for c in found}  # one type: its layout (IQ4 levels are not told by a range)
            kind = kinds.pop() if len(kinds) == 1 else None
            coded = CodedLinear(fused.codes, fused.scale, fused.offset,
                                four_bit=FOUR_BIT.get(kind) if kind is not None else "auto", groups16=True,
                                plane=TYPES[kind].plane if kind in TYPES and planes else None)
            for n in names:
                self.f.release(n)
            return coded
        return torch.cat([self.matrix(n) for n in names])


def file_body(f: GGUFFile, cfg: ModelConfig, onednn: bool | None = None):
    """(LeanBody, head codes or float32 head weight, head bias, tied) for the GGUF file `f` with config `cfg`.

    The repacking is many small element-wise passes: each on one thread (on a busy machine torch's pool waking
    for each of them is several times slower), the embedding and the layers two at a time (one per core). The
    matrices go on huge pages where the system has them (`models/huge_pages.py`): the large layout files mapped and
    advised (read again once where the page cache held them in small folios), the rest in one arena.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with huge_pages.arena_for_load() as arena:
            body = _file_body(f, cfg, onednn, workers=min(2, threads))
            if arena is not None:
                huge_pages.refold(arena)
            return body
    except KeyError as exc:
        raise ModelError(f"{f.path}: the file has no tensor {exc} that a {f.architecture} model of "
                         f"{cfg.num_hidden_layers} layers needs (a damaged or incomplete file)") from None
    finally:
        torch.set_num_threads(threads)


def _file_body(f: GGUFFile, cfg: ModelConfig, onednn: bool | None, workers: int):
    from lmhead.models.lean import Layer, LeanBody
    from lmhead.models.rope import Rotary

    moe_config(f, cfg)
    why = file_refusal(cfg)
    if why is not None:
        raise ModelError(f"{f.path}: the lean body does not run {why}")
    r = _Reader(f, cfg)
    arch = r.arch
    types = list(cfg.layer_types or ["full_attention"] * cfg.num_hidden_layers)

    def shared_linear(names: list[str]):
        c, w = r.linear(names)
        return c if c is not None else w

    def layer(i: int, kind: str) -> Layer:
        p = f"blk.{i}."
        moe = read_moe(f, i, arch, cfg, r.vector, shared_linear, r.layouts)
        mats, coded = {"gate_up": None, "down": None}, {}
        for key, parts in _linears(arch):
            if moe is not None and key in ("gate_up", "down"):
                continue  # the layer's MLP is its experts
            c, w = r.linear([p + part + ".weight" for part in parts])
            mats[key] = w
            if c is not None:
                coded[key] = c
        sandwich = arch.sandwich_norms
        return Layer(
            qkv=mats["qkv"], qkv_bias=_qkv_bias(r, p, arch), o=mats["o"], gate_up=mats["gate_up"],
            down=mats["down"], moe=moe, input_norm=r.vector(p + "attn_norm.weight"),
            post_attn_norm=r.vector(p + "post_attention_norm.weight") if sandwich else None,
            pre_mlp_norm=r.vector(p + arch.gguf_pre_mlp_norm + ".weight"),
            post_mlp_norm=r.vector(p + "post_ffw_norm.weight") if sandwich else None,
            q_norm=r.vector(p + "attn_q_norm.weight"), k_norm=r.vector(p + "attn_k_norm.weight"),
            kind=kind, sliding=arch.sliding(kind, cfg.sliding_window), coded=coded or None,
            o_bias=r.vector(p + "attn_output.bias") if arch.attention.o_bias else None,
            sinks=r.vector(p + "attn_sinks.weight") if arch.attention.sinks else None)

    def swept(i: int, kind: str) -> Layer:
        out = layer(i, kind)
        f.sweep()  # this layer's pages mapped again by its neighbours' reads (GGUFFile.sweep)
        return out

    # the embedding (often the largest matrix) and the layers repacked side by side, on `workers` threads (at most
    # torch's): numpy's and torch's passes release the GIL; torch's thread count is per thread under OpenMP, so
    # each worker keeps its passes on itself, as file_body does
    pool = ThreadPoolExecutor(max_workers=workers, initializer=torch.set_num_threads, initargs=(1,))
    with one_arena(), pool:
        coded_embed = pool.submit(r.coded, "token_embd.weight")
        layers = list(pool.map(swept, range(len(types)), types))
        embed: Any = coded_embed.result()
    tied = not r.has("output.weight")
    if embed is None:
        embed = r.matrix("token_embd.weight")
    head = embed if tied else (r.coded("output.weight") or r.matrix("output.weight"))
    act = _ACTIVATIONS[cfg.hidden_activation or cfg.hidden_act]
    scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32) if arch.scaled_embedding else None
    body = LeanBody.from_parts(cfg, embed, layers, r.vector("output_norm.weight"), Rotary(cfg), act,
                               embed_scale=scale, onednn=onednn)
    f.sweep()  # the pages the last reads mapped around them
    factors = sorted(n for n in f.tensors if n.startswith("rope_factors"))
    if factors:  # llama.cpp's longrope (Phi-3 128k): llama.cpp's numbers differ from transformers' here
        print(f"lmhead: {f.path.name}: its rope factors ({', '.join(factors)}) are not applied, as transformers' "
              "GGUF loader does not apply them: the numbers are transformers' on this file", file=sys.stderr,
              flush=True)
    if r.dequantized:
        kinds = ", ".join(sorted({d.split(" ")[1].strip("()") for d in r.dequantized}))
        print(f"lmhead: {len(r.dequantized)} tensors of {f.path.name} have no code kernel ({kinds}): dequantized "
              "to float32 at load", file=sys.stderr, flush=True)
    return body, head, None, tied


def _qkv_bias(r: _Reader, p: str, arch: ArchSpec) -> torch.Tensor | None:
    """The q, k and v biases as one vector (zeros for a part without one; None where none has a bias)."""
    biases = [r.vector(p + f"{part}.bias") for part in arch.gguf_qkv]
    if all(b is None for b in biases):
        return None
    if len(biases) == 1:
        return biases[0]
    cfg = r.cfg
    sizes = [cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_key_value_heads]
    hd = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    return torch.cat([b if b is not None else torch.zeros(n * hd) for b, n in zip(biases, sizes, strict=True)])


def _screened(kind: str) -> bool:
    """Whether a head of type `kind` can take the screen, which reads int8 codes a byte each
    (`CodedLinear.screened_codes`: Q8_0's and Q5_0's)."""
    t = TYPES.get(kind)
    return t is not None and CodedLinear.screened_codes(t.group, t.half, t.four_bit is not None, t.offset)


def memory_needed(f: GGUFFile) -> int:
    """Bytes a load holds: each matrix in the kernel's layout (`coded_nbytes`; 2 bytes a weight for F16 and BF16,
    4 for F32 and the types dequantized)."""
    total = 0
    for name in f.tensors:
        kind, count = f.type_of(name), int(np.prod(f.shape(name)))
        if "_exps." in name and len(f.shape(name)) == 3 and (kind in CODE_TYPES or kind in DENSE_TYPES):
            total += expert_nbytes(kind, *f.shape(name))  # a mixture's experts (models/expert_layout.py)
        elif kind in CODE_TYPES:
            total += coded_nbytes(kind, count, dense_sub(kind, f.shape(name)[-1]))
        else:  # a float type held as it is, or a type dequantized (4 bytes a weight)
            total += (DENSE_TYPES[kind].itemsize if kind in DENSE_TYPES else 4) * count
    return total


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(f: GGUFFile) -> None:
    """ModelError before loading a file whose weights will not fit in the memory available now."""
    need, have = memory_needed(f), available_memory()
    if have is not None and need > have and not os.environ.get("LMHEAD_IGNORE_MEMORY"):
        raise ModelError(f"{f.path}: loading it needs about {need / 2**30:.1f} GiB of memory and "
                         f"{have / 2**30:.1f} GiB is available; close other programs or choose a smaller file "
                         "(LMHEAD_IGNORE_MEMORY=1 tries anyway)")

