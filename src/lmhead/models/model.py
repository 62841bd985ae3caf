"""`Model`: a transformers body and tokenizer, with lmhead's heads on the model's own head weight.

    ids [B,T] ──hf_model.model (embedding, blocks, final norm)──▶ hidden [B,T,D] ──self.head──▶ logits [B,T',V]

Two heads, both built in `__init__`: `exact_head`, the fp32 `LMHead`, and `head`, the one chosen by `head=`
(that same LMHead for "fp32", else a compressed head on the same weight: `heads.py`).

lmhead takes over after the body: `hidden_states()` stops at the final norm, and everything after it (the head,
its softcap, the sampling pipeline) is lmhead's. The head shares the model's weight (tied or not); nothing is
copied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lmhead.head import LMHead
from lmhead.models import parts
from lmhead.models.fast_linear import onednn_available, with_onednn_linears
from lmhead.models.heads import build_head, check_head_mode
from lmhead.models.lean import SUPPORTED_MODEL_TYPES, LeanBody

# How the body runs: "lean" (models/lean.py: the forward written out over the same weights, static KV cache,
# fused products; Gemma 3 and Llama-style models), "onednn" (transformers' modules with oneDNN's linear kernel),
# "transformers" (the modules exactly as transformers built them); "auto": lean where supported, else onednn
# when torch has oneDNN, else transformers.
BODY_MODES: tuple[str, ...] = ("auto", "lean", "onednn", "transformers")


class Model:
    """A loaded language model: its body, both heads and its tokenizer. Build it with `lmhead.load_model(...)`,
    whose `lmhead.Model` (`lmhead/api.py`) adds the calls that run the higher floors on it (generate, predict,
    evaluate, perplexity); the library's own functions take either (`generate.generate(model, ...)`,
    `explain.predict(model, ...)`).

    Attributes: `hf_model` (transformers, eval mode, float32), `body` (its embedding, blocks and final norm;
    by default a copy sharing every weight whose linear layers run oneDNN's kernel: `body` in BODY_MODES),
    `tokenizer`, `exact_head` (the fp32 LMHead sharing the model's head weight; softcap from
    `config.final_logit_softcapping`), `head` (the head of mode `head`, see `lmhead.models.heads`: "fp32",
    the default here, is `exact_head` itself; `load_model` defaults to "auto"), `name`, `config`,
    `eos_token_ids`, `context_length`, `path` (the folder it was loaded from; keys the compressed-head cache).
    `codes=True` (default): the lean body's and the exact head's products run the kernels — a GGUF file's codes
    where the model came from one (`use_codes`), else the float32 product over the model's own weights
    (`use_dense`); either sums each row in one order whatever rows a call holds beside it. `codes=False`: torch's
    products (oneDNN's inner product, `F.linear`).
    """

    def __init__(self, hf_model, tokenizer, name: str = "model", path: Path | None = None,
                 body: str = "auto", head: str = "fp32", codes: bool = True, progress: bool = False) -> None:
        check_head_mode(head)
        if body not in BODY_MODES:
            raise ValueError(f"body must be one of {', '.join(BODY_MODES)}; got {body!r}")
        if body == "onednn" and not onednn_available():
            raise ValueError("body='onednn': this torch build has no oneDNN (mkldnn); use body='transformers'")
        if body == "lean" and not LeanBody.supports(hf_model):
            raise ValueError(f"body='lean' supports the model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
                             f"this model is {getattr(hf_model.config, 'model_type', '?')!r}")
        self.hf_model = hf_model.float().eval()
        self.tokenizer = tokenizer
        self.name = name
        self.path = path
        self.gguf_path: Path | None = None  # the GGUF file the weights are read from, where they are
        self.config = hf_model.config
        text_config = parts.text_config(self.config)
        # embedding + blocks + final norm; with oneDNN linears (the same weights, see fast_linear.py) unless
        # body="transformers". hf_model itself is left as transformers built it.
        decoder = parts.body(hf_model)
        self.body = decoder if body == "transformers" else with_onednn_linears(decoder)
        # the lean body (generate, predict, evaluate all run it when set); shares every weight with hf_model
        use_lean = body == "lean" or (body == "auto" and LeanBody.supports(hf_model))
        self.lean = LeanBody(hf_model) if use_lean else None
        out = hf_model.get_output_embeddings()
        softcap = getattr(text_config, "final_logit_softcapping", None)
        self.exact_head = LMHead.from_weight(out.weight, bias=getattr(out, "bias", None), softcap=softcap or None)
        self.eos_token_ids = _eos_ids(hf_model, tokenizer)
        self.context_length = parts.context_length(self.config)
        if getattr(tokenizer, "pad_token_id", None) is None and self.eos_token_ids:
            tokenizer.pad_token_id = self.eos_token_ids[0]
        # the GGUF file's own codes for the decode-sized products (before the head: "auto" depends on them)
        self.coded_matrices = self.use_codes(progress=progress) if codes else 0
        # a float32 model without them: the kernel's float32 product over its own weights (batch-invariant)
        self.dense_matrices = self.use_dense() if codes and not self.coded_matrices else 0
        # last: a compressed head is calibrated on this model's hidden states (body and tokenizer above)
        self.head = build_head(self, head)

    def use_codes(self, progress: bool = True) -> int:
        """Let decode-sized products — the lean body's and the fp32 head's (`exact_head.product`) — read the GGUF
        file's own codes (`models/gguf_codes.py`: the float32 weights exactly, 0.6–1.1 bytes per weight instead
        of 4) where this model came from one and the coded kernel builds here. Returns how many matrices run
        coded (0: the float32 products — the same numbers, slower)."""
        from lmhead.models.coded_linear import CodedLinear, coded_available
        from lmhead.models.gguf_codes import codes_for_model, module_codes

        if self.path is None or not coded_available():
            return 0
        codes = codes_for_model(self, progress=progress)
        count = self.lean.use_codes(codes) if self.lean is not None else 0
        out = self.hf_model.get_output_embeddings()
        tied = out.weight is self.hf_model.get_input_embeddings().weight
        head = module_codes(codes, "embed_tokens" if tied else "lm_head", self.exact_head.weight)
        if head is not None:
            self.exact_head.product = CodedLinear(head.codes, head.scale, head.offset, self.exact_head.weight)
            count += 1
        return count

    def use_dense(self) -> int:
        """A float32 model without a GGUF file's codes: its lean body's matrices and its head run the kernel's
        float32 product over the model's own weights (shared, not copied; `LeanBody.use_dense`), whose every row is
        summed in one order whatever rows a call multiplies beside it — a request's logprobs are then the same bits
        alone or in a server's batch, prefilled or decoded, as a GGUF file's are. Returns how many matrices run so
        (0: the kernel is not built here, or the weights are not float32 on the CPU)."""
        from lmhead.models.coded_linear import CodedLinear, coded_available

        count = self.lean.use_dense() if self.lean is not None else 0
        w = self.exact_head.weight
        if coded_available() and w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2:
            self.exact_head.product = CodedLinear.dense16(w.detach())
            count += 1
        return count

    @classmethod
    def from_file(cls, lean: LeanBody, tokenizer, config, eos_token_ids: list[int], exact_head, name: str,
                  path: Path, build_hf, head: str = "auto", body: str = "auto") -> Model:
        """A Model read straight from its GGUF file (`file_model.py`): the lean body and the exact head over the
        file's codes; `hf_model` and the transformers `body` are built on first use by `build_hf()` (the float32
        model, as the conversion cache holds it)."""
        check_head_mode(head)
        if body not in BODY_MODES:
            raise ValueError(f"body must be one of {', '.join(BODY_MODES)}; got {body!r}")
        self = cls.__new__(cls)
        self._hf_model, self._body, self._build_hf, self._body_mode = None, None, build_hf, body
        self.tokenizer, self.name, self.path, self.config = tokenizer, name, path, config
        self.gguf_path: Path | None = None  # the file the weights are read from (set by the loader)
        self.lean = lean if body in ("auto", "lean") else None
        self.exact_head = exact_head
        self.eos_token_ids = eos_token_ids
        self.context_length = parts.context_length(config)
        if getattr(tokenizer, "pad_token_id", None) is None and self.eos_token_ids:
            tokenizer.pad_token_id = self.eos_token_ids[0]
        parts_of = {"qkv": len(lean.arch.gguf_qkv), "gate_up": len(lean.arch.gguf_gate_up)}  # the file's matrices
        # each fused product holds
        self.coded_matrices = sum(parts_of.get(name, 1) for layer in lean.layers for name in (layer.coded or {})) \
            + int(getattr(exact_head, "product", None) is not None)
        self.dense_matrices = 0  # the file's F16, BF16 and F32 matrices are among its coded ones
        self.head = build_head(self, head)
        return self

    @property
    def hf_model(self):
        """transformers' float32 model of these weights (built on first use for a model read from its file)."""
        if self.__dict__.get("_hf_model") is None and self.__dict__.get("_build_hf") is not None:
            self._hf_model = self._build_hf()
            share = getattr(self.exact_head, "share", None)
            if share is not None:  # the exact head and transformers' then hold one float32 weight
                share(self._hf_model.get_output_embeddings().weight)
        return self.__dict__.get("_hf_model")

    @hf_model.setter
    def hf_model(self, value) -> None:
        self._hf_model = value

    @property
    def body(self):
        """The body as transformers' modules (embedding, blocks, final norm; oneDNN linears unless
        body="transformers"), built on first use for a model read from its file."""
        if self.__dict__.get("_body") is None and self.__dict__.get("_build_hf") is not None:
            decoder = parts.body(self.hf_model)
            self._body = decoder if self._body_mode == "transformers" else with_onednn_linears(decoder)
        return self.__dict__.get("_body")

    @body.setter
    def body(self, value) -> None:
        self._body = value

    @property
    def device(self) -> torch.device:
        """Where the model's tensors are (the CPU for every model lmhead loads)."""
        head = self.exact_head
        return head.device if hasattr(type(head), "device") else head.weight.device

    @classmethod
    def from_parts(cls, hf_model, tokenizer, head, body: str = "transformers") -> Model:
        """A Model over an existing transformers model, tokenizer and head module (an LMHead or a compressed
        head on the model's head weight) for the explain functions' older call form
        `predict(hf_model, tokenizer, head, ...)`: transformers' own modules; an LMHead becomes `exact_head`
        (what predict shows), a compressed head `head` (what predict(..., head="decode") shows)."""
        model = cls(hf_model, tokenizer, body=body, head="fp32")
        if isinstance(head, LMHead):
            model.exact_head = head
        model.head = head
        return model

    def __repr__(self) -> str:
        vocab, width = self.exact_head.vocab_size, self.exact_head.d_model
        return (f"Model({self.name!r}, vocab={vocab}, width={width}, "
                f"layers={getattr(self.config, 'num_hidden_layers', '?')}, context={self.context_length})")

    def auto_draft(self) -> str:
        """What `draft="auto"` runs: "ngram" where a decode step reads at least as many bytes in its head as in
        its body (the head's GGUF codes against the lean body's), else "none". A verification of k+1 positions
        reads every matrix once, so drafts save the reads of the tokens they get accepted — worth it when the
        reads are the step: measured on Gemma 3 270M (head 178 MB, body 101 MB: +22% greedy, +11% sampled) but not
        on SmolLM2-135M (30 MB against 66 MB: −10%, −6%), whose step is more the body's per-layer work."""
        product = getattr(self.exact_head, "product", None)
        if self.lean is None or product is None or not self.lean.nbytes:
            return "none"
        return "ngram" if product.nbytes >= self.lean.nbytes else "none"

    def auto_greedy_drafts(self) -> bool:
        """Whether `draft="auto"`, where `auto_draft()` is "none", still drafts n-grams for greedy rows (sampled
        rows then draft nothing): on the lean body over GGUF codes a verification of a few positions costs little
        more than one step, and greedy rows accept most of their n-grams; sampled rows do not gain from drafts
        (benchmarks/bench_decode.py measures both, alternating in one process)."""
        product = getattr(self.exact_head, "product", None)
        return self.lean is not None and product is not None and bool(self.lean.nbytes)

    @property
    def vocab_size(self) -> int:
        return int(self.exact_head.vocab_size)

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids, with the tokenizer's special tokens (e.g. Gemma's <bos>) as the model expects."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt must not be empty")
        return list(self.tokenizer.encode(prompt))

    @torch.no_grad()  # not inference_mode: callers may feed the result to autograd code
    def hidden_states(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      past_key_values: Any = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The body's final hidden state [B,T,D] (after the final norm) for `ids` [B,T].

        `past_key_values` (a transformers Cache) is extended in place with this call's keys and values (that
        runs `body`, transformers' modules); without it the lean body runs where the model has one.
        `attention_mask` [B, past+T] (1 = token, 0 = padding) and `position_ids` [B,T] serve left-padded batches
        (without a cache, positions default to counting the real tokens of each row).
        """
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        empty = past_key_values is None or past_key_values.get_seq_length() == 0
        if position_ids is None and attention_mask is not None and empty:
            # left padding: positions count real tokens only (as transformers' generate does)
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if self.lean is not None and past_key_values is None:
            return self._lean_states(ids, attention_mask, position_ids)
        out = self.body(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                        cache=past_key_values, use_cache=past_key_values is not None)
        return out.last_hidden_state

    def _lean_states(self, ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None, layers: list | None = None) -> torch.Tensor:
        b, t = ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=ids.device).expand(b, t)
        valid = None if attention_mask is None else attention_mask.bool()
        return self.lean(ids, position_ids, self.lean.new_cache(b, t), valid, layers=layers)

    @torch.no_grad()
    def layer_states(self, ids: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """(every layer's hidden state as transformers' `output_hidden_states` gives it — the embedding output,
        the residual stream after blocks 1..L-1, the normed output last —, the final hidden state [B,T,D])
        for `ids` [B,T]: what the logit lens reads."""
        if self.lean is not None:
            layers: list[torch.Tensor] = []
            last = self._lean_states(ids, None, None, layers)
            return (*layers, last), last
        out = self.body(input_ids=ids, output_hidden_states=True, use_cache=False)
        return tuple(out.hidden_states), out.last_hidden_state

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The body's final norm applied to a residual-stream tensor [..., D]."""
        if self.lean is not None:
            return self.lean.norm(hidden, self.lean.final_norm)
        return parts.final_norm(self.body)(hidden)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               logits_to_keep: int = 0) -> torch.Tensor:
        """lmhead's logits [B,T',V] float32 for `ids` [B,T]: the body, then our head (T' = logits_to_keep or T)."""
        return self.exact_head(self.hidden_states(ids, attention_mask), logits_to_keep=logits_to_keep)

    def new_cache(self):
        """An empty KV cache for this model (a transformers DynamicCache, sliding layers included)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)


def _eos_ids(hf_model, tokenizer) -> list[int]:
    """Every end-of-sequence id the model knows: generation_config's (int or list) and the tokenizer's."""
    ids: list[int] = []
    for value in (getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None),
                  getattr(hf_model.config, "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        if value is None:
            continue
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids
