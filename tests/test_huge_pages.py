"""The load's arena on huge pages (models/huge_pages.py): buffers end to end, a file read whole, and a loaded GGUF
file's matrices in it — the same bits as mapped or allocated elsewhere, and the layout cache's files no longer
mapped once read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lmhead.models import huge_pages
from lmhead.models.coded_linear import coded_available
from lmhead.models.huge_pages import Arena


def test_an_arena_hands_out_disjoint_aligned_buffers_holding_what_was_copied():
    g = torch.Generator().manual_seed(0)
    a = Arena()
    tensors = [torch.randn(3, generator=g), torch.randn(7, 1000, generator=g),
               torch.randint(-128, 128, (5, 33), generator=g, dtype=torch.int8),
               torch.randn(17, generator=g).to(torch.bfloat16), torch.randn(2, 9, generator=g).half()]
    copies = [a.copy(t) for t in tensors]
    spans = []
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t) and c.data_ptr() != t.data_ptr()
        assert c.data_ptr() % 64 == 0
        spans.append((c.data_ptr(), c.data_ptr() + c.nbytes))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert a.nbytes == sum(t.nbytes for t in tensors)
    parts = [torch.randn(4, 6, generator=g), torch.randn(2, 6, generator=g)]
    assert torch.equal(a.cat(parts), torch.cat(parts))


def test_a_buffer_larger_than_a_chunk_takes_a_region_of_its_own_and_the_next_small_one_follows_the_last(monkeypatch):
    monkeypatch.setattr(huge_pages, "CHUNK", huge_pages.PAGE)
    a = Arena()
    first = a.take(100)
    big = a.take(huge_pages.PAGE + 1)
    after = a.take(10)
    assert after.ctypes.data == first.ctypes.data + 128  # the next 64-byte boundary in the first region
    assert not first.ctypes.data <= big.ctypes.data < first.ctypes.data + huge_pages.PAGE
    assert a.take(huge_pages.PAGE - 64).ctypes.data != after.ctypes.data + 64  # no room left there: a new region


def test_an_arena_reads_a_file_whole_and_refuses_one_shorter_than_asked(tmp_path: Path):
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "blob.bin"
    path.write_bytes(data.numpy().tobytes())
    a = Arena()
    assert torch.equal(torch.from_numpy(a.read(path, data.numel())), data)
    with pytest.raises(OSError, match="bytes where"):
        a.read(path, data.numel() + 1)


def test_the_arena_is_off_with_lmhead_huge_pages_0(monkeypatch):
    monkeypatch.setenv("LMHEAD_HUGE_PAGES", "0")
    assert not huge_pages.available()
    with huge_pages.arena_for_load() as arena:
        assert arena is None and huge_pages.current() is None


def test_loads_share_the_arena_of_the_load_in_progress(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    with huge_pages.arena_for_load() as outer:
        with huge_pages.arena_for_load() as inner:
            assert inner is outer and huge_pages.current() is outer
        assert huge_pages.current() is outer
    assert huge_pages.current() is None


def _codes(c) -> list[torch.Tensor]:
    """The code buffers of a `CodedLinear` (of each block of a `RowBlocks`)."""
    blocks = getattr(c, "blocks", None)
    return [t for b in blocks for t in _codes(b)] if blocks is not None else [c.codes]


def _mapped_under(folder: Path) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(folder) in line]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "F16"])
def test_a_loaded_files_matrices_lie_in_the_arena_with_the_same_logits_as_without_it(tmp_path, monkeypatch, kind):
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huge_pages, "available", lambda: True)  # the placement, whatever this system's THP mode
    handed: list[tuple[int, int]] = []
    take = Arena.take

    def recorded(self, nbytes):
        out = take(self, nbytes)
        handed.append((out.ctypes.data, out.ctypes.data + nbytes))
        return out

    monkeypatch.setattr(Arena, "take", recorded)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", kind=kind)
    ids = torch.tensor([[3, 17, 5, 99, 42, 7]])
    layouts = tmp_path / "cache" / "layouts"
    results = []
    for _ in range(2):  # laid out and written, then read from the layout cache
        handed.clear()
        model = load_model(str(path), progress=False)
        lean = model.lean
        mats = [c for layer in lean.layers for c in (layer.coded or {}).values()]
        mats += [lean.embed_codes, model.exact_head.product]
        buffers = [t for c in mats if c is not None for t in _codes(c)]
        assert len(buffers) >= 2 * len(lean.layers)
        for t in buffers:
            assert any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in handed), t.shape
        assert not _mapped_under(layouts)  # the layouts' files read, not mapped
        results.append(model.logits(ids))
        del model, lean, mats, buffers
    monkeypatch.setenv("LMHEAD_HUGE_PAGES", "0")
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    handed.clear()
    model = load_model(str(path), progress=False)
    assert not handed
    if kind != "F16":  # a float file's matrices are the load's own memory; codes are mapped from the layout cache
        assert _mapped_under(layouts)
    plain = model.logits(ids)
    for got in results:
        assert torch.equal(got, plain)


def _smaps_flags_under(folder: Path) -> list[list[str]]:
    """The VmFlags of each mapping of a file under `folder` (/proc/self/smaps)."""
    flags, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:
            inside = str(folder) in line
        elif inside and line.startswith("VmFlags:"):
            flags.append(line.split()[1:])
    return flags


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
def test_a_large_layout_file_is_mapped_and_advised_for_huge_pages_rather_than_copied(tmp_path, monkeypatch):
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model

    if not huge_pages.available():
        pytest.skip("no transparent huge pages here (or LMHEAD_HUGE_PAGES=0)")
    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huge_pages, "MAP_MIN", 0)  # the tiny model's files as large ones
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", kind="Q8_0")
    ids = torch.tensor([[3, 17, 5, 99, 42, 7]])
    layouts = tmp_path / "cache" / "layouts"
    got = []
    for _ in range(2):  # laid out and written, then mapped from the layout cache
        model = load_model(str(path), progress=False)
        flags = _smaps_flags_under(layouts)
        assert flags and all("hg" in f for f in flags), flags  # VM_HUGEPAGE on every map of the layouts
        got.append(model.logits(ids))
        del model
    monkeypatch.setenv("LMHEAD_HUGE_PAGES", "0")
    model = load_model(str(path), progress=False)
    assert all("hg" not in f for f in _smaps_flags_under(layouts))
    plain = model.logits(ids)
    assert all(torch.equal(g, plain) for g in got)


@pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")
@pytest.mark.parametrize("map_min", [0, 1 << 40], ids=["mapped", "read into the arena"])
def test_a_layout_file_damaged_under_its_recorded_stamp_is_laid_out_again_on_huge_pages(tmp_path, monkeypatch,
                                                                                         map_min):
    import os

    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    monkeypatch.setattr(huge_pages, "MAP_MIN", map_min)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", kind="Q8_0")
    ids = torch.tensor([[3, 17, 5, 99, 42, 7]])
    want = load_model(str(path), progress=False).logits(ids)
    damaged = max((tmp_path / "cache" / "layouts").rglob("*.bin"), key=lambda p: p.stat().st_size)
    st = damaged.stat()
    with open(damaged, "r+b") as f:  # one bit of the first sampled window, in place: the same inode and size
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    os.utime(damaged, ns=(st.st_atime_ns, st.st_mtime_ns))  # the stamp as recorded: only the windows tell
    again = load_model(str(path), progress=False)
    assert torch.equal(again.logits(ids), want)
    assert damaged.read_bytes()[:1] == first  # laid out again and rewritten


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_a_map_resident_in_small_folios_is_read_again_once_with_its_bytes_unchanged(tmp_path, monkeypatch):
    import numpy as np

    from lmhead.models import layout_cache

    if not huge_pages.available():
        pytest.skip("no transparent huge pages here (or LMHEAD_HUGE_PAGES=0)")
    data = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    path = tmp_path / "layouts" / "m.bin"
    path.parent.mkdir()
    with open(path, "wb") as f:  # small writes: the page cache holds it in small folios
        for at in range(0, data.nbytes, 64 << 10):
            f.write(data[at:at + (64 << 10)])
    with huge_pages.arena_for_load() as arena:
        raw = np.memmap(path, dtype=np.uint8, mode="c")
        huge_pages.advise(raw, path)
        layout_cache._fill_page_tables(raw)  # resident: its page tables filled, on 4 KiB pages
        view = torch.from_numpy(raw[: 1 << 20])  # a view made before, as a loaded matrix's
        assert huge_pages.refold(arena) == raw.nbytes
    assert np.array_equal(raw, data) and torch.equal(view, torch.from_numpy(data[: 1 << 20]))
    rss, pmd = huge_pages._maps_pmd()[raw.ctypes.data]
    assert pmd >= (4 << 20) or (path.parent / huge_pages.NO_FOLIOS).exists()  # huge pages, or said not to retry
    with huge_pages.arena_for_load() as again:
        again_raw = np.memmap(path, dtype=np.uint8, mode="c")
        huge_pages.advise(again_raw, path)
        layout_cache._fill_page_tables(again_raw)
        assert huge_pages.refold(again) == 0  # once
