"""Showing tokens: whitespace made visible, a token's text (its bytes where it is no whole character), specials
marked."""

from __future__ import annotations

import codecs
import functools
from collections.abc import Sequence

_VISIBLE = {" ": "·", "\n": "↵", "\t": "⇥", "\r": "␍"}


def visible(text: str) -> str:
    """`text` with whitespace made visible: space "·", newline "↵", tab "⇥", CR "␍", other controls "\\xNN"."""
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (bytes_to_unicode), inverted: vocabulary character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _hex_bytes(err: UnicodeDecodeError) -> tuple[str, int]:
    return "".join(f"<0x{b:02X}>" for b in err.object[err.start:err.end]), err.end


codecs.register_error("lmhead_hex", _hex_bytes)


def _piece_text(piece: str, decoded: str) -> str:
    """A token that is only part of a UTF-8 character: its bytes, valid UTF-8 as text, the rest "<0xNN>"."""
    table = _byte_decoder()
    if piece and all(ch in table for ch in piece):  # byte-level BPE (GPT-2, Llama 3, SmolLM): piece = bytes
        return visible(bytes(table[ch] for ch in piece).decode("utf-8", errors="lmhead_hex"))
    return piece or visible(decoded)  # e.g. SentencePiece byte fallback: the piece is already "<0xE2>"


def special_ids(tokenizer) -> set[int]:
    return {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}


def token_texts(tokenizer, token_ids: Sequence[int]) -> list[tuple[str, str]]:
    """(visible, decoded) text of each token on its own.

    decoded: the token decoded alone (`tokenizer.decode([id])`, specials kept). visible: special tokens as
    their name (e.g. "<bos>"), whitespace made visible (`visible`), and tokens that are only part of a
    UTF-8 character (they decode to "�") as their bytes, e.g. "<0xE2><0x80>" (or the vocabulary piece).
    """
    specials = special_ids(tokenizer)
    out = []
    for tid in token_ids:
        tid = int(tid)
        decoded = tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if tid in specials:
            shown = tokenizer.convert_ids_to_tokens(tid) or decoded
        elif "\ufffd" in decoded:
            shown = _piece_text(tokenizer.convert_ids_to_tokens(tid) or "", decoded)
        else:
            shown = visible(decoded)
        out.append((shown, decoded))
    return out
