"""Resolve a model name or path and load it: GGUF files straight from the file, HF folders as they are.

    load_model("gemma-3-270m")          a named model (registry.py): its package's GGUF, read in place
    load_model("path/to/file.gguf")     any local GGUF file, read in place (config + tokenizer cached once, keyed
                                        by path, size, mtime); `hf_model` converted once on first use
    load_model("path/to/hf-folder")     a Hugging Face folder (config.json + safetensors + tokenizer), as is
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmhead.models import cache
from lmhead.models.convert import Steps, check_gguf, convert_gguf
from lmhead.models.errors import ModelError
from lmhead.models.hf_tokenizer import fast_tokenizer, no_progress_bars
from lmhead.models.registry import DEFAULT_MODEL, MODELS, ModelSpec

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Source:
    """Where a model comes from: `kind` is "named", "gguf" or "folder"; `folder` is what gets loaded."""

    kind: str
    name: str
    path: Path | None = None  # the GGUF file or HF folder given by the user
    spec: ModelSpec | None = None


def resolve(name_or_path: str | os.PathLike[str]) -> Source:
    """Turn a model name or path into a Source, or raise ModelError saying what is accepted."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a model name or a path, got {type(name_or_path).__name__}")
    text = os.fspath(name_or_path)
    if not text.strip():  # Path("") is ".", the current folder: never what an empty name meant
        raise ModelError(f"name_or_path: empty; give a model name ({', '.join(MODELS)}), a .gguf file or a "
                         "model folder")
    if text in MODELS:
        return Source("named", text, spec=MODELS[text])
    path = Path(text).expanduser()
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF" or path.suffix.lower() == ".gguf":
            return Source("gguf", path.stem, path=path.resolve())
        raise ModelError(f"{path} is not a model: expected a .gguf file or a Hugging Face model folder "
                         "(config.json + safetensors + tokenizer)")
    if path.is_dir():
        missing = []
        if not (path / "config.json").is_file():
            missing.append("config.json")
        if not any((path / f).is_file() for f in _WEIGHT_FILES) and not list(path.glob("*.safetensors")):
            missing.append("weights (*.safetensors)")
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            missing.append("tokenizer (tokenizer.json or tokenizer.model)")
        if missing:
            raise ModelError(f"{path} is not a model folder: it has no {', no '.join(missing)}")
        return Source("folder", path.resolve().name, path=path.resolve())
    if os.sep in text or text.endswith(".gguf") or text.startswith("."):
        raise ModelError(f"no such file or folder: {text}")
    known = ", ".join(MODELS)
    raise ModelError(f"unknown model {text!r}; known models: {known} (or a .gguf file or a model folder path)")


def _key(source: Source) -> str:
    if source.kind == "named":
        return source.name
    digest = hashlib.sha1(str(source.path).encode()).hexdigest()[:10]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", source.name)[:60]
    return f"gguf-{slug}-{digest}"


def _source_facts(source: Source) -> dict[str, Any]:
    """What the cached folder must have been built from; compared with the manifest's `source`."""
    if source.kind == "named":
        return {"package": source.spec.distribution, "package_version": source.spec.package_version()}
    st = source.path.stat()
    return {"gguf_path": str(source.path), "gguf_size": st.st_size, "gguf_mtime_ns": st.st_mtime_ns}


def _cache_usable(folder: Path, source: Source, checksums: bool) -> str | None:
    """None when `folder` holds a usable conversion of `source`, else the reason it does not."""
    reason = cache.verify(folder, checksums=checksums)
    if reason is not None:
        return reason
    built = cache.read_manifest(folder).get("source", {})
    facts = _source_facts(source)
    if source.kind == "named" and facts["package_version"] is None:
        return None  # package uninstalled since: the converted copy is still the same model
    changed = [k for k, v in facts.items() if built.get(k) != v]
    return f"the source changed ({', '.join(changed)})" if changed else None


def cached_folder(source: Source, checksums: bool = False, progress: bool = True) -> Path:
    """The cache folder holding `source` converted to an HF folder, converting it first if needed.

    The folder is checked against its manifest first (sizes and checksums: `cache.verify`); a folder that
    fails (truncated, damaged in place, built from another source) is rebuilt from its source, or, where
    the source is gone, a ModelError names the folder, why it is unusable and how to rebuild it.
    """
    key = _key(source)
    folder = cache.models_dir() / key
    reason = _cache_usable(folder, source, checksums)
    if reason is None:
        _add_fast_checksums(folder, key)
        return folder
    if source.kind == "named":
        try:
            source.spec.require()
        except ModelError as exc:
            if not folder.exists():
                raise
            raise ModelError(f"the cached copy of {source.name} in {folder} is unusable ({reason}) and its "
                             f"source is gone; {exc}, then run the command again to rebuild the cache") from None
    with cache.lock(key):
        # Another process may have finished the conversion while we waited for the lock.
        reason = _cache_usable(folder, source, checksums)
        if reason is None:
            return folder
        cache.remove_stale_tmp(key)
        _build(source, folder, key, reason if folder.exists() else None, progress)
    return folder


def _add_fast_checksums(folder: Path, key: str) -> None:
    """A folder verified against an older manifest (sha256 only) gets the fast checksums for later loads."""
    manifest = cache.read_manifest(folder) or {}
    if all(cache.FAST_CHECKSUM in info for info in manifest.get("files", {}).values()):
        return
    with cache.lock(key):
        cache.add_fast_checksums(folder)


def _build(source: Source, folder: Path, key: str, stale_reason: str | None, progress: bool) -> None:
    import transformers
    from safetensors import SafetensorError

    import lmhead

    stream = None if progress else open(os.devnull, "w")  # closed in the finally clause
    tmp = cache.new_tmp_dir(key)
    try:
        title = f"lmhead: converting {source.name} to float32 safetensors (once; cached in {folder})"
        if stale_reason:
            title += f"\n  rebuilding the cached copy: {stale_reason}"
        steps = Steps(4, title, stream=stream)
        steps.step("locating the GGUF file" if source.kind != "named" else
                   f"getting the GGUF file from the package {source.spec.distribution}")
        src_dir = tmp / "gguf"
        src_dir.mkdir()
        gguf = source.spec.gguf(src_dir) if source.kind == "named" else source.path
        info = check_gguf(gguf)
        facts = _source_facts(source)
        facts.update(gguf_sha256=cache.sha256_file(gguf), gguf_size=info["size"],
                     architecture=info["architecture"], gguf_file=gguf.name)
        out = tmp / "out"
        out.mkdir()
        try:
            with contextlib.nullcontext() if progress else no_progress_bars():  # transformers' own tqdm bars
                extra = convert_gguf(gguf, out, steps, config=moe_hf_config(gguf))
            cache.write_manifest(out, {
                "name": source.name, "source": facts, **extra,
                "versions": {"lmhead": lmhead.__version__, "transformers": transformers.__version__,
                             "torch": __import__("torch").__version__},
            })
        except (OSError, SafetensorError) as exc:
            code = cache.no_space(exc)
            if not code:
                raise
            # the float32 weights (4 bytes a weight, as the file's tensor table counts them) and the rest
            raise cache.disk_error(OSError(code, os.strerror(code)), folder.parent,
                                   4 * _weights(gguf) + 64 * 2**20) from None
        steps.finish()
        cache.publish(out, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if stream is not None:
            stream.close()


def moe_hf_config(gguf: Path):
    """transformers' config of a mixture-of-experts GGUF file completed with what its GGUF reader leaves out (the
    experts' widths, `file_experts.moe_config`), or None for a file without experts; ModelError for a Mixtral-style
    llama file or a gpt-oss file, whose experts transformers' GGUF reader does not read."""
    from lmhead.models.file_experts import moe_config
    from lmhead.models.gguf_file import GGUFFile

    f = GGUFFile(gguf)
    try:
        if not any(name.endswith("_exps.weight") for name in f.tensors):
            return None
        if f.architecture == "gpt-oss":  # its loader takes none of the sinks, biases or experts by their names
            raise ModelError(f"{gguf}: transformers' GGUF reader does not read a gpt-oss file's sinks, biases and "
                             "experts (ffn_*_exps): lmhead runs it from the file, but transformers' float32 model "
                             "of it (hf_model: training, the transformers integration) cannot be built")
        from transformers import AutoConfig

        with no_progress_bars():
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if config.model_type == "llama":
            raise ModelError(f"{gguf}: transformers' GGUF reader does not read a Mixtral-style llama file's experts: "
                             "lmhead runs it from the file, but transformers' float32 model of it (hf_model: "
                             "training, the transformers integration) cannot be built")
        moe_config(f, config)
        return config
    finally:
        f.close()


def _weights(gguf: Path) -> int:
    """The number of weights in a GGUF file's tensors (its header's tensor table)."""
    from lmhead.models.gguf_file import read_header

    return sum(math.prod(t.shape) for t in read_header(gguf)[1])


def load_folder(folder: Path, cached: bool = False):
    """(hf_model in eval mode and float32, tokenizer) from an HF folder; errors become ModelError.

    `cached`: a folder this module wrote (tokenizer.json + tokenizer_config.json): use `fast_tokenizer`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = fast_tokenizer(folder) if cached else AutoTokenizer.from_pretrained(str(folder))
        with no_progress_bars():  # loading float32 safetensors takes a second: no "Loading weights" bar
            hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    except Exception as exc:
        raise ModelError(f"could not load the model folder {folder}: {type(exc).__name__}: {exc}") from exc
    return hf_model.eval(), tokenizer


def load_model(name_or_path: str | os.PathLike[str] = DEFAULT_MODEL, *, verify: bool = False,
               progress: bool = True, head: str = "auto", body: str = "auto", model_class: type | None = None):
    """Load a model by name ("gemma-3-270m", "smollm2-135m"), GGUF file path or HF folder path -> Model.

    GGUF models run straight from their file (`file_model.py`): the body and the exact head read the file's
    own codes; only the config and tokenizer transformers reads from the file are cached, once
    (`<cache>/meta/`). `hf_model` (transformers' float32 model) is built on first use from the conversion cache
    below. Architectures the lean body does not run from a file (and `LMHEAD_CONVERT=1`) are converted once
    into the cache (`lmhead.models.cache_root()`; a progress display goes to stderr) and loaded from there
    afterwards. Every load checks the cached files' sizes and fast checksums (`verify=True`: sha256) and
    rebuilds a folder that does not match; a cache that turns out unreadable is
    rebuilt once.
    `head` picks the LM head generate and the server's /v1 decode with (`lmhead.models.heads`): "auto"
    (default: "fp32" where the head reads the GGUF file's codes — exact and the fastest —, else "exact-int8" for
    heads of >= 256 MiB in fp32 and "fp32" below), "fp32", "exact-int8", "int8",
    "int4"; the fp32 head stays `model.exact_head`, which predict, the logit lens and evaluate compute with.
    `body` picks how the body's linear layers run (`lmhead.models.model.BODY_MODES`): "auto" (default:
    oneDNN's kernel when torch has it — the same weights; docs/models.md has the timings), "onednn",
    "transformers" (transformers' own modules). `hf_model` is transformers' model either way.
    `model_class`: the class built, `models.model.Model` or a subclass (None: `Model`; `lmhead.load_model`
    builds `lmhead.api.Model`, which adds generate, predict, evaluate and perplexity).
    """
    from lmhead.kernels import builder

    builder.start()  # a machine without the kernels compiles them while torch and the file are read
    from lmhead.models.heads import check_head_mode
    from lmhead.models.model import BODY_MODES, Model

    cls = Model if model_class is None else model_class
    check_head_mode(head)  # both checked before the slow load
    if body not in BODY_MODES:
        raise ValueError(f"body must be one of {', '.join(BODY_MODES)}; got {body!r}")

    source = resolve(name_or_path)
    if source.kind != "folder" and os.environ.get("LMHEAD_CONVERT") != "1":
        model = _load_file(source, head=head, body=body, progress=progress, cls=cls)
        if model is not None:
            return model
    if source.kind == "folder":
        hf_model, tokenizer = load_folder(source.path)
        return cls(hf_model, tokenizer, name=source.name, path=source.path, body=body, head=head)
    folder = cached_folder(source, checksums=verify, progress=progress)
    try:
        hf_model, tokenizer = load_folder(folder, cached=True)
    except ModelError as exc:  # passed the size check but does not load (e.g. a damaged header): rebuild
        with cache.lock(_key(source)):  # so that cached_folder rebuilds it
            shutil.rmtree(folder, ignore_errors=True)
        folder = cached_folder(source, checksums=True, progress=progress)
        try:
            hf_model, tokenizer = load_folder(folder, cached=True)
        except ModelError:
            raise exc from None
    return cls(hf_model, tokenizer, name=source.name, path=folder, body=body, head=head, progress=progress)


def _convertible(f) -> None:
    """ModelError where a GGUF file's architecture is none the lean body runs from a file and transformers' GGUF
    reader does not read either (one line naming it and the ones lmhead runs), or where its float32 conversion
    (4 bytes a weight, from the tensor table) cannot fit in the memory available now."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from lmhead.models.file_model import FILE_ARCHITECTURES

    runs = ", ".join(sorted({*FILE_ARCHITECTURES, "llama with ffn_*_exps (Mixtral)"}))
    arch = f.architecture
    if not {arch, arch.replace("-", "_"), arch.replace("moe", "_moe")} & set(GGUF_SUPPORTED_ARCHITECTURES):
        raise ModelError(f"{f.path}: the architecture {arch!r} is not one lmhead runs ({runs}) and transformers "
                         "cannot read it")
    _conversion_fits(f, f"the architecture {arch!r} is not one lmhead runs from its file ({runs})")


def _conversion_fits(f, why: str) -> None:
    """ModelError (saying `why` the file is converted) where the float32 conversion of a GGUF file (4 bytes a
    weight, from the tensor table) cannot fit in the memory available now: an error before the conversion,
    never a process the system kills halfway through it."""
    import numpy as np

    from lmhead.models.file_model import available_memory

    need = 4 * sum(int(np.prod(f.shape(name))) for name in f.tensors)
    have = available_memory()
    if have is not None and need > have and not os.environ.get("LMHEAD_IGNORE_MEMORY"):
        raise ModelError(f"{f.path}: {why}; transformers' float32 model of it needs about {need / 2**30:.1f} GiB "
                         f"of memory and {have / 2**30:.1f} GiB is available (LMHEAD_IGNORE_MEMORY=1 tries anyway)")


def _gguf_path(source: Source, folder: Path | None, workdir: Path) -> Path:
    """The GGUF file of a GGUF source: the user's file, the package's, or the one assembled into `folder`."""
    if source.kind == "gguf":
        return source.path
    if folder is not None and (folder / "model.gguf").is_file():
        return folder / "model.gguf"
    source.spec.require()
    return source.spec.gguf(workdir)


def _open_gguf(source: Source, progress: bool):
    """The source's GGUF file opened and its meta folder made or found: (file, folder, fresh), or None where its
    architecture is not one the lean body reads from a file (said once on stderr)."""
    import tempfile

    from lmhead.models.file_model import FILE_ARCHITECTURES, meta_folder
    from lmhead.models.gguf_file import GGUFFile

    key = _key(source)
    facts = _source_facts(source)
    folder = cache.meta_dir() / key
    # a file assembled from a package's chunks is made once, inside the folder being built: only then a workdir
    # in the cache (which may be read-only once built)
    building = source.kind == "named" and not (folder / "model.gguf").is_file()
    with tempfile.TemporaryDirectory(prefix="lmhead-gguf-", dir=cache.meta_dir() if building else None) as work:
        gguf = _gguf_path(source, folder if folder.exists() else None, Path(work))
        f = GGUFFile(gguf)  # a damaged file: its error (naming it) before anything is written
        if f.architecture not in FILE_ARCHITECTURES:
            arch = f.architecture
            try:
                _convertible(f)  # ModelError: neither lmhead nor transformers runs it, or it cannot fit
            finally:
                f.close()
            print(f"lmhead: {gguf.name}: the architecture {arch!r} (read from the file: "
                  f"{', '.join(FILE_ARCHITECTURES)}); running transformers' body on a float32 conversion",
                  file=sys.stderr, flush=True)
            return None
        assembled = gguf.parent == Path(work)
        try:
            folder, fresh = meta_folder(key, gguf, facts, progress=progress, keep=gguf if assembled else None)
        except BaseException:
            f.close()
            raise
        if assembled:  # moved into the folder (one file system: the map stays valid)
            f.path = folder / "model.gguf"
    return f, folder, fresh


def _load_file(source: Source, head: str, body: str, progress: bool, cls: type):
    """The model read straight from its GGUF file (`file_model.py`), or None where its architecture is not one the
    lean body runs from a file (said once on stderr; the caller converts it as before)."""
    from lmhead.head import LMHead
    from lmhead.models.coded_head import CodedHead
    from lmhead.models.coded_linear import CodedLinear
    from lmhead.models.file_experts import moe_config
    from lmhead.models.file_model import (
        check_fits,
        file_body,
        file_refusal,
        read_meta,
        supports_file,
    )
    from lmhead.models.heap import trim_heap

    opened = _open_gguf(source, progress)
    if opened is None:
        return None
    f, folder, fresh = opened
    cfg, tokenizer, eos = read_meta(folder, fresh)
    try:
        moe_config(f, cfg)  # the experts transformers' GGUF reader leaves out of the config, checked
    except BaseException:
        f.close()
        raise
    del fresh  # transformers' tokenizer made now: the tables answer for it (start_tokenizer)
    trim_heap()
    gguf = f.path
    fallback = None
    if not supports_file(f.architecture):  # asked only now: the kernels compiled while the above was read
        fallback = "no C compiler for the coded kernel (or its build failed its self-test)"
    elif (why := file_refusal(cfg)) is not None:
        fallback = f"the lean body does not run {why}"
    if fallback is not None:
        try:
            _conversion_fits(f, fallback)
        finally:
            f.close()
        print(f"lmhead: {gguf.name}: {fallback}; running transformers' body on a float32 conversion",
              file=sys.stderr, flush=True)
        return None
    try:
        check_fits(f)
        lean, weight, bias, tied = file_body(f, cfg)
    finally:
        f.close()
    trim_heap()  # the conversion's transient arrays
    softcap = cfg.final_logit_softcapping or None
    exact = (CodedHead(weight, bias=bias, softcap=softcap, tied=tied) if isinstance(weight, CodedLinear)
             else LMHead.from_weight(weight, bias=bias, softcap=softcap))

    def build_hf():
        print(f"lmhead: building transformers' float32 model of {source.name} (for hf_model; converted once "
              "and cached)", file=sys.stderr, flush=True)
        hf_model, _ = load_folder(cached_folder(source, progress=progress), cached=True)
        return hf_model.float().eval()

    model = cls.from_file(lean, tokenizer, cfg, eos, exact, name=source.name, path=folder, build_hf=build_hf,
                          head=head, body=body)
    model.gguf_path = Path(gguf)
    return model

