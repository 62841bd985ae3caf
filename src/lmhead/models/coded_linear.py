"""Linear layers over a GGUF file's own codes: the float32 model's product, reading a quarter of the bytes.

    W [N,K] float32 (dequantised from the GGUF file)  ==  scale[n,g] · code[n,k] + offset[n,g]   (exactly)
    x [M,K] ──coded_kernel.c (int8 codes, one scale/offset per group of 16 or 32)──▶ y [M,N] float32

Why: the packaged models' float32 weights are GGUF blocks decoded (Q4_K, Q5_0, Q6_K, Q8_0, Q4_1): every weight
is a small integer times its group's scale, plus its group's offset. A decode step is a matrix-vector product
per layer, and on a CPU it waits for memory: float32 reads 4 bytes per weight, these codes 0.6–1.1. The numbers
are the same — the codes give back the float32 matrix weight for weight (`models/gguf_codes.py` checks it
when it builds them) — so the product equals the float32 one up to the order of float32 additions.

The kernel is C (`coded_kernel.c`: AVX2/FMA where the machine has it, else plain loops the compiler
vectorises), built once per machine with the system C compiler (`kernels/native.py`) and called with ctypes;
torch ships no kernel for grouped int8 codes × float32 activations (its int4/int8 weight-only ops
quantise differently and measured slower than float32 on this machine: benchmarks/bench_body.py). Without a
compiler `coded_available()` is False and the float32 weights are used — same numbers, slower.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import Tensor

from lmhead import checks
from lmhead.kernels import layout16, native
from lmhead.kernels.abi import NO_MEMORY
from lmhead.kernels.layout4 import level_indices
from lmhead.models.groups16 import eligible as eligible_by_groups
from lmhead.models.quant_types import LAYOUT_FLAGS, LEVELS, e8m0_numbers

__all__ = ["SCREEN_CAP", "CodedLinear", "SubScales", "coded_available", "coded_product"]

SCREEN_CAP = 4096  # `CodedLinear.screen`: a row with more candidates than this is computed exactly whole


def _call(lib: ctypes.CDLL, x: Tensor, codes: Tensor, scale: Tensor, offset: Tensor | None, group: int,
          flags: int) -> Tensor:
    """x [..., K] contiguous → y [..., N]: the rows of x as one [M,K] matrix, with no reshape or view around the
    call (after a decode step each torch operation costs ~50 µs on the caches it leaves)."""
    k = x.shape[-1]
    n = codes.shape[0]
    m = x.numel() // k if k else 0
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    rc = lib.lmhead_coded_matmul(x.data_ptr(), m, k, codes.data_ptr(), None if scale is None else scale.data_ptr(),
                                 None if offset is None else offset.data_ptr(), n, group, flags, y.data_ptr(),
                                 torch.get_num_threads())
    if rc == NO_MEMORY:
        raise MemoryError(f"the coded kernel could not allocate its buffers for x {tuple(x.shape)}")
    if rc != 0:
        raise ValueError(f"coded kernel rejected the shapes x {tuple(x.shape)}, codes {tuple(codes.shape)}, "
                         f"group {group}")
    return y


def coded_product(x: Tensor, codes: Tensor, scale: Tensor | None, offset: Tensor | None, group: int,
                  flags: int) -> Tensor:
    """x [..., K] float32 → [..., N]: the coded kernel on tensors already in its layout (`CodedLinear.flags`'
    meaning; a slice of a layer's experts, `expert_layout.ExpertMatrices`), without an object around them.
    RuntimeError where the kernel is not built (`coded_available()` False)."""
    lib = native.library()
    if lib is None:
        raise RuntimeError("the coded kernel is not built on this machine")
    return _call(lib, x if x.is_contiguous() else x.contiguous(), codes, scale, offset, group, flags)


def coded_available() -> bool:
    """True when the kernel is built (or builds now) for this machine and passes its self-test."""
    return native.library() is not None


class SubScales:
    """Group scales (or offsets) [N, K/G] as a K-quant file holds them (the kernel's SUB layout): float32 `d`
    [N, K/256] — a block's d, or −dmin — and int8 `sub` [N, K/G], each group's value the float32 product
    d·sub (`gguf_codes.block_subscales`). One byte per group and four per 256 weights, where float32 numbers
    take four per group. `buffer` holds both, d first, as the kernel reads them; filled by the caller."""

    def __init__(self, n: int, k: int, group: int) -> None:
        if k % 256 or group not in (16, 32):
            raise ValueError(f"sub-scales need K a multiple of 256 and groups of 16 or 32, got K={k}, G={group}")
        self._views(torch.empty(n * (k // 256 * 4 + k // group), dtype=torch.uint8), n, k, group)

    @classmethod
    def over(cls, buffer: Tensor, n: int, k: int, group: int) -> SubScales:
        """Sub-scales over an existing `buffer` (uint8, d then sub, as `__init__` lays them out; a slice of a
        layer's experts' buffer), no copy."""
        self = cls.__new__(cls)
        self._views(buffer, n, k, group)
        return self

    def _views(self, buffer: Tensor, n: int, k: int, group: int) -> None:
        nsup, ng = k // 256, k // group
        self.buffer = buffer
        self.d = buffer[:n * nsup * 4].view(torch.float32).view(n, nsup)
        self.sub = buffer[n * nsup * 4:].view(torch.int8).view(n, ng)
        self.shape = (n, ng)

    def floats(self) -> Tensor:
        """The float32 numbers [N, K/G] they stand for."""
        return self.d.repeat_interleave(self.shape[1] // self.d.shape[1], dim=1) * self.sub.float()


def _as_half(t: Tensor | None, rows: int = 4096) -> Tensor | None:
    """`t` as float16 where each of its float32 numbers is a float16 number, else None; checked a few rows at a
    time (a large embedding's scales: no whole float32 copy beside them)."""
    if t is None:
        return None
    h = t.to(torch.float16).contiguous()
    for start in range(0, t.shape[0], rows):
        if not torch.equal(h[start:start + rows].float(), t[start:start + rows]):
            return None
    return h


class CodedLinear:
    """y = x·Wᵀ for W [N,K] given as int8 `codes` [N,K], float32 `scale` [N,K/G] and optional `offset`
    [N,K/G] (W = scale·code + offset per group of G). x [..., K] float32 → [..., N] float32.

    Holds its own tensors (the codes are 1 byte per weight, half a byte where they are 4-bit; `dense16`
    holds a file's float16, bfloat16 or float32 weights instead, with no scales).
    `weight`, when given, is the float32 matrix they encode (the model's, shared) and `sources` the model's
    tensors it is made of (default: `weight`): once
    any of them changes in place (an optimizer step: autograd's version counter), or autograd records, or the
    kernel is unavailable, the product is `F.linear` on `weight` — the codes never answer for other numbers.
    """

    def __init__(self, codes: Tensor, scale: Tensor, offset: Tensor | None = None, weight: Tensor | None = None,
                 sources: tuple[Tensor, ...] | None = None, four_bit: str | None = "auto", groups16: bool = False,
                 plane: str | None = None):
        """`four_bit`: how 4-bit codes are stored two per byte (half the bytes to read again) — "unsigned" (codes
        0..15: Q4_1, Q4_K), "signed" (−8..7: Q4_0; Q3_K's −4..3 and Q2_K's 0..3 in groups of 16, Q2_K's with
        offsets), the name of a level table (`quant_types.LEVELS`: "iq4", IQ4_NL's levels — IQ4_NL, IQ4_XS —,
        "mxfp4"; without offsets), None (one byte per code), or "auto": signed where the codes are in −8..7, else
        unsigned where they are in 0..15. Where the shape does not allow it (groups of 16 or 32, K a multiple of
        64) the codes stay one per byte. `groups16`: the integer path by groups' layout where the matrix is
        eligible for it (`models/groups16.py`); there `plane` (`layout16.PLANES`: "unsigned5", "signed6", ...)
        holds 5- or 6-bit codes in fewer bytes (ValueError for codes outside its range)."""
        if codes.dtype != torch.int8 or codes.dim() != 2:
            raise TypeError(f"codes must be a 2-D int8 tensor, got {codes.dtype} {tuple(codes.shape)}")
        n, k = codes.shape
        if scale.dim() != 2 or scale.shape[0] != n or scale.shape[1] == 0 or k % scale.shape[1] != 0:
            raise ValueError(f"scale must be [{n}, K/G] with G dividing K = {k}, got {tuple(scale.shape)}")
        self.group = k // scale.shape[1]
        if self.group % 16 != 0:
            raise ValueError(f"the group size must be a multiple of 16, got {self.group}")
        if offset is not None and offset.shape != scale.shape:
            raise ValueError(f"offset must have scale's shape {tuple(scale.shape)}, got {tuple(offset.shape)}")
        if weight is not None and tuple(weight.shape) != (n, k):
            raise ValueError(f"weight must be [{n}, {k}] like the codes, got {tuple(weight.shape)}")
        if four_bit == "auto":
            low, high = (int(codes.min()), int(codes.max())) if codes.numel() else (0, 255)
            four_bit = ("signed" if low >= -8 and high <= 7 else "unsigned" if low >= 0 and high <= 15 else None)
        four_bit = self._four_bit(k, offset, four_bit, plane)
        plane = None if four_bit is not None else plane
        if groups16 and self._by_groups(lambda: layout16.lay_out(codes, four_bit, plane), four_bit, n, k, scale,
                                        offset, weight, sources, plane):
            return
        codes = _pack(codes, four_bit) if four_bit else codes.contiguous()
        rows4 = self._rows4(n, k, self.group, four_bit is not None)
        self._finish(native.block4(codes) if rows4 else codes, four_bit, rows4, n, k, scale, offset, weight,
                     sources)

    def _four_bit(self, k: int, offset: Tensor | None, four_bit: str | None, plane: str | None = None) -> str | None:
        """`four_bit` where this matrix can be stored so (groups of 16 or 32, K a multiple of 64; a level table's
        codes without offsets), else None; ValueError for a name that is none of them, or a `plane` name that is
        none of `layout16.PLANES`."""
        if four_bit is not None and four_bit not in LAYOUT_FLAGS:
            raise ValueError(f"four_bit must be None, 'auto' or one of {sorted(LAYOUT_FLAGS)}, got {four_bit!r}")
        if plane is not None and plane not in layout16.PLANES:
            raise ValueError(f"plane must be None or one of {sorted(layout16.PLANES)}, got {plane!r}")
        return self.layout(0, k, self.group, four_bit, offset is not None)[0]

    def _by_groups(self, lay: Callable[[], Tensor], four_bit: str | None, n: int, k: int,
                   scale: Tensor | SubScales, offset: Tensor | SubScales | None, weight: Tensor | None,
                   sources: tuple[Tensor, ...] | None, plane: str | None = None) -> bool:
        """Take the codes in the integer path by groups' layout (`lay()`: `layout16.lay_out`'s bytes, asked for
        once the rest is known to fit) where the matrix is eligible and its scales (and offsets) are float16
        numbers (MXFP4's powers of two held as their exponent bytes) or a K-quant's sub-scales; whether it did."""
        if not eligible_by_groups(n, k, self.group, four_bit, isinstance(scale, SubScales)):
            return False
        if isinstance(scale, SubScales):
            if offset is not None and not isinstance(offset, SubScales):
                return False
            # the laid-out buffers, carried as SubScales for their `buffer` alone (what the kernel and the layout
            # cache read; its d and sub views are the blocks' order, not the layout's: `dequantize` reads it back
            # with layout16.subscales_back)
            subs = [None if s is None else SubScales.over(layout16.subscales_out(s.d, s.sub), n, k, self.group)
                    for s in (scale, offset)]
            self._finish(lay(), four_bit, False, n, k, subs[0], subs[1], weight, sources, as_is=True,
                         by_groups=True, plane=plane)
            return True
        held = layout16.exponent_bytes(scale) if four_bit == "mxfp4" else None  # a byte a group, as its file's
        held = _as_half(scale.float()) if held is None else held
        half_offset = None if offset is None else _as_half(offset.float())
        if held is None or (offset is not None and half_offset is None):
            return False
        self._finish(lay(), four_bit, False, n, k,
                     layout16.scales_out(held),
                     None if offset is None else layout16.scales_out(half_offset), weight, sources, as_is=True,
                     by_groups=True, plane=plane)
        return True

    @classmethod
    def layout(cls, n: int, k: int, group: int, four_bit: str | None, offset: bool) -> tuple[str | None, bool]:
        """(four_bit, rows4): how codes [N,K] in groups of `group` (with offsets or not) of a type packed as
        `four_bit` are laid out — two a byte where the shape allows it (groups of 16 or 32, K a multiple of 64; a
        level table's codes without offsets), blocked by four rows where it allows that."""
        if group not in (16, 32) or k % 64 or (four_bit in LEVELS and offset):
            four_bit = None
        return four_bit, cls._rows4(n, k, group, four_bit is not None)

    @staticmethod
    def _rows4(n: int, k: int, group: int, packed: bool) -> bool:
        # groups of 32 or 16 in whole blocks of four rows: stored block by block, so that decode reads four rows
        # from one forward stream (coded_kernel.c); a 32-byte unit holds one or two groups of int8 codes, two or
        # four of packed ones
        return bool(n and n % 4 == 0 and group in (16, 32) and k % 32 == 0)

    @classmethod
    def dense16(cls, weights: Tensor) -> CodedLinear:
        """The matrix of a file's float16, bfloat16 or float32 weights [N,K] (F16, BF16, F32), held as they are:
        the kernel converts each 16-bit weight to the float32 number it is (exact) in the product, so the float32
        matrix is never made and half its bytes are read; float32 weights are multiplied as they are."""
        if weights.dtype not in (torch.float16, torch.bfloat16, torch.float32) or weights.dim() != 2:
            raise TypeError(f"weights must be a 2-D float16, bfloat16 or float32 tensor, got {weights.dtype} "
                            f"{tuple(weights.shape)}")
        self = cls.__new__(cls)
        n, k = weights.shape
        self.group = k
        self._finish(weights.contiguous(), None, False, n, k, None, None, None, None)
        return self

    @classmethod
    def from_chunks(cls, n: int, k: int, scale: Tensor | SubScales, offset: Tensor | SubScales | None, chunks,
                    four_bit: str | None, groups16: bool = False, plane: str | None = None) -> CodedLinear:
        """The same object as `CodedLinear(codes, scale, offset, four_bit=four_bit)` for codes [N,K] given as
        `chunks` — (first row, int8 codes [r,K]) in order, r a multiple of 4 but for the last — laid out piece by
        piece into the kernel's layout, so that the whole int8 matrix never exists beside it (a large head read
        from its file). `four_bit` as the constructor's, but never "auto" (the codes come later): the type's
        (`gguf_codes.FOUR_BIT`). scale and offset may be `SubScales` (a K-quant's, held as the file holds them;
        both or neither), filled by the time the chunks end. `plane` as the constructor's."""
        self = cls.__new__(cls)
        self.group = k // scale.shape[1]
        four_bit = self._four_bit(k, offset, four_bit, plane)
        plane = None if four_bit is not None else plane
        if groups16 and eligible_by_groups(n, k, self.group, four_bit, isinstance(scale, SubScales)):
            laid = _lay_out_chunks(n, k, four_bit, chunks, plane)
            if self._by_groups(lambda: laid, four_bit, n, k, scale, offset, None, None, plane):
                return self
            # scales the layout cannot hold: the codes back
            chunks = [(0, layout16.laid_back(laid, n, k, four_bit, plane))]
        rows4 = cls._rows4(n, k, self.group, four_bit is not None)
        out = torch.empty((n, k // 2 if four_bit else k), dtype=torch.int8)
        for start, codes in chunks:
            codes = _pack(codes, four_bit) if four_bit else codes
            out[start:start + codes.shape[0]] = native.block4(codes) if rows4 else codes
        self._finish(out, four_bit, rows4, n, k, scale, offset, None, None)
        return self

    @classmethod
    def from_layout(cls, codes: Tensor, scale: Tensor | SubScales | None, offset: Tensor | SubScales | None,
                    k: int, group: int, four_bit: str | None, rows4: bool, by_groups: bool = False,
                    plane: str | None = None) -> CodedLinear:
        """A matrix over tensors already in the kernel's layout, held as they are (no copy: a slice of a layer's
        experts, `expert_layout.ExpertMatrices`): `codes` [N, K] int8 — [N, K/2] where `four_bit` —, blocked by
        four rows where `rows4`; scale and offset [N, K/G] float16 or float32, or `SubScales`; or `codes` a
        file's float16, bfloat16 or float32 weights [N, K] with no scale (`dense16`'s)."""
        self = cls.__new__(cls)
        self.group = group
        self._finish(codes, four_bit, rows4, codes.shape[0], k, scale, offset, None, None, as_is=True,
                     by_groups=by_groups, plane=plane)
        return self

    def _finish(self, codes: Tensor, four_bit: str | None, rows4: bool, n: int, k: int, scale: Tensor,
                offset: Tensor | None, weight: Tensor | None, sources: tuple[Tensor, ...] | None,
                as_is: bool = False, by_groups: bool = False, plane: str | None = None) -> None:
        """`as_is`: scale and offset kept as given (float16 ones read as float16), not converted. `by_groups`: the
        codes, scales and offsets in the integer path by groups' layout (`models/groups16.py`), 5- or 6-bit codes
        there in `plane`'s layout (`layout16.PLANES`)."""
        self.four_bit, self.packed, self.rows4, self.codes = four_bit, four_bit is not None, rows4, codes
        self.by_groups, self.plane = by_groups, plane if by_groups else None
        self.dense = codes.dtype in (torch.float16, torch.bfloat16, torch.float32)  # `dense16`: no scales
        self.sub = isinstance(scale, SubScales)
        self._subs = (scale, offset) if self.sub else None
        self.weight = weight
        self.sources = tuple(sources) if sources is not None else (() if weight is None else (weight,))
        self.versions = tuple(t._version for t in self.sources)
        self.out_features, self.in_features = n, k
        self._norms: Tensor | None = None  # ‖w_n‖₂ per row for `screen`, made on its first call
        self.e8m0 = False  # scales as MXFP4's exponent bytes (uint8: `native.E8M0`)
        if self.dense:
            self.half, self.scale, self.offset = False, None, None
            return
        if self.sub:
            if offset is not None and not isinstance(offset, SubScales):
                raise TypeError("offset must be SubScales like scale")
            self.half, self.scale = False, scale.buffer
            self.offset = None if offset is None else offset.buffer
            return
        if as_is:
            self.half, self.scale, self.offset = scale.dtype == torch.float16, scale, offset
            self.e8m0 = scale.dtype == torch.uint8
            if self.e8m0 and offset is not None:
                raise TypeError("exponent-byte scales (uint8) have no offsets")
            return
        scale, offset = scale.float(), None if offset is None else offset.float()
        # scales and offsets that are float16 numbers (the d and m of Q4_0/Q4_1/Q5_0/Q8_0 blocks) are kept as
        # float16: the same values, and 1/16 of a byte less per weight to read
        half_scale = _as_half(scale) if scale.shape[1] <= native.HALF_MAX_GROUPS else None
        half_offset = _as_half(offset) if half_scale is not None else None
        self.half = half_scale is not None and (offset is None or half_offset is not None)
        if self.half:
            self.scale, self.offset = half_scale, half_offset
        else:
            self.scale = scale.contiguous()
            self.offset = None if offset is None else offset.contiguous()

    @property
    def flags(self) -> int:
        """The kernel's layout flags (`native.PACKED` with its layout's flag — `quant_types.LAYOUT_FLAGS`:
        `native.SIGNED4` or a level table's —, `native.HALF`, `native.ROWS4`, `native.SUB`; `native.F16`,
        `native.BF16` or `native.F32` for `dense16`'s weights)."""
        if self.dense:
            return {torch.float16: native.F16, torch.bfloat16: native.BF16}.get(self.codes.dtype, native.F32)
        levels = LAYOUT_FLAGS[self.four_bit] if self.packed else 0
        return ((native.PACKED | levels if self.packed else 0) | (native.HALF if self.half else 0)
                | (native.ROWS4 if self.rows4 else 0) | (native.SUB if self.sub else 0)
                | (native.GROUPS16 if self.by_groups else 0) | layout16.plane_flags(self.plane)
                | (native.E8M0 if self.e8m0 else 0))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.offset) if t is not None)

    def current(self) -> bool:
        """Whether the model's tensors are still the numbers the codes encode (not changed in place since)."""
        return tuple(t._version for t in self.sources) == self.versions

    def dequantize(self) -> Tensor:
        """The float32 matrix [N,K] the codes encode."""
        if self.dense:
            return self.codes.float()
        n, k = self.out_features, self.in_features
        if self.by_groups:
            codes = layout16.laid_back(self.codes, n, k, self.four_bit, self.plane)

            def numbers(s: Tensor) -> Tensor:  # a group's scale or offset [N, K/32] float32
                if not self.sub:
                    return layout16.scales_back(s, n, k // self.group)
                d, sub = layout16.subscales_back(s, n, k, self.group)
                return d.repeat_interleave(256 // self.group, dim=1) * sub.float()

            w = codes.float().view(n, -1, self.group) * numbers(self.scale)[..., None]
            if self.offset is not None:
                w = w + numbers(self.offset)[..., None]
            return w.view(n, k)
        codes = native.unblock4(self.codes) if self.rows4 else self.codes
        if self.packed:
            codes = native.unpack4(codes, self.four_bit == "signed")
            if self.four_bit in LEVELS:
                codes = torch.from_numpy(LEVELS[self.four_bit])[codes.long()]
        n, k = codes.shape
        if self.sub:
            scale, offset = self._subs[0].floats(), None if self._subs[1] is None else self._subs[1].floats()
        elif self.e8m0:
            scale, offset = torch.from_numpy(e8m0_numbers(self.scale.numpy())), None
        else:
            scale, offset = self.scale.float(), None if self.offset is None else self.offset.float()
        w = codes.float().view(n, -1, self.group) * scale[..., None]
        if offset is not None:
            w = w + offset[..., None]
        return w.view(n, k)

    def desc(self) -> native.MatDesc:
        """This matrix as the kernels' `lmhead_mat` (pointers into this object's own tensors: keep it alive)."""
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        return native.MatDesc(ptr(self.codes), ptr(self.scale), ptr(self.offset), self.group, self.out_features,
                              self.in_features, self.flags)

    def rows(self, ids: Tensor) -> Tensor:
        """Rows `ids` (int64, any shape S) of the float32 matrix the codes encode → [*S, K]: an embedding lookup
        over the codes (the same numbers as `dequantize()[ids]`). IndexError for an id outside [0, N)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((flat.numel(), self.in_features), dtype=torch.float32)
        lib = native.library()
        if lib is not None:
            if lib.lmhead_coded_rows(ctypes.byref(self.desc()), flat.data_ptr(), flat.numel(), out.data_ptr()) != 0:
                raise IndexError(f"ids must be in [0, {self.out_features}), got {flat.min()}..{flat.max()}")
        else:
            out = self.dequantize()[flat] if self.weight is None else self.weight.detach()[flat].float()
        return out.view(*ids.shape, self.in_features)

    def serves(self, x: Tensor) -> bool:
        """Whether `self(x)` runs the kernel — each row's sum in one fixed order whatever the number of rows or
        threads — rather than torch's F.linear: the kernel built, x float32 on the CPU and wanting no gradient,
        the model's tensors unchanged since the codes were made."""
        return (native.library() is not None and x.dtype == torch.float32 and x.device.type == "cpu"
                and self.current() and not (torch.is_grad_enabled() and x.requires_grad))

    def __call__(self, x: Tensor) -> Tensor:
        if not self.serves(x):
            w = self.weight if self.weight is not None else self.dequantize()
            return torch.nn.functional.linear(x, w)
        return _call(native.library(), x if x.is_contiguous() else x.contiguous(), self.codes, self.scale,
                     self.offset, self.group, self.flags)

    @property
    def screens(self) -> bool:
        """Whether `screen` serves this matrix: int8 codes without offsets in groups of 32 with float16 scales (Q8_0
        and Q5_0 codes: both packaged models' heads are Q8_0), in blocks of four rows (the kernel built with AVX2)
        or in the integer path by groups' layout (kernels/groups_screen.h)."""
        lib = native.library()
        return (lib is not None and native.avx2() and (self.rows4 or self.by_groups) and self.plane is None
                and self.screened_codes(self.group, self.half, self.packed, self.offset is not None))

    @staticmethod
    def screened_codes(group: int, half: bool, packed: bool, offset: bool) -> bool:
        """Whether codes of this kind are the screen's (`screens`): int8 codes a byte each in groups of 32 with
        float16 scales and no offsets."""
        return group == 32 and half and not packed and not offset

    def _screen_kernels(self) -> tuple:
        """The library's (norms, screen, rescore) entries for this matrix's layout."""
        lib = native.library()
        if self.by_groups:
            return lib.lmhead_screen_norms16, lib.lmhead_screen16, lib.lmhead_screen_rescore16
        return lib.lmhead_screen_norms, lib.lmhead_screen, lib.lmhead_screen_rescore

    def screen(self, x: Tensor, ks: list[int], cap: int = SCREEN_CAP) -> Tensor:
        """x [M,K] float32 → y [M,N] float32 where each row's top ks[m] values (ids and values; 1 ≤ k ≤ 256) are
        exactly the one-row product's (`self(x[m:m+1])`) and every value that is not exact is strictly below
        them: what a greedy or top-k choice reads, at about 0.6 of the exact product's arithmetic over several
        rows.

        The approximate values come from x on integer grids, bounded by ‖w_n‖₂·β (coded_kernel.c's screen);
        the tokens whose bound reaches a row's k-th largest lower bound get their exact values. A row with
        more than `cap` such candidates is computed exactly whole (`self(x[m:m+1])`); where the screen does not
        serve (`screens` False, another dtype or device, a weight changed in place, a value of x that is not
        finite, a row of x all below 2⁻⁶⁰ in magnitude) every value is exact (`self(x)`). ValueError for ks out of
        range."""
        return self.screen_candidates(x, ks, cap)[0]

    def screen_candidates(self, x: Tensor, ks: list[int], cap: int = SCREEN_CAP,
                          allowed: list[Tensor | None] | None = None
                          ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """`screen`'s y and its candidates: values [M,c] and ids [M,c] (ascending; c the most any row has, a
        shorter row padded with -inf and id N), the exact values of every token that can be in a row's top ks[m]
        — so a choice that reads only those reads the candidates alone. None where a row was computed whole or
        the screen did not serve.

        allowed [M] (bool [N] per row, or None: every token): a row's forbidden values are -inf in y before its
        candidates are chosen, so they are its top ks[m] among the allowed tokens (fewer where fewer are
        allowed) — a constrained row's choice, screened as a free row's. ValueError where a row allows none."""
        lib = native.library()
        m, k = x.shape
        n = self.out_features
        if len(ks) != m or any(not checks.is_int(v) or not 1 <= v <= min(256, n) for v in ks):
            raise ValueError(f"ks: one int in [1, {min(256, n)}] per row of x ({m}), got {ks!r}")
        left = self._allowed_counts(allowed, m)
        if not self.screens or x.dtype != torch.float32 or x.device.type != "cpu" or not self.current():
            # every value exact (a weight changed in place: its own numbers, as `__call__`)
            return _forbid(self(x), allowed), None
        x = x.contiguous()
        threads = torch.get_num_threads()
        screen_norms, screen_values, rescore = self._screen_kernels()
        if self._norms is None:
            norms = torch.empty(n, dtype=torch.float32)
            if screen_norms(self.codes.data_ptr(), self.scale.data_ptr(), n, k, norms.data_ptr(), threads) != 0:
                raise ValueError(f"screen: codes {tuple(self.codes.shape)} are not a screened layout")
            self._norms = norms
        y = torch.empty((m, n), dtype=torch.float32)
        beta = torch.empty(m, dtype=torch.float64)
        rc = screen_values(x.data_ptr(), m, k, self.codes.data_ptr(), self.scale.data_ptr(), n, y.data_ptr(),
                           beta.data_ptr(), threads)
        if rc == -2:
            raise MemoryError("the screen could not allocate its grid")
        if rc != 0:  # a row that is not all finite: no bound holds anywhere, every row exactly
            return _forbid(self(x), allowed), None
        _forbid(y, allowed)
        # a row allowing fewer than its k tokens wants them all: its k-th largest would be -inf, every token a
        # candidate and the row computed whole
        want = torch.tensor([int(v) if c is None else min(int(v), c) for v, c in zip(ks, left, strict=True)],
                            dtype=torch.int64)
        ids = torch.empty((m, cap), dtype=torch.int64)
        counts = torch.empty(m, dtype=torch.int64)
        lib.lmhead_screen_select(y.data_ptr(), m, n, self._norms.data_ptr(), beta.data_ptr(), want.data_ptr(), cap,
                                 ids.data_ptr(), counts.data_ptr(), threads)
        if rescore(x.data_ptr(), m, k, self.codes.data_ptr(), self.scale.data_ptr(), n, ids.data_ptr(),
                   counts.data_ptr(), cap, y.data_ptr(), threads) == -2:
            raise MemoryError("the screen could not allocate a row's slices")
        whole = (counts < 0).nonzero().flatten().tolist()
        for r in whole:
            y[r] = self(x[r:r + 1])[0]
            _forbid(y[r:r + 1], None if allowed is None else allowed[r:r + 1])
        if whole:
            return y, None
        width = int(counts.max())
        pad = torch.arange(width) >= counts[:, None]                                          # [M,c]
        ids = ids[:, :width].masked_fill(pad, n)
        vals = y.gather(1, ids.clamp(max=n - 1)).masked_fill_(pad, float("-inf"))
        return y, (vals, ids)

    def values_at(self, x: Tensor, ids: list[Tensor]) -> Tensor | None:
        """x [M,K] float32 → y [M,N] float32: -inf except at each row's ids (int64 [c_m], ascending, c_m ≥ 1),
        which hold the one-row product's exact values (`self(x[m:m+1])`'s, from the screen's rescoring pass): a
        constrained row's logits where its mask allows few tokens, at the cost of those rows of the matrix. None
        where the screen's kernels do not serve this matrix (`screens` False, another dtype or device, a weight
        changed in place); ValueError for ids out of range."""
        if not self.screens or x.dtype != torch.float32 or x.device.type != "cpu" or not self.current():
            return None
        m, k = x.shape
        n = self.out_features
        if len(ids) != m:
            raise ValueError(f"ids: one tensor per row of x ({m}), got {len(ids)}")
        counts = torch.tensor([len(i) for i in ids], dtype=torch.int64)
        cap = int(counts.max()) if m else 0
        table = torch.zeros((m, max(cap, 1)), dtype=torch.int64)
        for r, i in enumerate(ids):
            if len(i) == 0 or int(i.min()) < 0 or int(i.max()) >= n:
                raise ValueError(f"ids[{r}]: expected 1 or more ids in [0, {n}), got {len(i)} ids")
            table[r, :len(i)] = i
        x = x.contiguous()
        y = torch.full((m, n), float("-inf"), dtype=torch.float32)
        rc = self._screen_kernels()[2](x.data_ptr(), m, k, self.codes.data_ptr(), self.scale.data_ptr(), n,
                                       table.data_ptr(), counts.data_ptr(), table.shape[1], y.data_ptr(),
                                       torch.get_num_threads())
        return y if rc == 0 else None

    def _allowed_counts(self, allowed: list[Tensor | None] | None, m: int) -> list[int | None]:
        """How many tokens each row of `allowed` keeps (None: every token); ValueError for a wrong shape or a row
        that keeps none."""
        if allowed is None:
            return [None] * m
        n = self.out_features
        if len(allowed) != m:
            raise ValueError(f"allowed: one entry per row of x ({m}), got {len(allowed)}")
        counts: list[int | None] = []
        for r, a in enumerate(allowed):
            if a is None:
                counts.append(None)
                continue
            if not isinstance(a, Tensor) or a.dtype != torch.bool or a.shape != (n,):
                raise ValueError(f"allowed[{r}]: expected a bool tensor of shape ({n},), got "
                                 f"{getattr(a, 'dtype', type(a).__name__)} {tuple(getattr(a, 'shape', ()))}")
            c = int(a.sum())
            if c == 0:
                raise ValueError(f"allowed[{r}] keeps no token")
            counts.append(c)
        return counts

    def __repr__(self) -> str:
        if self.dense:
            return (f"CodedLinear(in_features={self.in_features}, out_features={self.out_features}, "
                    f"weights={self.codes.dtype})")
        return (f"CodedLinear(in_features={self.in_features}, out_features={self.out_features}, "
                f"group={self.group}, offset={self.offset is not None}, four_bit={self.four_bit}, half={self.half}, "
                f"sub={self.sub}, "
                f"rows4={self.rows4})")


_RANGES = {"unsigned": (0, 15), "signed": (-8, 7)}  # the codes each 4-bit layout holds


def _lay_out_chunks(n: int, k: int, four_bit: str | None, chunks, plane: str | None = None) -> Tensor:
    """`layout16.lay_out` of codes [N,K] given as `CodedLinear.from_chunks`' chunks (consecutive rows), laid out
    sixteen rows at a time as they come — a block's bytes depend on its own rows only — so that the whole int8
    matrix never exists beside its layout (N a multiple of 16)."""
    laid = torch.empty((n, layout16.row_bytes(k, four_bit, plane)), dtype=torch.uint8)
    pending, at = None, 0  # rows read but not laid out yet (fewer than sixteen), from row `at`
    for start, codes in chunks:
        if codes.shape[0] == 0:
            continue
        if start != at + (0 if pending is None else pending.shape[0]):
            raise ValueError(f"from_chunks: chunks must come in row order, got row {start}")
        rows = codes if pending is None else torch.cat([pending, codes])
        whole = rows.shape[0] // 16 * 16
        if whole:
            laid[at:at + whole] = layout16.lay_out(rows[:whole], four_bit, plane)
        pending, at = (rows[whole:].clone() if whole < rows.shape[0] else None), at + whole
    if pending is not None or at != n:
        raise ValueError(f"from_chunks: chunks cover {at + (0 if pending is None else pending.shape[0])} of {n} rows")
    return laid


def _pack(codes: Tensor, four_bit: str) -> Tensor:
    """int8 codes [N,K] → `native.pack4`'s layout of them (a level table's: of their indices); ValueError for codes
    the layout does not hold (packed, they would be other numbers)."""
    if four_bit in LEVELS:
        return native.pack4(torch.from_numpy(level_indices(codes.contiguous().numpy(), four_bit)).view(torch.int8))
    low, high = _RANGES[four_bit]
    if codes.numel() and not (low <= int(codes.min()) and int(codes.max()) <= high):
        raise ValueError(f"four_bit={four_bit!r}: codes must be in [{low}, {high}], got "
                         f"{int(codes.min())}..{int(codes.max())}")
    return native.pack4(codes, four_bit == "signed")


def _forbid(y: Tensor, allowed: list[Tensor | None] | None) -> Tensor:
    """y [M,N], in place: -inf where a row's `allowed` [N] is False (rows with None untouched)."""
    if allowed is not None:
        for r, a in enumerate(allowed):
            if a is not None:
                y[r].masked_fill_(~a, float("-inf"))
    return y
