// Swap the head: the prompt's final hidden state through the LM head (V rows) and through a classification head
// (K rows: the LM head's rows of the class words — the zero-shot classifier — or the server's --classifier head).
// POST /api/swap (server/pooling.py, lmhead.explain_swap.swap).

import { api } from "./util.js";

const $ = (id) => document.getElementById(id);

function pct(p) {
  return p >= 0.0001 ? `${(100 * p).toFixed(2)}%` : p > 0 ? "<0.01%" : "0%";
}

function headTable(view, modelParams) {
  const box = document.createElement("div");
  box.className = "swap-head";
  const h = document.createElement("h3");
  const share = 100 * view.share;
  h.textContent = `${view.name}: ${view.rows.toLocaleString()} × ${view.width} = ` +
    `${view.parameters.toLocaleString()} parameters (${share < 0.01 ? share.toExponential(2) : share.toFixed(2)}% ` +
    `of the model's ${modelParams.toLocaleString()}${view.tied ? "; tied to the embedding" : ""})`;
  box.appendChild(h);
  const table = document.createElement("table");
  table.className = "stage";
  const head = table.createTHead().insertRow();
  for (const t of [view.rows > 100 ? "token" : "class", "logit", "probability"]) {
    const th = document.createElement("th");
    th.textContent = t;
    head.appendChild(th);
  }
  const body = table.createTBody();
  for (const r of view.top) {
    const row = body.insertRow();
    row.insertCell().textContent = r.label;
    row.insertCell().textContent = r.logit.toFixed(3);
    const cell = row.insertCell();
    const bar = document.createElement("span");
    bar.className = "swap-bar";
    bar.style.width = `${Math.max(0.05, 8 * r.probability).toFixed(2)}em`;
    cell.append(bar, ` ${pct(r.probability)}`);
  }
  box.appendChild(table);
  return box;
}

async function run() {
  const out = $("swap-out");
  const prompt = $("prompt").value;
  const labels = $("swap-labels").value.split(",").map((s) => s.trim()).filter(Boolean);
  out.textContent = "…";
  try {
    const s = await api("/api/swap", { prompt, labels: labels.length ? labels : null, top: 10 });
    out.textContent = "";
    const p = document.createElement("p");
    p.className = "hint";
    p.textContent = `One final hidden state h (‖h‖ = ${s.hidden_norm.toFixed(1)}, the last token of the prompt) ` +
      "goes into both heads. Each probability is a softmax over that head's own rows.";
    out.append(p, headTable(s.lm, s.model_parameters), headTable(s.swapped, s.model_parameters));
  } catch (e) {
    out.textContent = `Could not swap the head: ${e.message}`;
  }
}

$("swap").addEventListener("click", run); // a module runs once the page is parsed
