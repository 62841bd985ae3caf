// lmhead explainer — the "Layers" panel: the logit lens at the prompt's last position (POST /api/layers).

import { $, api, el, pct, visible } from "./util.js";

export async function loadLayers() {
  const box = $("#layers");
  const prompt = $("#prompt").value;
  if (!prompt) return;
  box.textContent = "Loading…";
  try {
    const r = await api("/api/layers", { prompt, top: 5 });
    const layers = r.layers || [];
    const t = el("table", { class: "heat" });
    t.append(el("caption", { text: "Top 5 tokens per layer at the last position (0 = embeddings; the last row is the model's output)" }));
    const head = el("tr", {}, el("th", { text: "layer", scope: "col" }));
    for (let j = 1; j <= 5; j++) head.append(el("th", { text: `top ${j}`, scope: "col" }));
    head.append(el("th", { text: "final token", scope: "col" }), el("th", { text: "entropy", scope: "col" }));
    t.append(el("thead", {}, head));
    const tb = el("tbody");
    for (const L of layers) {
      const tr = el("tr", { "data-layer": String(L.layer) }, el("th", { text: String(L.layer), scope: "row" }));
      for (const c of L.candidates) {
        const td = el("td", { class: "cell", title: `id ${c.token_id}: ${pct(c.probability)}` });
        const alpha = Math.max(0.04, Math.min(1, c.probability));
        td.style.background = `rgba(47, 111, 228, ${alpha})`;
        td.style.color = alpha > 0.5 ? "#fff" : "inherit";
        td.append(visible(c.text), el("span", { class: "p", text: pct(c.probability) }));
        tr.append(td);
      }
      tr.append(el("td", { text: `${pct(L.final_token_probability)} (rank ${L.final_token_rank})` }));
      tr.append(el("td", { text: L.entropy.toFixed(2) }));
      tb.append(tr);
    }
    t.append(tb);
    box.replaceChildren(t);
  } catch (e) {
    box.textContent = e.message;
  }
}
