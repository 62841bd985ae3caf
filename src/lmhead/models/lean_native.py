"""The lean body's native marshalling: its layers as the C step's descriptors, and the calls into the kernels.

    LeanBody (the torch forward, `lean.py`: the specification) ──_step_descs──▶ native.LayerDesc per layer
        ──lmhead_decode / lmhead_step / lmhead_attend (kernels/)──▶ the same numbers in one call
    (a layer with experts: the step calls `_route_fn`'s callback — the layer's own `MoE.route` in torch — for
     its chosen experts, then runs them in one experts_kernel call)

Each method returns None where the C path does not serve (no library, autograd recording, a layout or activation
it does not take, a layer it has no descriptor for — `_in_step`: a matrix without codes, experts of float
tensors); `LeanBody.forward` then runs the torch forward, which every path is tested against.
"""

from __future__ import annotations

import ctypes
import threading

import torch
from torch import Tensor

from lmhead.kernels import experts as experts_kernel
from lmhead.kernels import native
from lmhead.kernels.abi import NO_MEMORY, SharedArgs
from lmhead.models.coded_linear import CodedLinear
from lmhead.models.expert_layout import ExpertMatrices
from lmhead.models.kv_cache import StaticCache
from lmhead.models.row_blocks import RowBlocks

__all__ = ["NativeStep"]


class NativeStep:
    """The C paths of `LeanBody` (a base class of it: the methods read the body's configuration and layers)."""

    def _native(self, *tensors: Tensor):
        """The C library for the element-wise work (`kernels/native.py`), or None: not built, autograd recording
        (callers may differentiate through the result), or tensors that are not float32 on the CPU."""
        if self.native is None or torch.is_grad_enabled():
            return None
        for t in tensors:
            if t.dtype != torch.float32 or t.device.type != "cpu":
                return None
        return self.native


    def _step_descs(self):
        """The layers as `native.LayerDesc`s for `lmhead_step` (built once; None when a block matrix has no
        codes), and the tensors they point into (kept alive with them)."""
        if getattr(self, "_descs", None) is None:
            if not all(self._in_step(layer) for layer in self.layers):
                return None
            keep: list = []  # tensors and chained descriptors the layers point into

            def ptr(t: Tensor | None) -> int | None:
                if t is None:
                    return None
                t = t.detach().contiguous()
                keep.append(t)
                return t.data_ptr()

            def mat(c: CodedLinear | RowBlocks) -> native.MatDesc:
                if isinstance(c, RowBlocks):  # the first block's, the rest chained behind it (kept alive)
                    first, chained = c.desc()
                    keep.append(chained)
                    return first
                return native.MatDesc(ptr(c.codes), ptr(c.scale), ptr(c.offset), c.group, c.out_features,
                                      c.in_features, c.flags)

            descs = (native.LayerDesc * len(self.layers))()
            for d, layer in zip(descs, self.layers, strict=True):
                d.qkv, d.o = mat(layer.coded["qkv"]), mat(layer.coded["o"])
                d.qkv_bias, d.input_norm = ptr(layer.qkv_bias), ptr(layer.input_norm)
                d.post_attn_norm, d.pre_mlp_norm = ptr(layer.post_attn_norm), ptr(layer.pre_mlp_norm)
                d.post_mlp_norm = ptr(layer.post_mlp_norm)
                d.qk_norm = ptr(self._qk_norm(layer)) if layer.q_norm is not None else None
                d.rope, d.sliding = self.layer_types.index(layer.kind), int(layer.sliding)
                d.o_bias, d.sinks = ptr(layer.o_bias), ptr(layer.sinks)
                moe = layer.moe
                if moe is not None:  # the router called back (`_route_fn`), the chosen experts in one call
                    gu, dn = moe.gate_up.desc, moe.down.desc
                    keep += [gu, dn]
                    d.experts_gate_up, d.experts_down = ctypes.addressof(gu), ctypes.addressof(dn)
                    d.experts_gate_up_bias, d.experts_down_bias = ptr(moe.gate_up_bias), ptr(moe.down_bias)
                    d.top_k = moe.top_k
                    d.experts_act, d.alpha, d.limit = moe.kernel_act(self.act_code)
                    if moe.shared_gate_up is not None:
                        d.shared_gate_up, d.shared_down = mat(moe.shared_gate_up), mat(moe.shared_down)
                else:
                    d.gate_up, d.down = mat(layer.coded["gate_up"]), mat(layer.coded["down"])
            keep.append(self.final_norm.detach())
            self._descs = (descs, keep, self._weight_versions())
        return self._descs

    @staticmethod
    def _in_step(layer) -> bool:
        """Whether `lmhead_step` runs this layer: q/k/v and o of codes (their biases, sinks float32), and a dense
        MLP of codes or a mixture whose experts the experts kernel takes in one call (its shared expert of codes)."""
        coded = layer.coded or {}
        if "qkv" not in coded or "o" not in coded:
            return False
        if any(t is not None and t.dtype != torch.float32 for t in (layer.qkv_bias, layer.o_bias, layer.sinks)):
            return False
        moe = layer.moe
        if moe is None:
            return "gate_up" in coded and "down" in coded
        coded_shared = moe.shared_gate_up is None or all(
            isinstance(m, (CodedLinear, RowBlocks)) for m in (moe.shared_gate_up, moe.shared_down))
        return (isinstance(moe.gate_up, ExpertMatrices) and isinstance(moe.down, ExpertMatrices) and coded_shared
                and experts_kernel.available()
                and all(b is None or b.dtype == torch.float32 for b in (moe.gate_up_bias, moe.down_bias)))

    def _route_fn(self) -> int | None:
        """The address of the C step's router callback (`lmhead_route_fn`: each layer's own `MoE.route` on the
        step's h, the same bits as the step-by-step path's), None for a model without experts. Made once; an
        exception inside it is kept in `_route_error` and raised by the caller after the step."""
        made = self.__dict__.get("_route")
        if made is not None:
            return made[1]
        fn = None
        if any(layer.moe is not None for layer in self.layers):
            layers, width = self.layers, self.width

            def route(i: int, h: int, rows: int, chosen: int, weights: int, shared: int | None) -> int:
                try:
                    moe = layers[i].moe
                    x = torch.frombuffer((ctypes.c_float * (rows * width)).from_address(h),
                                         dtype=torch.float32).view(rows, width)
                    r = moe.route(x)
                    if shared is not None:  # the shared expert's gate, as `MoE.__call__` computes it
                        torch.frombuffer((ctypes.c_float * rows).from_address(shared), dtype=torch.float32).copy_(
                            moe.shared_weight(x).reshape(-1))
                    n = rows * moe.top_k
                    torch.frombuffer((ctypes.c_int64 * n).from_address(chosen), dtype=torch.int64).copy_(
                        r.experts.reshape(-1))
                    torch.frombuffer((ctypes.c_float * n).from_address(weights), dtype=torch.float32).copy_(
                        r.weights.reshape(-1))
                    return 0
                except BaseException as e:  # noqa: BLE001 — an exception cannot cross the C frames
                    self._route_error = e
                    return 1

            fn = native.ROUTE_FN(route)
        self._route = (fn, None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value)  # fn held: C calls it
        return self._route[1]

    def _step_failed(self, what: str, rc: int) -> None:
        """Raise what stopped a C step (its result `rc`): the router's exception, a kernel that could not allocate
        (MemoryError), or one that refused its arguments (RuntimeError: the descriptors the load checked let
        through what a kernel does not take — a bug to report, not the input's)."""
        error, self._route_error = getattr(self, "_route_error", None), None
        if error is not None:
            raise error
        if rc == NO_MEMORY:
            raise MemoryError(f"{what} could not allocate its buffers")
        raise RuntimeError(f"{what} refused its arguments (result {rc}): the layers' descriptors passed the "
                           "load's checks but not a kernel's")

    def _mlp_width(self) -> int:
        """F of the step's scratch: the widest MLP's — dense, experts' or shared expert's (the layers are fixed
        once built: found once, not at every step)."""
        width = self.__dict__.get("_mlp_f")
        if width is None:
            widths = [1]
            for layer in self.layers:
                if layer.coded and "down" in layer.coded:
                    widths.append(layer.coded["down"].in_features)
                if layer.moe is not None:
                    widths.append(layer.moe.down.in_features)
                    if layer.moe.shared_down is not None:
                        widths.append(layer.moe.shared_down.in_features)
            width = self._mlp_f = max(widths)
        return width

    def _weight_versions(self) -> tuple[int, ...]:
        """The versions of every tensor `lmhead_step` reads (norms and codes' sources): a change in place
        rebuilds its descriptors, or — for the coded matrices — sends the step down the torch path."""
        tensors = self.__dict__.get("_versioned")
        if tensors is None:  # the list is fixed once the layers are built; their versions are read every step
            tensors = [self.final_norm]
            for layer in self.layers:
                moe = layer.moe
                tensors += [t for t in (layer.input_norm, layer.post_attn_norm, layer.pre_mlp_norm,
                                        layer.post_mlp_norm, layer.q_norm, layer.k_norm, layer.qkv_bias,
                                        layer.o_bias, layer.sinks, *((moe.gate_up_bias, moe.down_bias) if moe else ()))
                            if t is not None]
                for c in (layer.coded or {}).values():
                    tensors += list(c.sources)
            self._versioned = tensors
        return tuple([t._version for t in tensors])

    def _checked_descs(self, cache: StaticCache, rows: int):
        """`_step_descs()` for a step of `rows` new tokens on `cache`, or None where the coded step must not run (an
        activation it does not compute, more rows than it takes, a cache not in one piece, a matrix without codes,
        or codes that no longer give their weights back)."""
        if (self.act_code is None or rows > self.CODED_MAX_ROWS
                or not cache.in_blocks()):
            return None
        descs = self._step_descs()
        # the weights' versions are read once per cache (a generation), not every step: reading ~270 tensors'
        # versions after a step has streamed the weights through the caches cost ~0.3 ms per token; a weight
        # changed in place during a generation is seen by the next one
        if descs is not None and cache.checked is not descs:
            if descs[2] != self._weight_versions():
                self._descs = None  # norms changed in place: rebuild
                descs = self._step_descs()
            # codes that no longer give their weights back: the torch path, at every step of this cache (the
            # rebuilt descriptors record the new versions, so their check alone would pass from the next step)
            if descs is not None and not all(c.current() for layer in self.layers for c in layer.coded.values()):
                return None
            cache.checked = descs
        return descs

    def _step_scratch(self, rows: int) -> int:
        """Floats of `lmhead_step`'s scratch for `rows` new tokens."""
        hd, heads, kv = self.head_dim, self.heads, self.kv_heads
        f, d = self._mlp_width(), self.width
        return rows * ((heads + 2 * kv) * hd + (heads + kv) * hd + heads * hd + 3 * d + 3 * f)

    def _step_args(self, descs, cache: StaticCache, start: int, b: int, t: int, x: Tensor, h: Tensor,
                   scratch: Tensor) -> native.StepArgs:
        """`lmhead_step`'s arguments for b·t new tokens at column `start` of `cache` (x, h [b·t, D] and scratch
        float32, contiguous), less its cos, sin and masks."""
        return native.StepArgs(
            layers=ctypes.addressof(descs[0]), final_norm=self.final_norm.data_ptr(), x=x.data_ptr(), h=h.data_ptr(),
            keys=cache.keys.data_ptr(), values=cache.values.data_ptr(), scratch=scratch.data_ptr(),
            n_layers=len(self.layers), layer_stride=cache.layer_stride, B=b, T=t, D=self.width, H=self.heads,
            Hkv=self.kv_heads, hd=self.head_dim, F=self._mlp_width(), cap=cache.capacity,
            start=start, eps=self.eps, scaling=self.scaling, softcap=self.attn_softcap or 0.0,
            plus_one=int(self.arch.unit_offset_norm), act=self.act_code, threads=torch.get_num_threads(),
            shared=self._shared_args(cache), route=self._route_fn())

    def shares_columns(self) -> bool:
        """Whether a cache's rows may read their prompt beginnings from shared blocks (`StaticCache.shared`)
        instead of copies: the C attention serves every layer (a float32 cache on the CPU, float32 sinks)."""
        return (self.native is not None and self.dtype == torch.float32 and torch.device(self.device).type == "cpu"
                and all(layer.sinks is None or layer.sinks.dtype == torch.float32 for layer in self.layers))

    @staticmethod
    def _shared_args(cache: StaticCache) -> int | None:
        """The address of `cache.shared`'s abi.SharedArgs (made once per SharedColumns, kept on it with the
        tables it points to), or None where no row shares columns."""
        shared = cache.shared
        if shared is None:
            return None
        if shared.native is None:
            b = len(shared.rows)
            n = max(len(e[2]) for e in shared.rows if e is not None)
            block = next(e[2][0].shape[2] for e in shared.rows if e is not None)
            table = lambda i: (ctypes.c_void_p * (b * n))(*[  # noqa: E731
                None if e is None or j >= len(e[i]) else e[i][j].data_ptr() for e in shared.rows for j in range(n)])
            keys, values = table(2), table(3)
            start = torch.tensor([0 if e is None else e[0] for e in shared.rows], dtype=torch.int64)
            lens = torch.tensor([0 if e is None else e[1] for e in shared.rows], dtype=torch.int64)
            args = SharedArgs(keys=ctypes.addressof(keys), values=ctypes.addressof(values),
                                     start=start.data_ptr(), len=lens.data_ptr(), n=n, block=block)
            shared.native = (args, keys, values, start, lens)
        return ctypes.addressof(shared.native[0])

    def _step_native(self, x: Tensor, rope: dict, masks: dict, cache: StaticCache, start: int) -> Tensor | None:
        """Every block in one C call (`lmhead_step`) when all matrices read codes → hidden [B,T,D], else None."""
        lib = self._native(x)
        b, t = x.shape[:2]
        descs = None if lib is None else self._checked_descs(cache, b * t)
        if descs is None:
            return None
        kinds = [rope[kind] for kind in self.layer_types]
        cos = [c.contiguous() for c, _ in kinds]
        sin = [s.contiguous() for _, s in kinds]
        mask_list = [None if masks.get(flag) is None else masks[flag].contiguous() for flag in (False, True)]
        arr = lambda ts: (ctypes.c_void_p * len(ts))(*[None if v is None else v.data_ptr() for v in ts])  # noqa: E731
        cos_ptrs, sin_ptrs, mask_ptrs = arr(cos), arr(sin), arr(mask_list)  # held: the call reads them
        scratch = x.new_empty(self._step_scratch(b * t))
        x = x.contiguous().clone()
        h = torch.empty_like(x)
        args = self._step_args(descs, cache, start, b, t, x, h, scratch)
        args.cos, args.sin = ctypes.addressof(cos_ptrs), ctypes.addressof(sin_ptrs)
        args.masks = ctypes.addressof(mask_ptrs)
        rc = lib.lmhead_step(args)
        if rc != 0:
            self._step_failed("lmhead_step", rc)
        return h

    def _decode_native(self, ids: Tensor, positions: Tensor, cache: StaticCache, valid: Tensor | None
                       ) -> Tensor | None:
        """`forward`'s whole call in C (`lmhead_decode`: the cache's bookkeeping, the embedding, the rope rows
        and the masks, then `lmhead_step`) → hidden [B,T,D]; None where it does not serve (then nothing has been
        written and the general path runs): the step's own conditions, rope tables not made yet or too short
        for a position, an id outside the vocabulary, tensors of another dtype or layout. Why: after a step
        has streamed the weights through the caches, each torch operation around it costs 50–300 µs
        (decode_kernels.c), ~1 ms of a 10 ms step."""
        lib = self._native(self.final_norm)
        b, t = ids.shape
        if lib is None or (self.embed is not None and not self.embed.is_contiguous()):
            return None
        tables = self.__dict__.get("_rope_tables", {})
        rows_tables = [tables.get((kind, self.dtype, self.device)) for kind in self.layer_types]
        if any(tb is None for tb in rows_tables):
            return None  # made by the general path's first call (`_rotary`), which checks the rope type
        table_rows = min(tb[0].shape[0] for tb in rows_tables)
        for tensor, dtype in ((ids, torch.long), (positions, torch.long), (cache.valid, torch.bool),
                              (cache.positions, torch.long), (cache.tokens, torch.long)):
            if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
                return None
        if valid is not None and (valid.dtype != torch.bool or valid.shape != ids.shape or not valid.is_contiguous()):
            return None
        if positions.shape != ids.shape:
            return None
        descs = self._checked_descs(cache, b * t)
        if descs is None:
            return None
        start, cap, d, rows = cache.length, cache.capacity, self.width, b * t
        hd = self.head_dim
        key = (rows, cap, threading.get_ident())  # per thread: two generations at once must not share them
        buffers = self.__dict__.setdefault("_decode_buffers", {})
        if key not in buffers:  # reused: the residual stream, the step's scratch and the prelude's rows/masks
            if len(buffers) > 16:
                buffers.clear()
            work = rows * (2 * len(self.layer_types) * hd + 2 * cap)
            new = self.final_norm.new_empty
            buffers[key] = (new(rows * d), new(self._step_scratch(rows)), new(work))
        x, scratch, work = buffers[key]
        made = self.__dict__.get("_table_ptrs")
        if made is None or any(a is not b for a, b in zip(made[0], rows_tables, strict=True)):
            if not all(c.is_contiguous() and sn.is_contiguous() for c, sn in rows_tables):
                return None
            ptrs = lambda ts: (ctypes.c_void_p * len(ts))(*[tb.data_ptr() for tb in ts])  # noqa: E731
            scale = self.embed_scale  # a constant of the model (Gemma: √D); read once, not at every step
            made = (rows_tables, ptrs([c for c, _ in rows_tables]), ptrs([sn for _, sn in rows_tables]),
                    sum({1 << int(layer.sliding) for layer in self.layers}), 0.0 if scale is None else float(scale))
            self._table_ptrs = made
        h = self.final_norm.new_empty((b, t, d))
        coded = self.embed_codes
        embed_desc = None if coded is None else self.__dict__.get("_embed_desc")
        if coded is not None and embed_desc is None:
            embed_desc = self._embed_desc = coded.desc()  # held here: the calls read it
        rc = lib.lmhead_decode(native.DecodeArgs(
            step=self._step_args(descs, cache, start, b, t, x, h, scratch),
            embed=None if coded is not None else self.embed.data_ptr(),
            embed_codes=None if embed_desc is None else ctypes.addressof(embed_desc),
            ids=ids.data_ptr(), positions=positions.data_ptr(), new_valid=None if valid is None else valid.data_ptr(),
            cache_valid=cache.valid.data_ptr(), cache_pos=cache.positions.data_ptr(),
            cache_tokens=cache.tokens.data_ptr(), cos_tables=ctypes.addressof(made[1]),
            sin_tables=ctypes.addressof(made[2]), work=work.data_ptr(),
            vocab=coded.out_features if coded is not None else self.embed.shape[0], n_kinds=len(self.layer_types),
            table_rows=table_rows, window=self.window or 0, embed_scale=made[4],
            has_scale=int(self.embed_scale is not None), sliding_kinds=made[3]))
        if rc == -2:
            return None
        if rc != 0:
            self._step_failed("lmhead_decode", rc)
        cache.length = start + t
        return h

    def _attention_native(self, qk: Tensor, qkv: Tensor, cos: Tensor, sin: Tensor, cache: StaticCache, i: int,
                          start: int, mask: Tensor | None, sinks: Tensor | None = None) -> Tensor | None:
        """Rope, the cache write and attention of layer i in one C call (`lmhead_attend`) → [B,T,H·hd], or None
        where the torch path must run (no library, a layout it does not take). `sinks` [H]: gpt-oss's logit per
        head in the softmax's denominator."""
        keys, values = cache.keys[i], cache.values[i]
        lib = self._native(qk, qkv, cos, sin, keys, *(() if sinks is None else (sinks,)))
        if lib is None or not (qkv.is_contiguous() and keys.is_contiguous() and values.is_contiguous()):
            return None
        if sinks is not None:
            sinks = sinks.detach().contiguous()
        b, t = qkv.shape[:2]
        width = qkv.shape[-1]
        if qk.data_ptr() == qkv.data_ptr():  # no q/k norm: the heads are read in place from qkv
            qk_ptr, qk_stride = qkv.data_ptr(), width
        else:
            qk = qk.contiguous()
            qk_ptr, qk_stride = qk.data_ptr(), qk.shape[-1] * qk.shape[-2]
        cos, sin = cos.contiguous(), sin.contiguous()
        mask = None if mask is None else mask.contiguous()
        out = qkv.new_empty((b, t, self.heads * self.head_dim))
        v_offset = (self.heads + self.kv_heads) * self.head_dim * qkv.element_size()
        rc = lib.lmhead_attend(native.AttendArgs(
            qk=qk_ptr, v=qkv.data_ptr() + v_offset, cos=cos.data_ptr(), sin=sin.data_ptr(), keys=keys.data_ptr(),
            values=values.data_ptr(), mask=None if mask is None else mask.data_ptr(), out=out.data_ptr(),
            qk_stride=qk_stride, v_stride=width, B=b, T=t, H=self.heads, Hkv=self.kv_heads, hd=self.head_dim,
            cap=cache.capacity, start=start, scaling=self.scaling, softcap=self.attn_softcap or 0.0,
            threads=torch.get_num_threads(), shared=self._shared_args(cache), layer=i,
            sinks=None if sinks is None else sinks.data_ptr()))
        if rc == NO_MEMORY:
            raise MemoryError("lmhead_attend could not allocate its buffers")
        if rc != 0:
            raise RuntimeError(f"lmhead_attend refused its arguments (result {rc})")
        return out
