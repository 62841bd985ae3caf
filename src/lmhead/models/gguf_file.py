"""A GGUF file read in place: its tensor table over a memory map, and each matrix's blocks as integer codes.

    file ──GGUFReader (numpy memmap)──▶ tensors {name: type, shape, bytes}
    a block tensor (Q4_0 … Q8_0, Q2_K … Q6_K, IQ4_NL, IQ4_XS) [N, K] ──bits of its blocks──▶ codes int8 [N,K]
        + scale, offset [N, K/G]  (W = scale·code + offset, the numbers gguf-py's `dequantize` gives, bit for bit)
    F16, BF16, F32 [N, K] ──its weights as they are──▶ float16 / bfloat16 / float32 [N,K] (the kernel converts exactly)
    any other type (the other IQ*, ...) ──gguf-py's `dequantize`──▶ float32 [N,K]

Every type above is an integer per weight times a per-group float32 product of the block's parts, plus a
per-group offset for some: Q2_K's d·sc·q − dmin·m per 16, Q3_K's d·(sc − 32)·q with q in −4 … 3, IQ4_NL's
d·v[q] and IQ4_XS's d·(ls − 32)·v[q] with v a table of 16 integers (so v[q] is the code). Each product is exact
in float32 (at most 24 significant bits), so scale·code + offset rounds only where gguf-py's dequantiser
rounds too: at the offset's addition.

The model's numbers are defined as gguf-py's dequantisation of the file (what transformers' GGUF loader uses).
The codes are read straight from the blocks' bits, with the scales and offsets computed by the same float32
products as gguf-py's dequantiser (`gguf_codes.block_scales`), so `Codes.dequantize()` equals `dequantize(...)`
for every weight (tests/test_gguf_file.py checks each type on random blocks and on both packaged files).
Pages of the map that a tensor was read from are released after it is converted (`release`), so the file
does not stay resident beside the codes made from it.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmhead.models.errors import ModelError
from lmhead.models.gguf_codes import BLOCKS, IQ4_VALUES, Codes, block_scales, block_subscales
from lmhead.models.heap import trim_heap
from lmhead.models.quant_types import TYPES

__all__ = ["CODE_TYPES", "DENSE_TYPES", "IQ4_VALUES", "GGUFFile", "Header", "block_codes", "dense_sub", "read_header"]

CODE_TYPES: frozenset[str] = frozenset(TYPES)  # the block types whose codes the coded kernel multiplies
# float types the kernel multiplies as they are (`CodedLinear.dense16`): each 16-bit weight converted exactly
DENSE_TYPES: dict[str, torch.dtype] = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def block_codes(kind: str, blocks: np.ndarray) -> np.ndarray:
    """The integer code of every weight of raw `blocks` [nb, bytes] of type `kind` → int8 [nb, weights per block],
    the numbers gguf-py's dequantiser multiplies by the group's scale (and adds the group's offset to): the type's
    declaration (models/quant_types.py)."""
    if kind not in TYPES:
        raise ValueError(f"no codes for GGUF type {kind}")
    return TYPES[kind].codes(blocks)


_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR = {kind: struct.Struct(f) for kind, f in _FORMATS.items()}
_U32, _U64 = _SCALAR[4], _SCALAR[10]


class Header:
    """A GGUF header read with struct over a map of the file: scalar metadata values and the tensor table; arrays
    (the vocabulary) are skipped unless `arrays` (then `fields` holds them too: numbers as lists, strings as
    bytes, and `types` each field's GGUF value types as gguf-py lists them). gguf-py's reader builds a numpy view
    per field part — seconds for a large vocabulary on every read; this reads only what is asked for."""

    def __init__(self, path: Path, arrays: bool = False) -> None:
        self.path, self.arrays = path, arrays
        self.types: dict[str, list[int]] = {}
        with open(path, "rb") as fh:
            self.size = os.fstat(fh.fileno()).st_size
            if fh.read(4) != b"GGUF":
                raise ModelError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
            if self.size < 24:
                raise ModelError(f"{path} is a truncated GGUF file ({self.size} bytes)")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                self.buf, self.pos = buf, 0
                self._read()
                self.buf = None

    def _read(self) -> None:
        path = self.path
        if self._take(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
        self.version = self._num(_U32)
        if self.version not in (2, 3):
            raise ModelError(f"{path}: unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors, n_kv = self._num(_U64), self._num(_U64)
        self.n_tensors, self.n_kv = n_tensors, n_kv
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise ModelError(f"{path} is a damaged GGUF file (its header counts {n_tensors} tensors and {n_kv} "
                             "metadata entries)")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._str()
            kind = self._num(_U32)
            if self.arrays:
                self.types[key], self.fields[key] = self._typed(kind)
            else:
                self.fields[key] = self._value(kind)
        self.tensors: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = self._str()
            n_dims = self._num(_U32)
            if n_dims > 8:
                raise ModelError(f"{path} is a damaged GGUF file (tensor {name!r} has {n_dims} dimensions)")
            dims = tuple(self._num(_U64) for _ in range(n_dims))
            self.tensors.append((name, dims, self._num(_U32), self._num(_U64)))
        align = self.fields.get("general.alignment")
        align = align if isinstance(align, int) and align > 0 else 32
        self.data_start = (self.pos + align - 1) // align * align

    def _need(self, end: int) -> None:
        if end > self.size:
            raise ModelError(f"{self.path} is a truncated GGUF file (its header runs past the file's "
                             f"{self.size} bytes)")

    def _take(self, n: int) -> bytes:
        self._need(self.pos + n)
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def _num(self, fmt: struct.Struct) -> Any:
        self._need(self.pos + fmt.size)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def _str(self) -> str:
        n = self._num(_U64)
        if n > 1 << 30:
            raise ModelError(f"{self.path} is a damaged GGUF file (a string of {n} bytes in its header)")
        return self._take(n).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind in _SCALAR:
            return self._num(_SCALAR[kind])
        if kind == 8:
            return self._str()
        if kind == 9:
            item, n = self._num(_U32), self._num(_U64)
            if item in _SCALAR:
                self._need(self.pos + n * _SCALAR[item].size)
                self.pos += n * _SCALAR[item].size
            elif item == 8:  # strings: each its length, then its bytes
                pos, buf, size, unpack = self.pos, self.buf, self.size, _U64.unpack_from
                for _ in range(n):
                    if pos + 8 > size:
                        break
                    pos += 8 + unpack(buf, pos)[0]
                self.pos = pos
                self._need(pos)
            else:
                for _ in range(n):
                    self._value(item)
            return None
        raise ModelError(f"{self.path} is a damaged GGUF file (unknown metadata type {kind})")


    def _typed(self, kind: int) -> tuple[list[int], Any]:
        """(gguf-py's value types, the value) of one metadata entry, arrays included; strings as raw bytes."""
        if kind == 8:
            n = self._num(_U64)
            return [8], self._take(n)
        if kind != 9:
            return [kind], self._value(kind)
        item, n = self._num(_U32), self._num(_U64)
        if item in _SCALAR:
            fmt = _FORMATS[item]
            self._need(self.pos + n * _SCALAR[item].size)
            values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=n, offset=self.pos).tolist()
            self.pos += n * _SCALAR[item].size
            return [9, item], values
        if item == 8:
            out = []
            for _ in range(n):
                out.append(self._take(self._num(_U64)))
            return [9, 8], out
        raise ModelError(f"{self.path}: metadata arrays of type {item} are not read (nested arrays)")


class _Tensor:
    """One tensor of the table: `data` a uint8 view [rows, bytes per row] of the map (F32/F16/BF16 too)."""

    def __init__(self, name: str, dims: tuple[int, ...], kind: Any, offset: int, n_bytes: int, mapped: Any):
        self.name, self.shape, self.tensor_type = name, dims, kind
        self.data_offset, self.n_bytes, self._mapped = offset, n_bytes, mapped

    @property
    def data(self) -> np.ndarray:
        rows = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        view = np.frombuffer(self._mapped, dtype=np.uint8, count=self.n_bytes, offset=self.data_offset)
        return view.reshape(rows, self.n_bytes // max(rows, 1))


def read_header(path: Path) -> tuple[str, list[_Tensor], int]:
    """(architecture, tensors without data, file size) of a GGUF file; ModelError for a damaged or truncated one."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        head = Header(path)
    except ModelError:
        raise
    except (OSError, UnicodeError, ValueError, OverflowError, MemoryError) as exc:
        raise ModelError(f"{path} is a damaged GGUF file (truncated or corrupt: {type(exc).__name__}: {exc})") \
            from exc
    tensors = []
    for name, dims, kind, offset in head.tensors:
        try:
            qtype = GGMLQuantizationType(kind)
            block, size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelError(f"{path}: tensor {name!r} has an unknown GGUF type {kind}") from None
        count = int(np.prod(dims)) if dims else 1
        if count % block:
            raise ModelError(f"{path} is a damaged GGUF file (tensor {name!r} of {count} weights is not whole "
                             f"{qtype.name} blocks)")
        tensors.append(_Tensor(name, dims, qtype, head.data_start + offset, count // block * size, None))
    end = max((t.data_offset + t.n_bytes for t in tensors), default=0)
    if end > head.size or not tensors:
        raise ModelError(f"{path} is a truncated GGUF file: its tensors need {end} bytes, the file has {head.size}")
    arch = head.fields.get("general.architecture")
    return (arch if isinstance(arch, str) else "unknown"), tensors, head.size


def dense_sub(kind: str, k: int) -> bool:
    """Whether a dense matrix of `kind` with rows of `k` weights holds a K-quant's scales as its blocks do (d per 256
    weights times an int8 per group: a quarter of the bytes of float32 numbers per group; the kernel takes up to
    HALF_MAX_GROUPS groups a row so) — for groups of 32 only where the build makes their d·sub sixteen at a time
    (`native.sub_sixteen`): with AVX2 alone the conversion cost a decode step more than the bytes it saved
    (AuthenticAMD family 25 model 1). The loader's layout and `file_model.memory_needed`'s estimate."""
    from lmhead.kernels import native

    t = TYPES[kind]
    return t.sub and k // t.group <= native.HALF_MAX_GROUPS and (t.group == 16 or native.sub_sixteen())


class GGUFFile:
    """A GGUF file's header and tensor table, its data read through a memory map (nothing copied up front).

    `tensors` {name: tensor}; `type_of(name)`; `codes(name)` → `Codes` for a block type the coded kernel takes,
    `dequantize(name)` → float32 tensor for any type; `release(name)` drops the tensor's pages from this
    process's memory (they are the file's: read again from the page cache if needed)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.architecture, tensors, _ = read_header(self.path)
        with open(self.path, "rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self._released: list[tuple[int, int]] = []  # (offset, size) given to release, for `sweep`
        for t in tensors:
            t._mapped = self._map
        self.tensors: dict[str, Any] = {t.name: t for t in tensors}

    def type_of(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as torch orders it ([N, K] for a matrix: GGUF lists K first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def nbytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.reader.tensors)

    def codes(self, name: str) -> Codes:
        """The matrix `name` [N,K] as codes and group scales (its type must be in CODE_TYPES)."""
        t = self.tensors[name]
        kind = t.tensor_type.name
        per_block, nbytes, group = BLOCKS[kind]
        n, k = self.shape(name)
        data = np.asarray(t.data)
        if data.dtype != np.uint8 or k % per_block or data.size != n * (k // per_block) * nbytes:
            raise ModelError(f"{self.path}: tensor {name} ({kind}, {n}x{k}) does not hold whole blocks")
        blocks = data.reshape(n * (k // per_block), nbytes)
        s, o = block_scales(kind, blocks)
        codes = torch.from_numpy(block_codes(kind, blocks).reshape(n, k))
        scale = torch.from_numpy(np.ascontiguousarray(s).reshape(n, k // group))
        offset = None if o is None else torch.from_numpy(np.ascontiguousarray(o).reshape(n, k // group))
        return Codes(codes, scale, offset, kind)

    def coded(self, name: str, chunk_rows: int = 8192):
        """The matrix `name` [N,K] as a `CodedLinear`, converted `chunk_rows` rows at a time (each piece's pages of
        the map released after it): neither the file's bytes nor an int8 copy of the whole matrix stay beside the
        kernel's layout (`CodedLinear.from_chunks`)."""
        return self.coded_rows([name], None, chunk_rows)

    def coded_rows(self, names: list[str], perms: list[np.ndarray | None] | None = None, chunk_rows: int = 8192,
                   groups16: bool = False, planes: bool = True):
        """The row-wise concatenation of the matrices `names` (one type, one K; q, k and v → qkv) as one
        `CodedLinear`, made as `coded` makes one matrix; perms: each part's rows in the order it is wanted (None:
        as stored). The parts' row counts must be multiples of 4 but for the last (the chunks of
        `CodedLinear.from_chunks`). `groups16`: the integer path by groups' layout where the matrix is eligible
        for it (`models/groups16.py`), 5- and 6-bit codes there in their type's plane layout (`planes` False: a byte
        each)."""
        from lmhead.models.coded_linear import CodedLinear, SubScales

        perms = perms if perms is not None else [None] * len(names)
        kinds = {self.tensors[nm].tensor_type.name for nm in names}
        ks = {self.shape(nm)[1] for nm in names}
        if len(kinds) != 1 or len(ks) != 1:
            raise ValueError(f"coded_rows: {names} are not of one type and width")
        kind, k = kinds.pop(), ks.pop()
        per_block, nbytes, group = BLOCKS[kind]
        sizes = [self.shape(nm)[0] for nm in names]
        if any(r % 4 for r in sizes[:-1]):
            raise ValueError(f"coded_rows: row counts {sizes} are not multiples of 4 but for the last")
        parts = []
        for nm, rows in zip(names, sizes, strict=True):
            t = self.tensors[nm]
            data = np.asarray(t.data)
            if k % per_block or data.size != rows * (k // per_block) * nbytes:
                raise ModelError(f"{self.path}: tensor {nm} ({kind}, {rows}x{k}) does not hold whole blocks")
            parts.append(data.reshape(rows, (k // per_block) * nbytes))
        n, per_row, ng = sum(sizes), k // per_block, k // group
        has_offset = TYPES[kind].offset
        sub = dense_sub(kind, k)
        if sub:
            scale = SubScales(n, k, group)
            offset = SubScales(n, k, group) if has_offset else None
        else:
            # the scales are filled chunk by chunk with the codes: computed for the whole matrix first, they read
            # a scale from every block, i.e. every page of the tensor, all resident at once (Gemma 3's embedding:
            # its whole 178 MB beside the kernel's layout being built)
            scale = torch.empty(n, ng)
            offset = torch.empty(n, ng) if has_offset else None
        step = max(4, chunk_rows // 4 * 4)

        def chunks():
            row0 = 0
            for nm, rows, perm, data in zip(names, sizes, perms, parts, strict=True):
                t = self.tensors[nm]
                for start in range(0, rows, step):
                    stop = min(rows, start + step)
                    a, b = row0 + start, row0 + stop
                    part = (data[start:stop] if perm is None else data[perm[start:stop]]).reshape(-1, nbytes)
                    if sub:
                        d, sc, dmin, mn = block_subscales(kind, part)
                        scale.d[a:b] = torch.from_numpy(d.reshape(stop - start, -1))
                        scale.sub[a:b] = torch.from_numpy(sc.reshape(stop - start, ng))
                        if offset is not None:
                            offset.d[a:b] = torch.from_numpy(dmin.reshape(stop - start, -1))
                            offset.sub[a:b] = torch.from_numpy(mn.reshape(stop - start, ng))
                    else:
                        s, o = block_scales(kind, part)
                        scale[a:b] = torch.from_numpy(s.reshape(stop - start, ng))
                        if offset is not None:
                            offset[a:b] = torch.from_numpy(o.reshape(stop - start, ng))
                    yield a, torch.from_numpy(block_codes(kind, part).reshape(-1, k))
                    if perm is None:
                        # everything read so far, not only this chunk: a fault in the next chunk maps the pages
                        # around it again (the kernel's fault-around), the end of this one among them
                        self._release_range(t.data_offset, stop * per_row * nbytes, record=False)
                    trim_heap()  # each chunk's transient arrays, before the next one's (models/heap.py)
                self.release(nm)
                row0 += rows

        return CodedLinear.from_chunks(n, k, scale, offset, chunks(), TYPES[kind].four_bit, groups16=groups16,
                                       plane=TYPES[kind].plane if planes else None)

    def weights16(self, name: str) -> torch.Tensor:
        """The F16, BF16 or F32 matrix `name` [N,K] as a float16, bfloat16 or float32 tensor (a copy of its bytes,
        its pages of the map released)."""
        t = self.tensors[name]
        n, k = self.shape(name)
        data = np.asarray(t.data)
        dtype = DENSE_TYPES[t.tensor_type.name]
        size = dtype.itemsize
        if data.size != n * k * size:
            raise ModelError(f"{self.path}: tensor {name} ({t.tensor_type.name}, {n}x{k}) does not hold {n * k} "
                             f"{8 * size}-bit weights")
        out = torch.from_numpy(data.reshape(n, size * k).view(np.int16 if size == 2 else np.int32).copy()).view(dtype)
        self.release(name)
        return out

    def dequantize(self, name: str) -> torch.Tensor:
        """The tensor as float32, by gguf-py's `dequantize` (the definition of the model's numbers)."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        try:
            values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as exc:
            raise ModelError(f"{self.path}: tensor {name} has the type {t.tensor_type.name}, which gguf-py "
                             "cannot dequantize") from exc
        if not values.flags.owndata or not values.flags.writeable:  # F32 comes back as a view of the map
            values = values.copy()
        return torch.from_numpy(values.reshape(self.shape(name)))

    def release(self, name: str) -> None:
        """Drop the pages of tensor `name` from this process's resident memory (a read-only map of the file)."""
        t = self.tensors[name]
        self._release_range(t.data_offset, t.n_bytes)

    def sweep(self) -> None:
        """Drop again the pages of every tensor released so far: reading a neighbouring tensor maps the pages
        around the one it faults on (the kernel's fault-around, up to a few hundred KB), and a small tensor
        released before its neighbour was read is then resident again until the map is closed."""
        for offset, size in list(self._released):
            self._release_range(offset, size, record=False)

    def _release_range(self, offset: int, size: int, record: bool = True) -> None:
        if record:
            self._released.append((offset, size))
        page = mmap.PAGESIZE
        start = offset // page * page
        try:
            self._map.madvise(mmap.MADV_DONTNEED, start, offset + size - start)
        except (OSError, ValueError, AttributeError):
            pass

    def close(self) -> None:
        """Unmap the file (the tensors' numpy views must be gone; a view still alive keeps the map)."""
        self.tensors.clear()
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass
