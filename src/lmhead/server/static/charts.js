// lmhead explainer — the pictures, as plain SVG (no library). Each function draws one chart into a <figure>:
// an <svg role="img"> with a <title> and a <desc> (what it shows, in words), and a table of its numbers (the text
// alternative; the tests read it). All numbers come from the server (lmhead.explain_charts), computed over the full
// vocabulary with the full-precision head; nothing here is estimated.
const NS = "http://www.w3.org/2000/svg";
let uid = 0;

function s(tag, attrs = {}, ...children) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) e.setAttribute(k, String(v));
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}
function h(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}
const txt = (x, y, str, attrs = {}) => s("text", { x, y, ...attrs }, String(str));
function pct(p) {
  if (p === null || p === undefined || Number.isNaN(p)) return "–";
  const v = p * 100;
  if (v === 0) return "0%";
  if (v >= 10) return v.toFixed(1) + "%";
  if (v >= 1) return v.toFixed(2) + "%";
  if (v >= 0.01) return v.toFixed(3) + "%";
  return v.toExponential(1) + "%";
}
const sci = (p) => (p === 0 ? "0" : p >= 1e-3 ? p.toPrecision(3) : p.toExponential(2));
const VIS = { " ": "·", "\n": "↵", "\t": "⇥", "\r": "␍" };
const visible = (t) => Array.from(t || "").map((c) => VIS[c] || c).join("");
const rankClass = (r) => (r === 1 ? "r1" : r <= 10 ? "r10" : r <= 100 ? "r100" : "rmore");

// An <svg> with its title and description, sized by its viewBox (it scales to the figure's width).
function frame(w, hgt, title, desc) {
  const id = "chart" + ++uid;
  const svg = s("svg", { viewBox: `0 0 ${w} ${hgt}`, role: "img", "aria-labelledby": `${id}-t ${id}-d`,
    preserveAspectRatio: "xMidYMid meet", class: "chart-svg" });
  svg.append(s("title", { id: `${id}-t` }, title), s("desc", { id: `${id}-d` }, desc));
  svg.style.maxWidth = `${Math.round(w * 1.25)}px`; // scaled to the column, but never blown up past its text size
  return svg;
}

// The drawing's width in SVG units: the figure's own width (320..640), so that text stays readable on a phone.
const widthOf = (fig) => Math.max(300, Math.min(640, (fig.clientWidth || 640) - 14));

function table(caption, head, rows, cls = "") {
  const t = h("table", { class: "chart-table " + cls });
  t.append(h("caption", { text: caption }));
  t.append(h("thead", {}, h("tr", {}, ...head.map((x) => h("th", { scope: "col", text: x })))));
  const tb = h("tbody");
  for (const r of rows) {
    const tr = h("tr");
    r.forEach((cell, i) => {
      const td = h(i === 0 ? "th" : "td", i === 0 ? { scope: "row" } : {});
      if (cell && typeof cell === "object") { td.textContent = cell.text; if (cell.value !== undefined) td.dataset.value = String(cell.value); if (cell.cls) td.className = cell.cls; } else td.textContent = String(cell);
      tr.append(td);
    });
    tb.append(tr);
  }
  t.append(tb);
  return t;
}
const numbers = (label, t, open = false) => {
  const d = h("details", { class: "numbers" }, h("summary", { text: label }), h("div", { class: "table-wrap" }, t));
  d.open = open;
  return d;
};

// ----------------------------------------------------------------------------------------------------------
// Probability against rank, log-log: raw (T = 1), after temperature, after the whole pipeline; the cut-offs.

// a cut's name as the stage table writes it (top_k → top-k, typical_p → typical-p; the server's step names)
const cutName = (step) => step.replace(/_/g, "-");
const cutSetting = (c) => (typeof c.setting === "number" && c.step !== "greedy" ? ` ${c.setting}` : "");

function rankChart(fig, d) {
  const W = widthOf(fig), H = W < 500 ? 260 : 300, L = 52, R = 10, T = 14, B = 40;
  const V = d.vocab_size;
  const pos = [];
  for (const a of [d.raw, d.scaled, d.processed]) for (const p of a) if (p > 0) pos.push(p);
  const lo = Math.max(-30, Math.floor(Math.log10(Math.min(...pos))));
  const X = (r) => L + (W - L - R) * (Math.log10(r) / Math.log10(Math.max(V, 10)));
  const Y = (p) => T + (H - T - B) * (Math.log10(Math.max(p, 10 ** lo)) / lo);
  const kept = d.kept_count;
  const top = d.processed[0];
  const cuts = d.cutoffs.map((c) => `${cutName(c.step)}${cutSetting(c)} leaves ${c.rank.toLocaleString()}`);
  const desc = `Probability of the r-th most likely token against r, both on log scales, over all ${V.toLocaleString()} ` +
    `tokens. Before the pipeline the top token has ${pct(d.raw[0])}; after it ${pct(top)}, and ${kept.toLocaleString()} ` +
    `tokens keep a probability above 0.` + (cuts.length ? ` Cut-offs: ${cuts.join("; ")}.` : " Nothing is cut.");
  const svg = frame(W, H, "Probability against rank, before and after the pipeline", desc);
  const g = s("g", { class: "axes" });
  for (let e = 0; e >= lo; e -= lo < -12 ? 4 : lo < -6 ? 2 : 1) {
    g.append(s("line", { x1: L, x2: W - R, y1: Y(10 ** e), y2: Y(10 ** e), class: "grid" }));
    g.append(txt(L - 6, Y(10 ** e) + 4, e === 0 ? "1" : `1e${e}`, { "text-anchor": "end", class: "tick" }));
  }
  for (let e = 0; 10 ** e <= V; e++) {
    g.append(s("line", { x1: X(10 ** e), x2: X(10 ** e), y1: T, y2: H - B, class: "grid" }));
    g.append(txt(X(10 ** e), H - B + 14, e < 3 ? String(10 ** e) : `1e${e}`, { "text-anchor": "middle", class: "tick" }));
  }
  g.append(txt((L + W - R) / 2, H - 6, "rank (1 = the most likely token), log scale", { "text-anchor": "middle", class: "label" }));
  g.append(txt(12, (T + H - B) / 2, "probability, log scale", { "text-anchor": "middle", class: "label",
    transform: `rotate(-90 12 ${(T + H - B) / 2})` }));
  svg.append(g);
  const path = (vals, cls, name) => {
    let dd = "";
    d.ranks.forEach((r, i) => { if (vals[i] > 0) dd += (dd ? "L" : "M") + X(r).toFixed(1) + " " + Y(vals[i]).toFixed(1); });
    return s("path", { d: dd, class: "curve " + cls, "data-curve": name });
  };
  for (const c of d.cutoffs) {
    const x = X(Math.max(1, c.rank));
    svg.append(s("line", { x1: x, x2: x, y1: T, y2: H - B, class: "cutline " + c.step, "data-step": c.step,
      "data-rank": c.rank }));
    svg.append(txt(x + 3, T + 12 + 12 * d.cutoffs.indexOf(c), `${cutName(c.step)} → ${c.rank.toLocaleString()}`,
      { class: "cutlabel " + c.step }));
  }
  svg.append(path(d.raw, "raw", "raw"), path(d.scaled, "scaled", "scaled"), path(d.processed, "processed", "processed"));
  const ki = d.ranks.indexOf(kept);
  if (ki >= 0 && kept < V) svg.append(s("circle", { cx: X(kept), cy: Y(d.processed[ki]), r: 4, class: "endmark" }));
  const legend = s("g", { class: "legend", transform: `translate(${W - R - 175}, ${T + 6})` });
  [["raw", "raw (T = 1, nothing cut)"], ["scaled", `after temperature ${d.config.temperature}`],
    ["processed", "after the whole pipeline"]].forEach(([cls, label], i) => {
    legend.append(s("line", { x1: 0, x2: 22, y1: i * 16, y2: i * 16, class: "curve " + cls }));
    legend.append(txt(28, i * 16 + 4, label, { class: "tick" }));
  });
  svg.append(legend);
  const show = new Set([1, 2, 3, 5, 10, 20, 50, 100, 1000, 10000, 100000, V, ...d.cutoffs.map((c) => c.rank)]);
  const rows = [];
  d.ranks.forEach((r, i) => {
    if (!show.has(r)) return;
    rows.push([String(r), { text: sci(d.raw[i]), value: d.raw[i] }, { text: sci(d.scaled[i]), value: d.scaled[i] },
      { text: sci(d.processed[i]), value: d.processed[i] }, { text: pct(d.scaled_cumulative[i]), value: d.scaled_cumulative[i] }]);
  });
  fig.replaceChildren(svg, h("figcaption", { class: "chart-caption", text: desc }),
    numbers("The curve as numbers", table("r-th largest probability of each distribution (exact, full vocabulary)",
      ["rank", "raw", "after T", "after pipeline", "mass of the top r after T"], rows, "rank-table")));
}

// ----------------------------------------------------------------------------------------------------------
// The head as projections: each row W[i] in the plane of h and the rows' top principal direction ⟂ h.
// probs: token id → {p, kept} under the current settings (from the page's pipeline), for colour and size.

function geometryChart(fig, g, probs) {
  const W = widthOf(fig), Hp = Math.round(W * 0.46), pad = 30;
  const c = g.candidates;
  const xs = c.map((x) => x.x), ys = c.map((x) => x.y);
  const span = Math.max(...xs.map(Math.abs), ...ys.map(Math.abs), 1e-9) * 1.18;
  const cx = W / 2, cy = Hp / 2 + 6, sc = Math.min((W / 2 - pad) / span, (Hp / 2 - pad) / span);
  const P = (x, y) => [cx + x * sc, cy - y * sc];
  // Below the plane, the h axis zoomed in on the candidates: where each row's projection (its logit) falls.
  const xlo = Math.min(...xs), xhi = Math.max(...xs), xpad = (xhi - xlo) * 0.08 || Math.abs(xhi) * 0.01 || 1;
  const ZX = (x) => 24 + (W - 48) * (x - (xlo - xpad)) / (xhi - xlo + 2 * xpad);
  const labelW = (k) => 7.6 * (visible(k.text).length + 7); // "token 12.34" in 12px monospace
  const rowEnd = [];
  const zrow = c.map((k) => {
    const x0 = Math.min(ZX(k.x), W - 4 - labelW(k));
    let r = rowEnd.findIndex((end) => end < x0);
    if (r < 0) { r = rowEnd.length; rowEnd.push(0); }
    rowEnd[r] = x0 + labelW(k);
    return r;
  });
  const zy = Hp + 28, H = zy + 22 + 14 * rowEnd.length;
  const desc = `The last position's hidden state h points right. Each word's head row W[i] is drawn in the plane of h ` +
    `and the direction in which these ${c.length} rows differ most apart from h. A row's horizontal position is its ` +
    `projection onto h: times ‖h‖ = ${g.hidden_norm.toFixed(2)} it is the word's logit` +
    (g.has_bias ? " before the bias" : "") + (g.softcap ? ` before the softcap ${g.softcap}` : "") +
    `. Below, the h axis zoomed in: the words in the order of their logits. Rightmost: ${visible(c[0].text)}.`;
  const svg = frame(W, H, "The head as projections onto word directions", desc);
  svg.append(s("line", { x1: pad / 2, x2: W - pad / 2, y1: cy, y2: cy, class: "axis" }),
    s("line", { x1: cx, x2: cx, y1: pad / 2, y2: Hp - pad / 2, class: "axis faint" }));
  svg.append(txt(W - pad / 2, cy - 6, "along h →", { "text-anchor": "end", class: "label" }));
  const hx = cx + span * sc * 0.92;
  svg.append(s("line", { x1: cx, y1: cy, x2: hx, y2: cy, class: "harrow", "marker-end": "url(#arrowhead)" }));
  svg.append(s("defs", {}, s("marker", { id: "arrowhead", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7,
    markerHeight: 7, orient: "auto-start-reverse" }, s("path", { d: "M0 0L10 5L0 10z", class: "arrowfill" }))));
  svg.append(txt(8, Hp - 4, `h → (‖h‖ = ${g.hidden_norm.toFixed(1)}; the arrow is shortened)`, { class: "hlabel" }));
  // labels in the plane, nudged apart vertically where points crowd
  const byY = c.map((k, i) => [P(k.x, k.y)[1] - 6, i]).sort((a, b) => a[0] - b[0]);
  const labelY = new Array(c.length);
  let prev = -Infinity;
  for (const [y, i] of byY) { prev = Math.max(y, prev + 13); labelY[i] = prev; }
  svg.append(s("line", { x1: 24, x2: W - 24, y1: zy, y2: zy, class: "axis" }));
  svg.append(txt(24, zy - 8, `the h axis, zoomed in: x · ‖h‖ = logit${g.softcap ? " before the softcap" : ""}`, { class: "label" }));
  const order = c.map((_, i) => i).reverse(); // the top candidate drawn last, on top
  for (const i of order) {
    const k = c[i];
    const [px, py] = P(k.x, k.y);
    const st = probs ? probs.get(k.token_id) : null;
    const p = st ? st.p : null;
    const grp = s("g", { class: "word" + (st && !st.kept ? " cut" : ""), "data-id": k.token_id, "data-x": k.x });
    grp.append(s("line", { x1: px, y1: py, x2: px, y2: cy, class: "drop" }));
    grp.append(s("line", { x1: cx, y1: cy, x2: px, y2: py, class: "row" }));
    grp.append(s("circle", { cx: px, cy: py, r: 3 + 9 * Math.sqrt(p || 0), class: "dot", "data-p": p ?? "" }));
    grp.append(txt(px + 8, labelY[i], `${visible(k.text)} ${k.logit.toFixed(1)}`, { class: "wordlabel" }));
    const zx = ZX(k.x), ly = zy + 16 + 14 * zrow[i];
    grp.append(s("line", { x1: zx, x2: zx, y1: zy - 4, y2: ly - 10, class: "ztick" }));
    grp.append(txt(Math.min(zx, W - 4 - labelW(k)), ly, `${visible(k.text)} ${k.logit.toFixed(2)}`, { class: "wordlabel" }));
    svg.append(grp);
  }
  const lost = `This is a 2-D slice of a ${g.width}-dimensional space: the plane keeps ${pct(g.plane_share)} of these ` +
    `rows' squared length and the other ${g.width - 2} directions hold the rest, so the distances and angles between ` +
    `words here are not their true ones — only the horizontal positions (the projections onto h, i.e. the logits) are exact.`;
  const rows = c.map((k) => {
    const st = probs ? probs.get(k.token_id) : null;
    return [String(k.rank), { text: visible(k.text), cls: "tokcell" }, { text: k.row_norm.toFixed(3), value: k.row_norm },
      { text: `${k.norm_rank.toLocaleString()}`, value: k.norm_rank }, { text: k.cos.toFixed(4), value: k.cos },
      { text: `${k.cos_rank.toLocaleString()}`, value: k.cos_rank },
      { text: k.dot.toFixed(3), value: k.dot }, ...(g.has_bias ? [{ text: k.bias.toFixed(3), value: k.bias }] : []),
      { text: k.logit.toFixed(3), value: k.logit }, { text: st ? pct(st.p) : "–", value: st ? st.p : "" }];
  });
  const head = ["#", "token", "‖W[i]‖", "norm rank", "cos θ", "cos rank", `‖h‖·‖W[i]‖·cos θ`,
    ...(g.has_bias ? ["+ bias"] : []), g.softcap ? `logit (softcap ${g.softcap})` : "logit", "probability now"];
  const capNote = g.softcap ? ` The softcap squashes it: logit = ${g.softcap}·tanh((h·W[i]${g.has_bias ? " + b" : ""})/${g.softcap}).`
    : g.has_bias ? " The head adds a bias per token." : " This head has no bias and no softcap: the product is the logit.";
  const t = table(`Each logit = ‖h‖ × ‖W[i]‖ × cos θ, with ‖h‖ = ${g.hidden_norm.toFixed(3)}.${capNote} ` +
    `Ranks are over all ${g.vocab_size.toLocaleString()} rows (median ‖W‖ = ${g.row_norm_median.toFixed(3)}): a word ` +
    `wins by direction when its cos rank is small, by length when its norm rank is.`, head, rows, "geo-table");
  fig.replaceChildren(svg, h("figcaption", { class: "chart-caption" }, h("span", { text: desc + " " }),
    h("strong", { class: "lost", text: lost })), h("div", { class: "table-wrap" }, t));
}

// ----------------------------------------------------------------------------------------------------------
// Draws: the first n of the run's draws, per token its frequency beside its probability.

function drawChart(fig, d, n) {
  const counts = new Map();
  for (let i = 0; i < n; i++) counts.set(d.token_ids[i], (counts.get(d.token_ids[i]) || 0) + 1);
  const shown = d.tokens.slice(0, 12);
  const shownIds = new Set(shown.map((t) => t.token_id));
  let otherP = 1, otherC = n;
  for (const t of shown) { otherP -= t.probability; otherC -= counts.get(t.token_id) || 0; }
  const rowsData = shown.map((t) => ({ label: visible(t.text), id: t.token_id, p: t.probability, c: counts.get(t.token_id) || 0 }));
  if (d.kept_count > shown.length) rowsData.push({ label: `${(d.kept_count - shown.length).toLocaleString()} other kept tokens`, id: "other", p: Math.max(0, otherP), c: otherC });
  let tv = 0, drawnP = 0;
  for (const [id, k] of counts) {
    const t = d.tokens.find((x) => x.token_id === id);
    tv += Math.abs(k / n - t.probability); drawnP += t.probability;
  }
  tv = 0.5 * (tv + Math.max(0, 1 - drawnP));
  const W = widthOf(fig), rowH = 22, L = W < 500 ? 96 : 150, R = 48, T = 8;
  const H = T + rowH * rowsData.length + 26;
  const maxV = Math.max(...rowsData.map((r) => Math.max(r.p, r.c / n)), 1e-9);
  const X = (v) => L + (W - L - R) * (v / maxV);
  const desc = `${n.toLocaleString()} draws (seed ${d.seed}) with lmhead's sampler from the processed distribution: ` +
    `each bar is how often a token was drawn, the black tick its probability. Total variation distance ` +
    `${tv.toFixed(3)} (it shrinks about like 1/√n).`;
  const svg = frame(W, H, `Histogram of ${n} draws against the probabilities`, desc);
  rowsData.forEach((r, i) => {
    const y = T + i * rowH;
    const g = s("g", { class: "drawrow" + (r.id === "other" ? " other" : ""), "data-id": r.id, "data-count": r.c });
    const room = Math.floor(L / 7);
    g.append(txt(L - 6, y + 15, r.label.length > room ? r.label.slice(0, room - 1) + "…" : r.label, { "text-anchor": "end", class: "tick" }));
    g.append(s("rect", { x: L, y: y + 3, width: Math.max(0, X(r.c / n) - L), height: rowH - 7, class: "freq" }));
    g.append(s("line", { x1: X(r.p), x2: X(r.p), y1: y + 1, y2: y + rowH - 2, class: "probtick" }));
    g.append(txt(W - R + 4, y + 15, `${r.c}`, { class: "tick" }));
    svg.append(g);
  });
  svg.append(txt(6, H - 8, "bar: share of draws · tick: probability · right: count", { class: "label" }));
  const rows = rowsData.map((r) => [{ text: r.label }, { text: String(r.c), value: r.c }, { text: pct(r.c / n), value: r.c / n },
    { text: pct(r.p), value: r.p }]);
  fig.replaceChildren(svg, h("figcaption", { class: "chart-caption", text: desc }),
    numbers("The draws as numbers", table(`First ${n} of ${d.n} draws`, ["token", "count", "share", "probability"], rows, "draw-table")));
  fig.dataset.n = String(n);
  fig.dataset.tv = String(tv);
  return tv;
}

// ----------------------------------------------------------------------------------------------------------
// A generation, token by token: probability bars coloured by rank (as the score tab), the entropy as a line.

function stepsChart(fig, steps) {
  const n = steps.length, bw = 30, L = 40, R = 64, T = 12, B = 40;
  const W = Math.max(320, L + R + n * bw), H = 190;
  const maxE = Math.max(1, ...steps.map((x) => x.entropy), ...steps.map((x) => x.raw_entropy));
  const Y = (p) => T + (H - T - B) * (1 - p);
  const YE = (e) => T + (H - T - B) * (1 - e / maxE);
  const mean = steps.reduce((a, x) => a + x.probability, 0) / n;
  const desc = `${n} generated token${n === 1 ? "" : "s"}. Bars: each token's probability after the pipeline (left axis), coloured by its ` +
    `rank (green top 1, yellow top 10, orange top 100, red beyond). Line: the entropy of each step's distribution ` +
    `in nats (right axis). Mean probability ${pct(mean)}.`;
  const svg = frame(W, H, "Probability, rank and entropy of each generated token", desc);
  svg.style.minWidth = `${Math.min(W, n * 18 + L + R)}px`;
  for (const p of [0, 0.5, 1]) {
    svg.append(s("line", { x1: L, x2: W - R, y1: Y(p), y2: Y(p), class: "grid" }));
    svg.append(txt(L - 4, Y(p) + 4, `${p * 100}%`, { "text-anchor": "end", class: "tick" }));
  }
  svg.append(txt(W - R + 4, YE(maxE) + 4, `${maxE.toFixed(1)} nats`, { class: "tick ent" }));
  svg.append(txt(W - R + 4, YE(0) + 4, "0", { class: "tick ent" }));
  let line = "";
  steps.forEach((x, i) => {
    const x0 = L + i * bw;
    const g = s("g", { class: "stepcol " + rankClass(x.rank), "data-index": i });
    g.append(s("rect", { x: x0 + 3, y: Y(x.probability), width: bw - 6, height: Math.max(0.5, Y(0) - Y(x.probability)), class: "stepbar" }));
    const label = visible(x.text);
    g.append(txt(x0 + bw / 2, H - B + 14, label.length > 4 ? label.slice(0, 4) + "…" : label, { "text-anchor": "middle", class: "tick" }));
    g.append(txt(x0 + bw / 2, H - B + 28, `#${x.rank}`, { "text-anchor": "middle", class: "tick faint" }));
    svg.append(g);
    line += (i ? "L" : "M") + (x0 + bw / 2) + " " + YE(x.entropy).toFixed(1);
  });
  svg.append(s("path", { d: line, class: "entline" }));
  steps.forEach((x, i) => svg.append(s("circle", { cx: L + i * bw + bw / 2, cy: YE(x.entropy), r: 2.5, class: "entdot" })));
  const strip = h("p", { class: "strip scored", "aria-label": "the generated tokens coloured by rank" },
    ...steps.map((x) => h("span", { class: `tok ${rankClass(x.rank)}`, tabindex: "0",
      title: `${visible(x.text)} (id ${x.token_id}): p = ${pct(x.probability)}, rank ${x.rank}, entropy ${x.entropy.toFixed(2)} nats`,
      "aria-label": `${visible(x.text)}: p ${pct(x.probability)}, rank ${x.rank}, entropy ${x.entropy.toFixed(2)} nats` }, x.text)));
  const rows = steps.map((x, i) => [String(i + 1), { text: visible(x.text), cls: "tokcell" },
    { text: pct(x.probability), value: x.probability }, { text: pct(x.raw_probability), value: x.raw_probability },
    { text: String(x.rank), value: x.rank }, { text: x.entropy.toFixed(3), value: x.entropy },
    { text: x.raw_entropy.toFixed(3), value: x.raw_entropy }]);
  fig.replaceChildren(strip, h("div", { class: "table-wrap svg-scroll" }, svg), h("figcaption", { class: "chart-caption", text: desc }),
    numbers("The steps as numbers", table("Each generated token (full-precision head)", ["step", "token", "probability",
      "raw (T=1)", "rank", "entropy (nats)", "raw entropy"], rows, "steps-table")));
}

export { rankChart, geometryChart, drawChart, stepsChart };
