"""A GGUF file's quantised matrices as lossless codes of the float32 model: integer codes + group scales.

    GGUF tensor (Q4_K, Q5_0, Q6_K, Q8_0, Q4_1, ...) ──its blocks' scales (and mins)──▶ scale, offset [N, K/G]
    the model's float32 weight W [N,K] ──code = round((W − offset) / scale)──▶ codes int8 [N,K]
        ──checked: scale·code + offset == W for every weight (float32, bit for bit)──▶ `CodedLinear`

transformers dequantises a GGUF file into the float32 model lmhead runs; that model's weights are therefore
exactly `scale · code + offset` per group of 16 or 32 weights. Storing them that way again is not an
approximation: the check above is made on every weight when the codes are built, and a matrix that does not
pass keeps its float32 product. Tensors whose rows transformers reordered (Llama's q/k rope layout) are matched
row by row. Built once per model from its GGUF file and cached beside the converted model
(`<cache>/codes/<model sha256>-v<FORMAT>.safetensors`, with a checksum, written to a temporary file and
renamed); this module is the only code that writes there.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lmhead.models import cache
from lmhead.models.quant_types import LEVELS, TYPES

__all__ = ["BLOCKS", "FORMAT", "FOUR_BIT", "IQ4_VALUES", "SUB_TYPES", "Codes", "block_scales", "block_subscales",
           "coded_nbytes", "codes_for_model",
           "codes_from_weight", "fuse_codes", "gguf_codes", "module_codes"]

FORMAT = 1  # bump when the stored layout changes: older files are rebuilt

# views of models/quant_types.py's declarations, by the names the loader and the tests use:
# name -> (weights per block, bytes per block, weights per scale group)
BLOCKS = {t.name: (t.block, t.nbytes, t.group) for t in TYPES.values()}
# IQ4_NL's and IQ4_XS's 16 levels: a weight is d·IQ4_VALUES[q], so the table's integer is the weight's code
IQ4_VALUES = LEVELS["iq4"]
# how the coded kernel holds each type's codes two to a byte (`CodedLinear`'s `four_bit`)
FOUR_BIT = {t.name: t.four_bit for t in TYPES.values() if t.four_bit}
# types whose group scales (and offsets) are held as their blocks hold them (`block_subscales`, SubScales)
SUB_TYPES = frozenset(t.name for t in TYPES.values() if t.sub)


def coded_nbytes(kind: str, count: int, sub: bool | None = None) -> int:
    """Bytes the kernel's layout of `count` weights of type `kind` takes: codes, scales and offsets (`sub`: the
    scales as the blocks hold them; None: the type's `sub`)."""
    return TYPES[kind].coded_nbytes(count, sub)


# GGUF tensor name (per block i) -> the transformers module path under the base model
_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


@dataclass
class Codes:
    """W [N,K] = scale[n,g]·codes[n,k] + offset[n,g] (g = k // group); offset None where the format has none."""

    codes: Tensor            # int8 [N,K]
    scale: Tensor            # float32 [N,K/G]
    offset: Tensor | None    # float32 [N,K/G] or None
    kind: str                # the GGUF type they came from ("Q5_0", ...)

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self) -> Tensor:
        n, k = self.codes.shape
        w = self.codes.float().view(n, -1, self.group) * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.view(n, k)


def block_scales(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-group (scale, offset) float32 [n_blocks, groups per block] of raw blocks [n_blocks, bytes], computed
    as gguf's dequantiser computes them (float32 products of the stored half-precision and integer parts)."""
    if kind not in TYPES:
        raise ValueError(f"no codes for GGUF type {kind}")
    return TYPES[kind].scales(blocks)


def block_subscales(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                             np.ndarray | None]:
    """A K-quant's (SUB_TYPES) scales and offsets as its blocks hold them: d float32 [n_blocks], sub int8
    [n_blocks, groups per block], and for the types with offsets −dmin [n_blocks] and its sub; d·sub and
    −dmin·sub in float32 are `block_scales`' numbers bit for bit."""
    if kind not in TYPES or TYPES[kind].subscales is None:
        raise ValueError(f"no sub-scales for GGUF type {kind}")
    return TYPES[kind].subscales(blocks)


def codes_from_weight(weight: Tensor, scale: Tensor, offset: Tensor | None, kind: str) -> Codes | None:
    """The codes of `weight` [N,K] under per-group `scale`/`offset` [N,K/G], or None when they do not give the
    weight back exactly (another row order, or not this format's numbers)."""
    n, k = weight.shape
    g = k // scale.shape[1]
    w = weight.detach().float().view(n, -1, g)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)[..., None]
    centred = w - offset[..., None] if offset is not None else w
    q = torch.round(centred / safe)
    if q.abs().max() > 127 if q.numel() else False:
        return None
    codes = Codes(q.to(torch.int8).view(n, k), scale.contiguous(), None if offset is None else offset.contiguous(),
                  kind)
    return codes if torch.equal(codes.dequantize(), weight.detach().float()) else None


def _row_order(gguf_rows: Tensor, weight: Tensor) -> Tensor | None:
    """perm with gguf_rows[perm] == weight (rows matched by their bytes), or None."""
    where: dict[bytes, list[int]] = {}
    for i, row in enumerate(gguf_rows.numpy()):
        where.setdefault(row.tobytes(), []).append(i)
    perm = []
    for row in weight.detach().float().numpy():
        hits = where.get(row.tobytes())
        if not hits:
            return None
        perm.append(hits.pop())
    return torch.tensor(perm)


def _tensor_codes(t: Any, weight: Tensor) -> Codes | None:
    """Codes for the GGUF tensor `t` that reproduce `weight` exactly, or None."""
    kind = t.tensor_type.name
    if kind not in BLOCKS:
        return None
    per_block, nbytes, group = BLOCKS[kind]
    n, k = weight.shape
    data = np.asarray(t.data)
    if data.dtype != np.uint8 or data.size != n * (k // per_block) * nbytes or k % per_block:
        return None
    blocks = data.reshape(n * (k // per_block), nbytes)
    s, o = block_scales(kind, blocks)
    scale = torch.from_numpy(s.reshape(n, k // group))
    offset = None if o is None else torch.from_numpy(o.reshape(n, k // group))
    codes = codes_from_weight(weight, scale, offset, kind)
    if codes is not None:
        return codes
    # rows reordered by the converter (Llama's q/k): find the order from the dequantised rows
    from gguf.quants import dequantize

    rows = torch.from_numpy(np.asarray(dequantize(data, t.tensor_type), dtype=np.float32).reshape(n, k))
    perm = _row_order(rows, weight)
    if perm is None:
        return None
    return codes_from_weight(weight, scale[perm], None if offset is None else offset[perm], kind)


def gguf_codes(gguf: Path, hf_model, progress: Any = None) -> dict[str, Codes]:
    """Codes for every matrix of `hf_model` (transformers' model loaded from the GGUF file `gguf`) that the
    file stores in a supported format and whose codes give back the model's weight exactly.

    Keys: "embed_tokens", "lm_head" (when untied), "layers.{i}.self_attn.q_proj", ... (module paths under
    the base model, as in transformers)."""
    from gguf import GGUFReader

    base = hf_model.base_model
    reader = GGUFReader(str(gguf))
    out: dict[str, Codes] = {}
    modules = dict(base.named_modules())
    head = hf_model.get_output_embeddings()
    tied = head is not None and head.weight is base.embed_tokens.weight
    for i, t in enumerate(reader.tensors):
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            key, weight = "embed_tokens", base.embed_tokens.weight
        elif t.name == "output.weight" and head is not None and not tied:
            key, weight = "lm_head", head.weight
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEARS and parts[3] == "weight":
            key = f"layers.{parts[1]}.{_LINEARS[parts[2]]}"
            module = modules.get(key)
            if module is None:
                continue
            weight = module.weight
        else:
            continue
        if weight.dim() != 2:
            continue
        codes = _tensor_codes(t, weight)
        if codes is not None:
            out[key] = codes
        if progress is not None:
            progress(i + 1, len(reader.tensors))
    return out


# --- the cache ----------------------------------------------------------------------------------------------

def _path(model: Any) -> Path | None:
    return cache.derived_path(getattr(model, "path", None), "codes", f"v{FORMAT}")


def _gguf_of(model: Any, workdir: Path) -> Path | None:
    """The GGUF file the cached model was converted from (assembled into `workdir` for a named model), or None
    when it is gone or changed since."""
    from lmhead.models.registry import MODELS

    try:
        manifest = json.loads((Path(model.path) / "manifest.json").read_text())
        source = manifest.get("source", {})
        if "gguf_path" in source:
            path = Path(source["gguf_path"])
            st = path.stat()
            if st.st_size != source.get("gguf_size") or st.st_mtime_ns != source.get("gguf_mtime_ns"):
                return None
            return path
        spec = MODELS.get(manifest.get("name", ""))
        if spec is None:
            return None
        spec.require()
        return spec.gguf(workdir)
    except Exception:
        return None


def _to_state(codes: dict[str, Codes]) -> tuple[dict[str, Tensor], dict[str, str]]:
    state, kinds = {}, {}
    for key, c in codes.items():
        state[f"{key}.codes"], state[f"{key}.scale"] = c.codes, c.scale
        if c.offset is not None:
            state[f"{key}.offset"] = c.offset
        kinds[key] = c.kind
    return state, kinds


def _from_state(state: dict[str, Tensor], kinds: dict[str, str]) -> dict[str, Codes]:
    return {key: Codes(state[f"{key}.codes"], state[f"{key}.scale"], state.get(f"{key}.offset"), kind)
            for key, kind in kinds.items()}


def codes_for_model(model: Any, build: bool = True, progress: bool = True) -> dict[str, Codes]:
    """The codes of a `Model` loaded from lmhead's cache: read from `<cache>/codes/`, else (with `build`) made
    from its GGUF file and written there. {} for models that have none (HF folders, a GGUF file gone since,
    formats without codes). Every stored matrix is checked again against the model's weight when used
    (`module_codes`), so a stale or damaged file costs speed, never a wrong number."""
    path = _path(model)
    if path is None:
        return {}
    stored = cache.read_tensors(path)
    if stored is not None:
        state, meta = stored
        try:
            return _from_state(state, json.loads(meta.get("lmhead.kinds", "{}")))
        except (KeyError, ValueError):
            pass
    if not build:
        return {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lmhead-codes-") as work:
        gguf = _gguf_of(model, Path(work))
        if gguf is None:
            return {}
        if progress:
            print(f"lmhead: storing {model.name}'s GGUF codes for the fast decode step (once; {path.parent})",
                  file=sys.stderr, flush=True)
        codes = gguf_codes(gguf, model.hf_model)
    state, kinds = _to_state(codes)
    cache.write_tensors(path, state, {"lmhead.kinds": json.dumps(kinds)})
    if progress:
        print(f"lmhead: {len(codes)} matrices stored as codes in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    return codes


def module_codes(codes: dict[str, Codes], key: str, weight: Tensor) -> Codes | None:
    """codes[key] if it gives back `weight` exactly (checked: a cache file from another model, or weights
    changed in place since, fall back to the float32 product), else None."""
    c = codes.get(key)
    if c is None or tuple(c.codes.shape) != tuple(weight.shape):
        return None
    return c if torch.equal(c.dequantize(), weight.detach().float()) else None


def fuse_codes(parts: list[Codes]) -> Codes:
    """The codes of the row-wise concatenation of `parts` (q, k, v → qkv): one group size (the smallest; a
    larger group's scale is repeated, which changes no weight) and zero offsets where a part has none."""
    if len(parts) == 1:
        return parts[0]
    group = min(p.group for p in parts)
    scales, offsets = [], []
    for p in parts:
        rep = p.group // group
        scales.append(p.scale.repeat_interleave(rep, dim=1))
        offsets.append(None if p.offset is None else p.offset.repeat_interleave(rep, dim=1))
    offset = None
    if any(o is not None for o in offsets):
        offset = torch.cat([o if o is not None else torch.zeros_like(s) for o, s in zip(offsets, scales, strict=True)])
    return Codes(torch.cat([p.codes for p in parts]), torch.cat(scales), offset, "+".join(p.kind for p in parts))
