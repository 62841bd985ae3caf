"""An entry point's fields (CLI arguments, a request body) → a `SamplingConfig`: the one place where the CLI and the
server turn user input into a config, so the same input gets the same config or the same error."""

from __future__ import annotations

from typing import Any

from lmhead.checks import OptionError
from lmhead.sampling.config import SamplingConfig
from lmhead.sampling.steps import ENTRY_FIELDS

__all__ = ["SAMPLING_FIELDS", "sampling_config_from"]

SAMPLING_FIELDS: tuple[str, ...] = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                    "presence_penalty", "frequency_penalty")  # and the steps' declared fields


def sampling_config_from(fields: Any, seed: int | None = None) -> SamplingConfig:
    """The `SamplingConfig` of an entry point's fields (CLI arguments, a request body): the one place where
    the CLI and the server turn user input into a config, so the same input gets the same config or error.

    fields: any object; its attributes named in `SAMPLING_FIELDS` and in the steps' declared fields
    (`lmhead.sampling.steps.ENTRY_FIELDS`: typical_p, dry_*, mirostat*, ...) are used, missing ones (and None:
    not given) keep SamplingConfig's defaults. Its `logit_bias`, if any and not empty,
    maps token ids written as strings (JSON object keys) to floats. `seed` is passed as given (see
    `seed_for_step` for per-call seeds). Its `banned_tokens`, if any, are passed as given.
    Raises ValueError / TypeError with SamplingConfig's messages; a key that is not an int is an
    `OptionError` naming `logit_bias`.
    """
    given = {name: getattr(fields, name, None) for name in (*SAMPLING_FIELDS, *(p.name for p in ENTRY_FIELDS))}
    kwargs: dict[str, Any] = {name: value for name, value in given.items() if value is not None}
    kwargs["seed"] = seed
    banned = getattr(fields, "banned_tokens", None)
    if banned:  # None or empty: not given
        kwargs["banned_tokens"] = banned
    bias = getattr(fields, "logit_bias", None)
    if bias:
        try:
            kwargs["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except ValueError as exc:
            raise OptionError("logit_bias keys must be token ids", "logit_bias") from exc
    return SamplingConfig(**kwargs)
