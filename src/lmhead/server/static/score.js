// lmhead explainer — the "Score a text" tab: every token of a text with its probability and rank, and the
// perplexity (POST /api/score).

import { $, api, el, pct, visible } from "./util.js";

export async function score(ev) {
  ev.preventDefault();
  const text = $("#score-text").value;
  const out = $("#score-out");
  out.textContent = "Scoring…";
  try {
    const r = await api("/api/score", { text });
    const frag = document.createDocumentFragment();
    for (const t of r.tokens) {
      let cls = "first", title = `${visible(t.decoded)} (id ${t.token_id}): the first token — nothing predicts it`;
      if (t.rank !== null) {
        cls = t.rank === 1 ? "r1" : t.rank <= 10 ? "r10" : t.rank <= 100 ? "r100" : "rmore";
        title = `${visible(t.decoded)} (id ${t.token_id}): p = ${pct(Math.exp(t.logprob))}, rank ${t.rank.toLocaleString()}`;
      }
      frag.append(el("span", { class: `tok ${cls}`, title, tabindex: "0", "data-rank": String(t.rank ?? ""),
        "aria-label": title }, t.decoded));
    }
    out.replaceChildren(frag);
    $("#score-summary").textContent = `Perplexity ${r.perplexity.toFixed(2)} · mean loss ${r.loss.toFixed(3)} nats over ${r.scored_count} predicted tokens`;
  } catch (e) {
    out.textContent = e.message;
  }
}
