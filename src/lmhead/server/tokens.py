"""vLLM's tokenizer routes (lm-evaluation-harness's `tokenizer_backend=remote` reads them):

    POST /tokenize         {prompt | messages, add_special_tokens, add_generation_prompt, return_token_strs}
                           → {count, max_model_len, tokens, token_strs}
    POST /detokenize       {tokens} → {prompt}
    GET  /tokenizer_info   the tokenizer's special tokens, chat template and limits

The served model's own tokenizer, as `Model.encode` and the chat template use it; errors in OpenAI's shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from lmhead.server import schemas as S
from lmhead.server.errors import APIError
from lmhead.server.served import Served, check_chars, context_of, get_served

router = APIRouter(tags=["tokenizer"])


def _check_model(served: Served, name: str | None) -> None:
    if name not in (None, served.name):
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{served.name}'",
                       "model", "model_not_found")


def _tokenize(model: Any, req: S.TokenizeRequest) -> list[int]:
    tok = model.tokenizer
    if req.messages is not None:
        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "messages: the served model has no chat template (a base model); send a prompt",
                           "messages")
        text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=req.add_generation_prompt)
        return list(tok(text, add_special_tokens=False)["input_ids"])
    return list(tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])


@router.post("/tokenize", summary="Token ids of a prompt or of chat messages (vLLM's shape)")
async def tokenize(req: S.TokenizeRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    _check_model(served, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", "prompt")
    texts = [req.prompt] if req.prompt is not None else ["".join(m.text() for m in req.messages or [])]
    check_chars(served.limits, texts, "prompt" if req.prompt is not None else "messages")
    ids = await served.call(_tokenize, served.model, req)
    strs = served.model.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": context_of(served), "tokens": ids, "token_strs": strs}


def _decode(model: Any, tokens: list[int]) -> str:
    vocab = model.vocab_size
    bad = next((t for t in tokens if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
    return model.tokenizer.decode(tokens)


@router.post("/detokenize", summary="The text of token ids (vLLM's shape)")
async def detokenize(req: S.DetokenizeRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    _check_model(served, req.model)
    return {"prompt": await served.call(_decode, served.model, req.tokens)}


@router.get("/tokenizer_info", summary="The tokenizer's special tokens, chat template and limits (vLLM's shape)")
async def tokenizer_info(served: Served = Depends(get_served)) -> dict[str, Any]:
    tok = served.model.tokenizer
    return {"tokenizer_class": type(tok).__name__, "model": served.name,
            "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
            "unk_token": getattr(tok, "unk_token", None), "add_bos_token": getattr(tok, "add_bos_token", None),
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
            "eos_token_ids": list(getattr(served.model, "eos_token_ids", [])),
            "vocab_size": served.model.vocab_size, "model_max_length": context_of(served),
            "max_model_len": context_of(served), "chat_template": getattr(tok, "chat_template", None)}
