"""The models the page can choose from: the one the server started with, and the packaged ones, loaded on first use.

    registry = ModelRegistry(served)                  # served: the startup model's `Served`
    served = await registry.get("smollm2-135m")       # loads it (once; in a worker thread), then cached

Each loaded model gets its own `ModelRunner` (its calls are serialised, as the startup model's are) inside its
own `Served`. Loads run one at a time (an asyncio lock: two large models never load side by side), off the
event loop; a request for a model that is loading waits for that load. A model that cannot be loaded is an
`APIError` (503, the loader's message) and is tried again on the next request; an unknown name is a 404
listing the names. `served.get_served` asks the registry when a request carries `?model=NAME`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio.to_thread

from lmhead.models.start_tokenizer import transformers_tokenizer
from lmhead.server.errors import APIError
from lmhead.server.runner import ModelRunner
from lmhead.server.served import Served

__all__ = ["ModelRegistry", "load_packaged"]


def load_packaged(name: str) -> Any:
    """A packaged model by name (`lmhead.load_model`, default head and body, no progress display)."""
    from lmhead.models import load_model

    model = load_model(name, progress=False)
    transformers_tokenizer(model.tokenizer)  # as create_app: built now, not in the first chat request
    return model


class ModelRegistry:
    """Models by name: `names` (the startup model first, then the packaged ones), `loaded()`, `await get(name)`."""

    def __init__(self, served: Served, names: list[str] | None = None,
                 loader: Callable[[str], Any] = load_packaged) -> None:
        if names is None:
            from lmhead.models import MODELS

            names = list(MODELS)
        self.default = served.name
        self.names = [served.name, *(n for n in names if n != served.name)]
        self._served: dict[str, Served] = {served.name: served}
        self._loader = loader
        self._lock = asyncio.Lock()
        self.errors: dict[str, str] = {}  # the last load failure per name (cleared by a load that works)

    def loaded(self) -> list[str]:
        return [n for n in self.names if n in self._served]

    def describe(self) -> dict[str, Any]:
        """GET /api/models: each name, whether it is loaded (and its last load error), and the default."""
        return {"default": self.default,
                "models": [{"name": n, "loaded": n in self._served, "default": n == self.default,
                            "error": self.errors.get(n)} for n in self.names]}

    async def get(self, name: str) -> Served:
        """The `Served` of model `name`, loading it first if needed (one load at a time)."""
        served = self._served.get(name)
        if served is not None:
            return served
        if name not in self.names:
            raise APIError(404, f"model: unknown model {name!r}; choose one of {', '.join(self.names)}", "model",
                           "model_not_found")
        async with self._lock:
            served = self._served.get(name)  # loaded while this request waited
            if served is not None:
                return served
            try:
                model = await anyio.to_thread.run_sync(self._loader, name)
            except Exception as exc:  # any loader failure: the page shows it, the server keeps running
                self.errors[name] = f"{type(exc).__name__}: {exc}"
                raise APIError(503, f"model {name!r} could not be loaded: {exc}", "model", "model_load_failed") from exc
            self.errors.pop(name, None)
            served = Served(model, ModelRunner(model), name)
            self._served[name] = served
            return served
