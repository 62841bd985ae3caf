"""vLLM's fields as its clients send them: `bad_words` as words, tokenised as vLLM tokenises them (with and without
a leading space) and never completed, token-id sequences as before, a word that tokenises to nothing a 400 naming
it; `top_k: -1` is off, as 0; llama.cpp's `dry_sequence_breakers` as strings are the tokens that hold them."""

from __future__ import annotations

import pytest
from server_harness import tiny_served_model

from lmhead.server.words import word_sequences

PROMPT = "the cat and the dog went to the market and the"


def _greedy(client, **extra) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return client.app.state.model.tokenizer.encode(r.json()["choices"][0]["text"], add_special_tokens=False)


def test_a_word_is_tokenised_with_and_without_a_leading_space_as_vllm_does():
    tok = tiny_served_model().tokenizer
    bare = tok.encode("the", add_special_tokens=False)
    spaced = tok.encode(" the", add_special_tokens=False)
    want = [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
    assert word_sequences(tok, ["  the"]) == want
    assert word_sequences(tok, [[3, 4], "the"]) == [[3, 4], *want]


def test_bad_words_as_words_ban_what_the_greedy_answer_would_say(client):
    tok = client.app.state.model.tokenizer
    free = _greedy(client)
    word = next((w for w in (tok.decode([t]) for t in free) if w.strip() and [tok.encode(w.lstrip(),
                 add_special_tokens=False)] == word_sequences(tok, [w])[:1] and len(word_sequences(tok, [w])[0]) == 1),
                None)
    if word is None:
        pytest.skip("no generated token is a one-token word of this tokenizer")
    banned = {s[0] for s in word_sequences(tok, [word])}
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    got = client.post("/v1/completions", json={**body, "bad_words": [word]})
    assert got.status_code == 200, got.text
    by_ids = client.post("/v1/completions", json={**body, "bad_words": [[t] for t in sorted(banned)]})
    assert got.json()["choices"][0]["text"] == by_ids.json()["choices"][0]["text"]
    chosen = got.json()["choices"][0]["logprobs"]["tokens"]
    assert not banned & {tok.convert_tokens_to_ids(t) for t in chosen if t in tok.get_vocab()}
    assert got.json()["choices"][0]["text"] != tok.decode(free)


def test_bad_words_in_a_chat_request_are_accepted_as_words(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 3, "temperature": 0, "bad_words": ["the", [5]]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("word", ["", "   "])
def test_a_word_that_tokenises_to_nothing_is_a_400_naming_it(client, word):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "bad_words": ["dog", word]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "bad_words" and "bad_words[1]" in err["message"]


def test_top_k_minus_one_is_off_as_vllm_clients_send_it(client):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.8, "seed": 5, "ignore_eos": True}
    off = client.post("/v1/completions", json={**body, "top_k": -1})
    assert off.status_code == 200, off.text
    assert off.json()["choices"][0]["text"] == client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert client.post("/v1/completions", json={**body, "top_k": -2}).status_code == 422


def test_dry_sequence_breakers_as_strings_are_the_tokens_that_hold_them(client):
    from lmhead.server.words import breaker_ids

    tok = client.app.state.model.tokenizer
    texts = [tok.decode([i]) for i in range(len(tok))]
    want = sorted({i for i, t in enumerate(texts) if "e" in t} | {3})
    assert breaker_ids(tok, ["e", 3]) == want
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "dry_multiplier": 0.8,
            "dry_allowed_length": 1}
    by_text = client.post("/v1/completions", json={**body, "dry_sequence_breakers": ["e", 3]})
    by_ids = client.post("/v1/completions", json={**body, "dry_sequence_breakers": want})
    assert by_text.status_code == 200, by_text.text
    assert by_text.json()["choices"][0]["text"] == by_ids.json()["choices"][0]["text"]
    for bad in ("", "\u2603\u2603\u2603 no token holds this"):
        r = client.post("/v1/completions", json={**body, "dry_sequence_breakers": ["e", bad]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dry_sequence_breakers"
        assert "dry_sequence_breakers[1]" in r.json()["error"]["message"]
