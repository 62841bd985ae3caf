// lmhead explainer — the "Parameters" tab: the loaded model's parameters by component beside GPT-2 small's (GET
// /api/params).

import { $, api, el, pct } from "./util.js";

export async function loadParams() {
  const box = $("#params-out");
  if (box.dataset.loaded) return;
  try {
    const r = await api("/api/params");
    const m = r.model, g = r.gpt2_small;
    const names = [["token_embedding", "token embedding [V, D]"], ["positions", "positions"], ["attention", "attention"],
      ["mlp", "MLP"], ["norms", "norms"], ["lm_head", "LM head (own weight)"], ["other", "other"]];
    const t = el("table", { class: "params" });
    t.append(el("caption", { text: "Parameters by component: the loaded model (counted from its modules) and GPT-2 small (124M, for comparison)" }));
    t.append(el("thead", {}, el("tr", {}, el("th", { text: "component" }), el("th", { text: m.name }), el("th", { text: "share" }),
      el("th", { text: "GPT-2 small" }), el("th", { text: "share" }))));
    const tb = el("tbody");
    const barCell = (share) => {
      const td = el("td", { class: "bar-cell" });
      const b = el("div", { class: "bar" }, el("span"), el("em", { text: pct(share) }));
      b.firstChild.style.width = `${share * 100}%`;
      td.append(b);
      return td;
    };
    for (const [k, label] of names) {
      const mv = m[k] || 0, gv = g[k] || 0;
      if (!mv && !gv) continue;
      tb.append(el("tr", {}, el("td", { text: label }), el("td", { text: mv.toLocaleString() }), barCell(mv / m.total),
        el("td", { text: gv.toLocaleString() }), barCell(gv / g.total)));
    }
    tb.append(el("tr", { class: "head" }, el("td", { text: "total" }), el("td", { text: m.total.toLocaleString() }), el("td"),
      el("td", { text: g.total.toLocaleString() }), el("td")));
    tb.append(el("tr", { class: "head" }, el("td", { text: "the head's matrix (tied: the embedding)" }),
      el("td", { text: m.tied ? "tied" : "untied" }), barCell(m.head_share), el("td", { text: g.tied ? "tied" : "untied" }),
      barCell(g.head_share)));
    t.append(tb);
    box.replaceChildren(t, el("p", { class: "hint", text:
      `The head's [V, D] matrix is ${pct(m.head_share)} of ${m.name}'s parameters (${pct(g.head_share)} of GPT-2 small's): ` +
      "in a small model with a large vocabulary the output layer is a large part of the model." }));
    box.dataset.loaded = "1";
  } catch (e) {
    box.textContent = e.message;
  }
}
