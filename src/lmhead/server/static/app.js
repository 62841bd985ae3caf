// lmhead explainer — the page's logic. Plain JavaScript, no libraries, everything served locally.
//
// The server sends, for a prompt, the top N candidates by logit (z_0 ≥ z_1 ≥ … ≥ z_{N-1}) and the
// log-sum-exp of all V logits. Moving a slider reruns the logits pipeline here, in lmhead.sampling's (and
// Hugging Face's) order — temperature → top-k → top-p → min-p → softmax — without a round trip.
// Each step keeps a prefix of the candidates (all steps are monotone in the logit), so whenever the kept set lies
// inside the N candidates, every number is exact. What needs the tokens that were not sent (the normaliser at
// T ≠ 1 when nothing cuts inside the candidates) is bounded, shown as such, and fetched exactly from the server
// when the slider is released.
//
// Every other step lmhead.sampling declares (bans and masks, penalties, DRY, n-grams, dynamic temperature, typical-p,
// top-nσ, XTC, ε / η, mirostat) and another order: their controls are built from the server's declaration (GET
// /api/samplers), and the page runs them with pipeline.js over all V logits (the candidates when the whole vocabulary
// was sent, else POST /api/logits once per prompt) — exact, whatever the settings; see pipeline.js for what one
// next-token prediction means for the stateful steps and for XTC's coin.
"use strict";

const $ = (sel) => document.querySelector(sel);
const state = {
  model: null,
  data: null, // the last /api/predict answer
  dataSettings: null, // the settings it was computed with
  dataConstraint: "", // the constraint box it was computed with ("" = none)
  answer: null, // where the constrained answer starts: { key (the box), prompt (the text before the answer) }
  prompt: "",
  generatedFrom: null, // index of the first generated token among the chips
  step: 0, // tokens generated since the prompt was typed: the seeded draws are keyed on (seed + step)
  requery: null, // debounce timer
  seq: 0, // predict request counter (stale answers are dropped)
  busy: false,
  modelName: null, // the model chosen in the selector (?model=NAME on every request); null = the server's default
  models: null, // GET /api/models
  geo: null, // the last /api/geometry answer, and the prompt it was for
  geoPrompt: null,
  dist: null, // the last /api/distribution answer
  distSeq: 0,
  distTimer: null,
  draws: null, // the last /api/draws answer
  drawTimer: null,
  gen: { prompt: null, tokens: [] }, // this generation: the prompt it started from, each token with its settings
};

// ------------------------------------------------------------------------------------------------------------
// Formatting

function pct(p) {
  if (p === null || p === undefined || Number.isNaN(p)) return "–";
  const v = p * 100;
  if (v === 0) return "0%";
  if (v >= 99.995 && v < 100) return "99.99%";
  if (v >= 10) return v.toFixed(1) + "%";
  if (v >= 1) return v.toFixed(2) + "%";
  if (v >= 0.01) return v.toFixed(3) + "%";
  return v.toExponential(1) + "%";
}
const nats = (h) => (h === null || h === undefined ? "–" : h.toFixed(3) + " nats");
const fix = (x, d = 2) => (x === null || x === undefined || !Number.isFinite(x) ? "−∞" : x.toFixed(d));
const VISIBLE = { " ": "·", "\n": "↵", "\t": "⇥", "\r": "␍" };
const visible = (s) => Array.from(s || "").map((c) => {
  if (VISIBLE[c]) return VISIBLE[c];
  const code = c.codePointAt(0);
  return code < 32 || code === 127 ? "\\x" + code.toString(16).padStart(2, "0") : c; // as lmhead.explain.visible
}).join("");

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("data-") || k.startsWith("aria-") || k === "role" || k === "title" || k === "tabindex")
      e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

function setStatus(msg, error = false) {
  const s = $("#status");
  s.textContent = msg || "";
  s.classList.toggle("error", !!error);
}

function withModel(path) {
  return state.modelName ? `${path}${path.includes("?") ? "&" : "?"}model=${encodeURIComponent(state.modelName)}` : path;
}

// POST body as JSON (GET without one); the answer's JSON, or its bytes with as = "bytes".
async function api(path, body, as = "json") {
  path = withModel(path);
  const opts = body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  };
  const r = await fetch(path, opts);
  if (r.ok && as === "bytes") return r.arrayBuffer();
  const j = await r.json().catch(() => ({}));
  if (!r.ok) {
    const d = j.detail;
    const msg = typeof d === "string" ? d : Array.isArray(d) ? d.map((e) => e.msg).join("; ") : r.statusText;
    throw new Error(msg || `HTTP ${r.status}`);
  }
  return j;
}

// ------------------------------------------------------------------------------------------------------------
// Settings

// The four sliders above are written by hand; every other parameter's control is built from the server's declaration
// (GET /api/samplers, `buildStepControls`). A request carries those four always and every other parameter that is
// off its declared default.
const LEGACY = ["temperature", "top_k", "top_p", "min_p"];

function readSettings() {
  const st = {
    temperature: parseFloat($("#temperature").value),
    top_k: parseInt($("#top-k").value, 10),
    top_p: parseFloat($("#top-p").value),
    min_p: parseFloat($("#min-p").value),
  };
  const errors = [];
  for (const input of document.querySelectorAll("#step-controls input[data-param]")) {
    const name = input.dataset.param;
    try {
      const v = parseParam(state.decl.params[name], input.value, name);
      input.removeAttribute("aria-invalid");
      if (v !== undefined) st[name] = v;
    } catch (e) {
      input.setAttribute("aria-invalid", "true");
      errors.push(e.message);
    }
  }
  const order = orderSetting();
  if (order !== undefined) st.samplers = order;
  return { st, error: errors.length ? errors.join("; ") : null };
}
const settings = () => readSettings().st;
const sameSettings = (a, b) => !!a && !!b && settingsKey(a) === settingsKey(b);
const sortedKeys = (o) => Object.fromEntries(Object.keys(o).sort().map((k) => [k, o[k]]));
const settingsKey = (st) => JSON.stringify(sortedKeys(st));
// Only the four sliders above are set (the prefix-of-the-candidates pipeline below runs them)
const legacyOnly = (st) => !!st && Object.keys(st).every((k) => LEGACY.includes(k));

function showSettings() {
  const s = settings();
  $("#temperature-out").value = s.temperature === 0 ? "0 (greedy)" : s.temperature.toFixed(2);
  $("#top-k-out").value = s.top_k === 0 ? "off" : String(s.top_k);
  $("#top-p-out").value = s.top_p >= 1 ? "off" : s.top_p.toFixed(2);
  $("#min-p-out").value = s.min_p <= 0 ? "off" : s.min_p.toFixed(2);
  for (const out of document.querySelectorAll("#step-controls output[data-param]")) {
    const input = document.getElementById(out.htmlFor.value);
    out.value = input.value;
  }
}

// --- the declared parameters as controls -------------------------------------------------------------------

// A parameter's text as its declared kind: numbers in their declared range (the single values it also allows),
// token ids "1, 2", token-id sequences "1 2; 3", a bias "id: value, ...". Returns undefined for the default (an
// empty field included), throws an Error naming the parameter and its range otherwise.
function parseParam(p, text, name) {
  const t = text.trim();
  const bad = () => new Error(`${name} must be ${p.allowed}, got ${JSON.stringify(text)}`);
  const ids = (u) => u.split(/[\s,]+/).filter(Boolean).map((v) => {
    if (!/^\d+$/.test(v)) throw bad();
    return parseInt(v, 10);
  });
  if (p.kind === "float" || p.kind === "int") {
    if (t === "") return undefined;
    const v = Number(t);
    if (!Number.isFinite(v) || (p.kind === "int" && !Number.isInteger(v))) throw bad();
    const inside = (p.low === null || (p.low_open ? v > p.low : v >= p.low)) &&
      (p.high === null || (p.high_open ? v < p.high : v <= p.high));
    if (!inside && !p.also.includes(v)) throw bad();
    return v === p.default ? undefined : v;
  }
  if (t === "") return undefined;
  if (p.kind === "ids") return ids(t);
  if (p.kind === "sequences") {
    const seqs = t.split(";").map((u) => ids(u));
    if (seqs.some((q) => !q.length)) throw bad();
    return seqs;
  }
  if (p.kind === "bias") {
    const out = {};
    for (const part of t.split(",").filter((u) => u.trim())) {
      const m = /^\s*(\d+)\s*:\s*(\S+)\s*$/.exec(part);
      const v = m ? Number(m[2]) : NaN;
      if (!m || !Number.isFinite(v) || Math.abs(v) > 1e4) throw bad();
      out[m[1]] = v;
    }
    return out;
  }
  throw bad();
}

// The order: lmhead's (undefined: not sent), a preset by name, or the names typed (checked as the server checks them).
function orderSetting() {
  const preset = $("#samplers-preset");
  if (!preset || preset.value === "lmhead") return undefined;
  if (preset.value !== "custom") return preset.value;
  const names = $("#samplers").value.replace(/,/g, ";").split(";").map((v) => v.trim()).filter(Boolean);
  lmheadPipeline.orderOf(state.decl, names); // an unknown or repeated name is an Error naming samplers
  return names;
}

// A float whose declared range is a closed stretch of at most 1 (top-p's kind) is a slider; any other number a number
// field with the declared bounds; ids, sequences and a bias are text.
function controlFor(name, p) {
  const id = `p-${name}`;
  const help = el("small", { id: `${id}-help`, text: `${p.allowed}. ${p.doc}` });
  const attrs = { id, "data-param": name, "aria-describedby": help.id };
  let input, output = null;
  const slider = p.kind === "float" && p.low !== null && p.high !== null && p.high - p.low <= 1 && !p.high_open;
  if (slider) {
    const lo = p.low_open ? p.low + 0.01 : p.low;
    input = el("input", { ...attrs, type: "range", min: String(lo), max: String(p.high), step: "0.01",
      value: String(p.default) });
    output = el("output", { id: `${id}-out`, "data-param": name, text: String(p.default) });
    output.htmlFor.value = id;
  } else if (p.kind === "float" || p.kind === "int") {
    input = el("input", { ...attrs, type: "number", step: p.kind === "int" ? "1" : "any", inputMode: "decimal",
      placeholder: String(p.default) });
    if (p.low !== null && !p.also.some((v) => v < p.low)) input.min = String(p.low);
    if (p.high !== null) input.max = String(p.high);
  } else {
    const hint = { ids: "e.g. 12, 40", sequences: "e.g. 12 7; 40", bias: "e.g. 12: 2.5, 40: -3" }[p.kind] || "";
    input = el("input", { ...attrs, type: "text", spellcheck: false, placeholder: hint });
  }
  return el("div", { class: "control" + (slider ? "" : " wide") }, el("label", { htmlFor: id, text: name }), input, output, help);
}

function buildStepControls(decl) {
  const box = $("#step-controls");
  const shown = new Set(LEGACY);
  const stages = { 1: "Masks", 2: "Penalties", 3: "Temperature", 4: "Cuts" };
  const groups = [];
  for (const step of decl.steps) {
    const names = step.params.filter((n) => !shown.has(n) && n in decl.params);
    if (!names.length) continue;
    names.forEach((n) => shown.add(n));
    const g = el("fieldset", { class: "step", "data-step": step.name, title: step.explain || "" });
    g.append(el("legend", {}, el("code", { text: step.name }), " ",
      el("small", { text: `${stages[step.stage] || ""} · ${step.origin}` })));
    for (const n of names) g.append(controlFor(n, decl.params[n]));
    groups.push(g);
  }
  const presets = el("select", { id: "samplers-preset", "aria-describedby": "samplers-help" },
    ...Object.keys(decl.presets).map((k) => el("option", { value: k, text: k === "lmhead" ? "lmhead (the default)" : k })),
    el("option", { value: "custom", text: "your own order" }));
  const names = el("input", { id: "samplers", type: "text", spellcheck: false, "aria-describedby": "samplers-help",
    value: decl.order.join(";") });
  const p = decl.params.samplers;
  groups.push(el("fieldset", { class: "step order", "data-step": "samplers" },
    el("legend", {}, el("code", { text: "samplers" }), " ", el("small", { text: "the order of stages 2-4" })),
    el("div", { class: "control wide" }, el("label", { htmlFor: "samplers-preset", text: "Order" }), presets),
    el("div", { class: "control wide" }, el("label", { htmlFor: "samplers", text: "samplers" }), names,
      el("small", { id: "samplers-help", text: `${p ? p.allowed + ". " + p.doc : ""} Names are separated by ; — ` +
        `a step left out does not run; mirostat replaces the cuts (llama.cpp's rule). Steps: ${decl.orderable.join(", ")}.` }))));
  box.replaceChildren(...groups);
  presets.addEventListener("change", () => {
    if (presets.value !== "custom") names.value = (decl.presets[presets.value] || decl.order).join(";");
    settingsChanged(true);
  });
  names.addEventListener("input", () => { presets.value = "custom"; settingsChanged(false); });
  names.addEventListener("change", () => settingsChanged(true));
  for (const input of box.querySelectorAll("input[data-param]")) {
    input.addEventListener("input", () => settingsChanged(false));
    input.addEventListener("change", () => settingsChanged(true));
  }
}

function resetStepControls() {
  for (const input of document.querySelectorAll("#step-controls input[data-param]")) {
    const p = state.decl.params[input.dataset.param];
    input.value = input.type === "range" ? String(p.default) : "";
    input.removeAttribute("aria-invalid");
  }
  if ($("#samplers-preset")) { $("#samplers-preset").value = "lmhead"; $("#samplers").value = state.decl.order.join(";"); }
}

// A control moved (input) or was released (change): the page recomputes at once; on release it also asks the server
// for the candidates and the pictures at the new settings.
// While a control moves, its renders are coalesced to one per frame: over a large vocabulary one run of the declared
// steps can take longer than the events come.
function settingsChanged(released) {
  if (!released) {
    if (!state.frame) state.frame = requestAnimationFrame(() => { state.frame = 0; render(); });
    if (!readSettings().error) scheduleDistribution(60);
    return;
  }
  cancelAnimationFrame(state.frame);
  state.frame = 0;
  render();
  if (state.settingsError) return;
  scheduleDistribution(0);
  scheduleRequery(0);
  scheduleRedraw();
}

// The constraint box (structured output): the server applies its mask first; the page shows the server's numbers
// for a constrained prompt (its mask is not known here) and asks again when a setting changes.
function constraintAsked() {
  const kind = $("#constraint-kind").value, text = $("#constraint-text").value.trim();
  return kind === "none" || !text ? null : { kind, text };
}
const constraintKey = (c) => (c ? `${c.kind}\u0000${c.text}` : "");

// The constrained answer starts where the box was first asked for this prompt: the server consumes the text
// after that point as the answer so far, so Next token and Generate continue one answer, not start a new one
// at every click. A new box or an edited prompt (one that no longer extends it) starts the answer again.
function constraintFields(prompt) {
  const asked = constraintAsked();
  if (!asked) { state.answer = null; return {}; }
  const key = constraintKey(asked);
  let answer = state.answer;
  if (!answer || answer.key !== key || !prompt.startsWith(answer.prompt)) {
    answer = { key, prompt };
    // Only the prompt in the box starts an answer: a requery of the shown data for an older prompt (the box
    // edited since, its input event already seen) must not move the start back to that older prompt.
    if (prompt === $("#prompt").value) state.answer = answer;
  }
  // code points, as the server counts characters
  return { constraint: asked, answer_from: Array.from(answer.prompt).length };
}

function seed() {
  const v = $("#seed").value.trim();
  return v === "" ? null : Math.max(0, parseInt(v, 10));
}

// ------------------------------------------------------------------------------------------------------------
// The pipeline, exactly as lmhead.sampling applies it, on the candidates + the full-vocabulary log-sum-exp.
//
// Notation: z_i the candidates' logits (descending), a = 1/T, w_i = exp(a·(z_i − z_0)) ≤ 1 (weights relative to
// the top token), X = Σ_{tokens not sent} exp(a·(z_j − z_0)) (the tail, same units).
// At T = 1, X = exp(lse − z_0) − Σ w_i exactly. At another T the tail is bounded from what is known: with
// m = z_{N−1}, x_j = exp(z_j − m) ∈ (0, 1] and s = Σ x_j (known from lse), n tail tokens:
//   a ≥ 1: n·(s/n)^a ≤ Σ x_j^a ≤ s        a ≤ 1: s ≤ Σ x_j^a ≤ n·(s/n)^a        (power means; x ≤ 1)
// and X = exp(a·(m − z_0)) · Σ x_j^a. If the server computed at this very T, its scaled log-sum-exp gives X.

function tailBounds(d, a) {
  const z = d.z, N = z.length, n = d.V - N;
  if (n <= 0) return [0, 0];
  const z0 = z[0];
  let W = 0;
  for (let i = 0; i < N; i++) W += Math.exp(a * (z[i] - z0));
  if (d.scaledT !== null && Math.abs(1 / a - d.scaledT) < 1e-9 && d.scaledLse !== null) {
    const X = Math.max(0, Math.exp(d.scaledLse - a * z0) - W);
    return [X, X];
  }
  const m = z[N - 1];
  let head = 0;
  for (let i = 0; i < N; i++) head += Math.exp(z[i] - m);
  const s = Math.max(0, Math.exp(d.lse - m) - head); // Σ_tail exp(z_j − m)
  const base = Math.exp(a * (m - z0));
  if (Math.abs(a - 1) < 1e-12) return [s * base, s * base];
  const g = n * Math.pow(s / n, a);
  return a > 1 ? [g * base, s * base] : [s * base, g * base];
}

// One run of the pipeline for a given tail mass X. Returns per-candidate flags and the state of the tail.
function runPipeline(d, st, a, X) {
  const z = d.z, N = z.length, n = d.V - N, z0 = z[0];
  const w = new Float64Array(N);
  let Wall = 0;
  for (let i = 0; i < N; i++) { w[i] = Math.exp(a * (z[i] - z0)); Wall += w[i]; }
  const cut = new Array(N).fill(null); // which step removed each candidate
  let tail = n > 0 ? "all" : "none"; // how much of the tail is still in: "all" | "part" | "none"
  let tailMass = n > 0 ? X : 0;
  // 4. top-k: keep logits ≥ the k-th largest (ties kept, as torch.topk's threshold does)
  if (st.top_k > 0 && st.top_k < d.V) {
    if (st.top_k <= N) {
      const thr = z[st.top_k - 1];
      for (let i = 0; i < N; i++) if (z[i] < thr) cut[i] = "top-k";
      tail = "none"; tailMass = 0;
    } else if (n > 0) { tail = "part"; } // some of the tail survives: its mass is not known here
  }
  // 5. top-p on the distribution that survived top-k, HF's rule as lmhead.sampling: drop a token when the mass
  //    of it and everything below it is ≤ 1 − p (the crossing token is kept; a tie group goes by its first
  //    member; the top token always stays).
  const cum = new Float64Array(N); // cumulative mass down the list (after top-k, at this temperature)
  let cross = -1;
  {
    let Z1 = tailMass;
    for (let i = 0; i < N; i++) if (!cut[i]) Z1 += w[i];
    let c = 0;
    for (let i = 0; i < N; i++) { if (!cut[i]) c += w[i] / Z1; cum[i] = c; }
    if (st.top_p < 1) {
      const asc = new Float64Array(N); // mass of this token and all below it (the tail included)
      let below = tailMass / Z1;
      for (let i = N - 1; i >= 0; i--) { if (!cut[i]) below += w[i] / Z1; asc[i] = below; }
      let first = 0;
      for (let i = 0; i < N; i++) {
        if (i > 0 && z[i] !== z[i - 1]) first = i;
        if (cut[i]) continue;
        if (i > 0 && asc[first] <= 1 - st.top_p) cut[i] = "top-p";
        else cross = i; // the last kept row: where the mass reaches p
      }
      if (cross + 1 < N && cut[cross + 1] !== "top-p") cross = -1; // top-p did not make this cut
      if (tail !== "none") {
        // The largest tail token's inclusive mass is the whole tail's: it (and so every tail token) is dropped
        // when that is ≤ 1 − p; otherwise some of the tail survives and its share is not known here.
        if (tailMass / Z1 <= 1 - st.top_p) { tail = "none"; tailMass = 0; } else { tail = "part"; cross = -1; }
      }
    }
  }
  // 6. min-p: keep tokens with p ≥ min_p · p_max, i.e. w ≥ min_p (w_0 = 1 is the top token)
  if (st.min_p > 0) {
    for (let i = 1; i < N; i++) if (!cut[i] && w[i] < st.min_p) cut[i] = "min-p";
    if (tail !== "none" && w[N - 1] < st.min_p) { tail = "none"; tailMass = 0; } // every tail token is below
    else if (tail !== "none") tail = "part";
  }
  // 7. softmax over what is left
  let Wk = 0, keptCand = 0;
  for (let i = 0; i < N; i++) if (!cut[i]) { Wk += w[i]; keptCand++; }
  return { w, Wall, cut, cum, cross, tail, tailMass, Wk, keptCand, n };
}

// Entropy (nats) of the kept distribution; exact when no tail token is kept. With tail mass Y kept (tokens each
// below the last candidate's weight w_m), H = ln Z − (A + B)/Z, Z = Wk + Y, A = Σ w ln w over kept candidates,
// B = Σ_tail y ln y ∈ [Y·ln(Y/n), Y·ln w_m] (convexity; each y ≤ w_m). Bounds over a grid of Y values.
function entropyOf(r, a, d, Ylo, Yhi) {
  let A = 0;
  for (let i = 0; i < r.w.length; i++) if (!r.cut[i]) {
    const lw = a * (d.z[i] - d.z[0]);
    A += r.w[i] * lw;
  }
  if (r.tail === "none") { const Z = r.Wk; return { lo: Math.log(Z) - A / Z, hi: Math.log(Z) - A / Z }; }
  const lwm = a * (d.z[d.z.length - 1] - d.z[0]);
  let lo = Infinity, hi = -Infinity;
  const steps = 24;
  for (let k = 0; k <= steps; k++) {
    const Y = Ylo > 0 ? Ylo * Math.pow(Yhi / Ylo, k / steps) : Yhi * k / steps;
    const Z = r.Wk + Y;
    const Bhi = Y > 0 ? Y * lwm : 0, Blo = Y > 0 ? Y * Math.log(Y / r.n) : 0;
    lo = Math.min(lo, Math.log(Z) - (A + Bhi) / Z);
    hi = Math.max(hi, Math.log(Z) - (A + Blo) / Z);
  }
  return { lo, hi };
}

// The whole computation for the current settings: probabilities, cut flags, entropy, kept count and mass,
// and whether each number is exact.
function compute(d, st) {
  const N = d.z.length;
  if (st.temperature === 0) { // greedy: the argmax, nothing else (the scale does not matter)
    const cut = new Array(N).fill("greedy"); cut[0] = null;
    const probs = new Float64Array(N); probs[0] = 1;
    const cum = new Float64Array(N).fill(1);
    const scaled = Array.from(d.z);
    return { probs, cut, cum, cross: -1, scaled, entropy: { lo: 0, hi: 0 }, exactProbs: true,
      keptCount: 1, keptCountExact: true, keptMass: [d.rawP[0], d.rawP[0]], tail: "none" };
  }
  const a = 1 / st.temperature;
  const [Xlo, Xhi] = tailBounds(d, a);
  const rLo = runPipeline(d, st, a, Xlo), rHi = runPipeline(d, st, a, Xhi);
  const sameCut = rLo.cut.every((c, i) => c === rHi.cut[i]) && rLo.tail === rHi.tail;
  const X = Xlo > 0 ? Math.sqrt(Xlo * Xhi) : (Xlo + Xhi) / 2; // a point inside the bounds, for display
  const r = Xlo === Xhi ? rLo : runPipeline(d, st, a, X);
  // Probabilities: exact if the kept set is the same at both bounds and the kept tail mass is known.
  const tailKnown = r.tail === "none" || (r.tail === "all" && Xlo === Xhi);
  const exactProbs = sameCut && tailKnown;
  const Zk = r.Wk + (r.tail === "none" ? 0 : r.tailMass);
  const probs = new Float64Array(N);
  for (let i = 0; i < N; i++) probs[i] = r.cut[i] ? 0 : r.w[i] / Zk;
  const [Ylo, Yhi] = r.tail === "none" ? [0, 0] : r.tail === "all" ? [Xlo, Xhi] : [0, Xhi];
  const entropy = entropyOf(r, a, d, Ylo, Yhi);
  const keptMass = [(r.Wk + Ylo) / (r.Wall + Xhi), Math.min(1, (r.Wk + Yhi) / (r.Wall + Xlo))];
  if (r.tail === "all") { keptMass[0] = (r.Wk + Xlo) / (r.Wall + Xlo); keptMass[1] = (r.Wk + Xhi) / (r.Wall + Xhi); }
  const keptCount = r.keptCand + (r.tail === "all" ? r.n : 0);
  const scaled = Array.from(d.z, (v) => v * a);
  return { probs, cut: r.cut, cum: r.cum, cross: r.cross, scaled, entropy, exactProbs, keptCount,
    keptCountExact: r.tail !== "part" && sameCut, keptMass, tail: r.tail, a, X: [Xlo, Xhi] };
}

// ------------------------------------------------------------------------------------------------------------
// Rendering

function chip(text, id, cls = "chip") {
  return el("span", { class: cls, role: "listitem", title: `id ${id}`, "data-id": String(id), tabindex: "0",
    "aria-label": `token ${visible(text)}, id ${id}` }, visible(text));
}

function renderChips(tokens, generatedFrom) {
  const box = $("#chips");
  box.replaceChildren(...tokens.map((t, i) => chip(t.text, t.token_id,
    "chip" + (/^<.*>$/.test(t.text) ? " special" : "") + (generatedFrom !== null && i >= generatedFrom ? " generated" : ""))));
}

// The settings, or null after saying what is wrong with them (a message that goes once they are right again).
function checkedSettings() {
  const { st, error } = readSettings();
  if (error) { state.settingsError = error; setStatus(error, true); return null; }
  if (state.settingsError) setStatus("");
  state.settingsError = null;
  return st;
}

function render() {
  const d = state.data;
  showSettings();
  const st = checkedSettings();
  if (!d || !st) return;
  // A constrained prompt shows the server's numbers: its mask is not known in the page (the table marks the
  // tokens it forbids from the server's cut_by).
  if (state.dataConstraint !== "") { renderLegacy(d, st, true); return; }
  // The prefix pipeline needs the candidates in the order of their logits: candidates the server sorted after
  // penalties or masks (another step was on when they were fetched) go through the declared steps instead.
  if (legacyOnly(st) && (legacyOnly(state.dataSettings) || d.V === d.z.length) && d.sorted) renderLegacy(d, st);
  else renderDeclared(d, st);
}

function renderLegacy(d, st, serverOnly = false) {
  const useServer = serverOnly || sameSettings(st, state.dataSettings);
  const c = compute(d, st);
  const N = d.z.length;
  const rows = Math.min(N, parseInt($("#rows").value, 10));
  const body = $("#stage tbody");
  const frag = document.createDocumentFragment();
  const cands = d.raw.candidates;
  for (let i = 0; i < rows; i++) {
    const cand = cands[i];
    const p = useServer ? cand.probability : c.probs[i];
    const cutBy = useServer ? (cand.kept ? null : cand.cut_by === "constraint" ? "cut by the constraint"
      : (cand.cut_by || "cut").replace("_", "-")) : c.cut[i];
    const cum = useServer ? (st.temperature === 0 ? cand.cumulative : cand.scaled_cumulative) : c.cum[i];
    const cross = !useServer ? c.cross === i : (st.top_p < 1 && st.temperature > 0 && cand.kept &&
      (i + 1 >= cands.length || !cands[i + 1].kept_top_p) && cand.kept_top_k);
    const tr = el("tr", { class: (cutBy ? "cut" : "kept") + (cross ? " cross" : ""), "data-rank": String(i + 1),
      "data-id": String(cand.token_id) });
    tr.append(el("td", { text: String(i + 1) }));
    tr.append(el("td", { class: "tok" }, chip(cand.text, cand.token_id)));
    tr.append(el("td", { text: fix(cand.logit) }));
    tr.append(el("td", { text: st.temperature === 0 ? "—" : fix(c.scaled[i]) }));
    const after = el("td", { class: "after" });
    after.append(cutBy ? "−∞" : fix(st.temperature === 0 ? cand.logit : c.scaled[i]));
    if (cutBy) after.append(el("span", { class: "why", text: cutBy }));
    after.append(el("span", { class: "thin", text: ` (${pct(cum)})` }));
    if (cross) after.append(el("span", { class: "crossmark", text: `top-p: the mass reaches p = ${st.top_p.toFixed(2)} here` }));
    tr.append(after);
    const probCell = el("td", { class: "probcol prob", "data-p": String(p) });
    const bar = el("div", { class: "bar", role: "img", "aria-label": `probability ${pct(p)}` });
    bar.append(el("span", { style: "" }));
    bar.firstChild.style.width = `${Math.min(100, p * 100)}%`;
    bar.append(el("em", { class: (useServer || c.exactProbs) ? "" : "approx", text: ((useServer || c.exactProbs) ? "" : "≈") + pct(p) }));
    probCell.append(bar);
    tr.append(probCell);
    const rawCell = el("td", { class: "probcol raw", "data-p": String(cand.raw_probability) });
    const rbar = el("div", { class: "bar raw", role: "img", "aria-label": `raw probability ${pct(cand.raw_probability)}` });
    rbar.append(el("span"));
    rbar.firstChild.style.width = `${Math.min(100, cand.raw_probability * 100)}%`;
    rbar.append(el("em", { text: pct(cand.raw_probability) }));
    rawCell.append(rbar);
    tr.append(rawCell);
    frag.append(tr);
  }
  body.replaceChildren(frag);
  $("#stage").dataset.settings = settingsKey(st); // what the table shows (the tests wait for it)

  // Summary: entropy, kept, exactness.
  $("#entropy-raw").textContent = nats(d.raw.entropy.raw);
  const ent = $("#entropy");
  let eValue, eText, keptText, massText, badge, badgeClass;
  if (useServer) {
    eValue = d.raw.entropy.processed;
    eText = nats(eValue);
    keptText = d.raw.kept_count.toLocaleString();
    const mass = serverKeptMass(d, st);
    massText = mass === null ? "–" : pct(mass);
    badge = `exact — computed by the server over all ${d.V.toLocaleString()} tokens`;
    badgeClass = "exact";
  } else {
    const { lo, hi } = c.entropy;
    const exactH = Math.abs(hi - lo) < 1e-9 || (st.temperature === 1 && st.top_k === 0 && st.top_p >= 1 && st.min_p <= 0);
    if (st.temperature === 1 && st.top_k === 0 && st.top_p >= 1 && st.min_p <= 0) eValue = d.raw.entropy.raw;
    else eValue = (lo + hi) / 2;
    eText = exactH ? nats(eValue) : `${lo.toFixed(3)}–${hi.toFixed(3)} nats`;
    keptText = c.keptCountExact ? c.keptCount.toLocaleString() : `≥ ${c.keptCount + 1}`;
    const [m0, m1] = c.keptMass;
    massText = Math.abs(m1 - m0) < 5e-7 ? pct(m0) : `${pct(m0)}–${pct(m1)}`;
    const exact = c.exactProbs && exactH;
    badge = exact ? `exact — computed here from the top ${N} logits and the log-sum-exp of all ${d.V.toLocaleString()}`
      : "bounded — the kept set reaches beyond the candidates sent; exact values on release";
    badgeClass = exact ? "exact" : "bounded";
    if (!exact) scheduleRequery(400);
  }
  ent.textContent = eText;
  ent.dataset.value = String(eValue);
  $("#kept-count").textContent = keptText;
  $("#kept-unit").textContent = keptText === "1" ? "token" : "tokens";
  $("#kept-mass").textContent = massText;
  const b = $("#exactness");
  b.textContent = badge;
  b.className = "badge " + badgeClass;
  const keptShown = Array.from(body.querySelectorAll("tr.kept")).length;
  const keptTotal = useServer ? d.raw.kept_count : c.keptCount;
  $("#more").textContent = keptTotal > keptShown ? `${(keptTotal - keptShown).toLocaleString()} more kept tokens are not shown.` : "";
  const probs = new Map();
  for (let i = 0; i < N; i++) {
    const cand = cands[i];
    probs.set(cand.token_id, useServer ? { p: cand.probability, kept: cand.kept } : { p: c.probs[i], kept: !c.cut[i] });
  }
  state.candProbs = probs;
  renderGeometry();
  if (!state.decl) return;
  const cfg = lmheadPipeline.configOf(state.decl, st, eosIds());
  renderChain(lmheadPipeline.chain(state.decl, cfg).map((step) => {
    const done = useServer ? (d.raw.steps || []).find((x) => x.name === step.name) : null;
    return { name: step.name, cut: done ? done.cut : null };
  }), cfg);
}

// --- every declared step, over the whole row -----------------------------------------------------------------

const eosIds = () => (state.model ? state.model.eos_token_ids : []);

// All V logits of the prompt (float64): the candidates themselves when the server sent the whole vocabulary, else
// POST /api/logits once per prompt (the page re-renders when they arrive); null until then.
function fullRow(d) {
  if (d.row) return d.row;
  if (d.V === d.z.length) {
    d.row = new Float64Array(d.V);
    for (const c of d.raw.candidates) d.row[c.token_id] = c.logit;
    return d.row;
  }
  const key = `${state.modelName}\u0000${d.raw.prompt}`;
  if (state.row && state.row.key === key) return state.row.x;
  if (state.rowPending !== key) {
    state.rowPending = key;
    api("/api/logits", { prompt: d.raw.prompt }, "bytes").then((buf) => {
      if (state.rowPending !== key) return;
      state.rowPending = null;
      if (buf.byteLength !== 4 * d.V) throw new Error(`/api/logits sent ${buf.byteLength} bytes for ${d.V} logits`);
      state.row = { key, x: Float64Array.from(new Float32Array(buf)) };
      render();
    }).catch((e) => { state.rowPending = null; setStatus(e.message, true); });
  }
  return null;
}

function renderDeclared(d, st) {
  const useServer = sameSettings(st, state.dataSettings);
  const row = fullRow(d);
  let r = null;
  if (row) {
    try {
      r = lmheadPipeline.runChain(state.decl, row, st, { history: d.raw.prompt_tokens.map((t) => t.token_id) }, eosIds());
    } catch (e) {
      state.settingsError = e.message;
      setStatus(e.message, true);
      return;
    }
    if (r.missing.length) r = null; // a step this page does not implement: the server's numbers
  }
  const N = Math.min(parseInt($("#rows").value, 10), d.V);
  let items;
  if (r) {
    const byId = d.byId, xtc = new Set(r.xtc);
    let cum = 0;
    items = lmheadPipeline.topOrder(r.adjusted, row, N).map((id) => {
      cum += r.probs[id];
      const c = byId.get(id);
      return { id, text: c ? c.text : null, logit: row[id], scaled: r.greedy ? null : r.scaled[id], kept: !!r.keep[id],
        cutBy: r.cutBy[id], cum, p: r.probs[id], rawP: Math.exp(row[id] - d.lse), xtc: xtc.has(id) };
    });
    if (items.some((x) => x.text === null)) scheduleRequery(400); // a token the candidates do not hold: its text
  } else if (useServer) {
    items = d.raw.candidates.slice(0, N).map((c) => ({ id: c.token_id, text: c.text, logit: c.logit,
      scaled: st.temperature === 0 ? null : c.scaled_logit, kept: c.kept, cutBy: c.kept ? null : c.cut_by || "cut",
      cum: c.cumulative, p: c.probability, rawP: c.raw_probability, xtc: false }));
  } else {
    $("#exactness").textContent = row ? "computed by the server — waiting for its answer" : "waiting for all V logits…";
    $("#exactness").className = "badge bounded";
    if (row) scheduleRequery(0);
    return;
  }
  paintRows(items, r ? r.config : lmheadPipeline.configOf(state.decl, st, eosIds()));
  $("#stage").dataset.settings = settingsKey(st);
  let mass = null;
  if (r) {
    const sp = lmheadPipeline.softmax(r.scaled);
    mass = 0;
    for (let i = 0; i < sp.length; i++) if (r.keep[i]) mass += sp[i];
  }
  const kept = r ? r.kept : d.raw.kept_count;
  const ent = r ? r.entropy : d.raw.entropy.processed;
  $("#entropy-raw").textContent = nats(d.raw.entropy.raw);
  $("#entropy").textContent = nats(ent);
  $("#entropy").dataset.value = String(ent);
  $("#kept-count").textContent = kept.toLocaleString();
  $("#kept-unit").textContent = kept === 1 ? "token" : "tokens";
  $("#kept-mass").textContent = mass === null ? "–" : pct(mass);
  $("#exactness").textContent = r ? `exact — every step run here over all ${d.V.toLocaleString()} logits`
    : `exact — computed by the server over all ${d.V.toLocaleString()} tokens`;
  $("#exactness").className = "badge exact";
  const shown = items.filter((x) => x.kept).length;
  $("#more").textContent = kept > shown ? `${(kept - shown).toLocaleString()} more kept tokens are not shown.` : "";
  const probs = new Map();
  for (const c of d.raw.candidates) {
    probs.set(c.token_id, r ? { p: r.probs[c.token_id], kept: !!r.keep[c.token_id] } : { p: c.probability, kept: c.kept });
  }
  state.candProbs = probs;
  renderGeometry();
  const cfg = r ? r.config : lmheadPipeline.configOf(state.decl, st, eosIds());
  renderChain(r ? r.steps : (useServer ? d.raw.steps || [] : []), cfg);
}

// The stage table's rows from `items` (the declared path): cut rows name the step that cut them (the explainer's
// cut_by, in data-cut); rows XTC removes when its coin lands are marked (they keep a share of the mixture).
function paintRows(items, cfg) {
  const frag = document.createDocumentFragment();
  items.forEach((x, i) => {
    const cut = !x.kept;
    const tr = el("tr", { class: (cut ? "cut" : "kept") + (x.xtc ? " xtc" : ""), "data-rank": String(i + 1),
      "data-id": String(x.id), "data-cut": cut ? x.cutBy || "" : "" });
    tr.append(el("td", { text: String(i + 1) }));
    tr.append(el("td", { class: "tok" }, x.text === null ? el("span", { class: "chip", text: `id ${x.id}`,
      title: `id ${x.id}`, "data-id": String(x.id) }) : chip(x.text, x.id)));
    tr.append(el("td", { text: fix(x.logit) }));
    tr.append(el("td", { text: x.scaled === null ? "—" : fix(x.scaled) }));
    const after = el("td", { class: "after" });
    after.append(cut ? "−∞" : fix(x.scaled === null ? x.logit : x.scaled));
    if (cut && x.cutBy) after.append(el("span", { class: "why", text: stepLabel(x.cutBy), title: stepReason(x.cutBy) }));
    if (x.xtc) after.append(el("span", { class: "why xtcmark", text: `XTC ${pct(cfg.xtc_probability)}`,
      title: `XTC removes this token when its coin lands (probability ${cfg.xtc_probability}): it keeps only the ` +
        "share of the mixture that the coin's other side gives it" }));
    after.append(el("span", { class: "thin", text: ` (${pct(Math.min(1, x.cum))})` }));
    tr.append(after);
    const probCell = el("td", { class: "probcol prob", "data-p": String(x.p) });
    const bar = el("div", { class: "bar", role: "img", "aria-label": `probability ${pct(x.p)}` }, el("span"));
    bar.firstChild.style.width = `${Math.min(100, x.p * 100)}%`;
    bar.append(el("em", { text: pct(x.p) }));
    probCell.append(bar);
    tr.append(probCell);
    const rawCell = el("td", { class: "probcol raw", "data-p": String(x.rawP) });
    const rbar = el("div", { class: "bar raw", role: "img", "aria-label": `raw probability ${pct(x.rawP)}` }, el("span"));
    rbar.firstChild.style.width = `${Math.min(100, x.rawP * 100)}%`;
    rbar.append(el("em", { text: pct(x.rawP) }));
    rawCell.append(rbar);
    tr.append(rawCell);
    frag.append(tr);
  });
  $("#stage tbody").replaceChildren(frag);
}

const stepLabel = (name) => name.replace(/_/g, "-");
function stepReason(name) {
  const step = state.decl.steps.find((s) => s.name === (name === "bias" ? "logit_bias" : name));
  return name === "greedy" ? "temperature 0: only the most likely token" : step ? step.explain : "";
}

// The chain that runs, in order: each step with its settings and the tokens it cut (of those still in; "–" where
// the page does not know the whole row's count).
function renderChain(steps, cfg) {
  const box = $("#chain");
  const byName = Object.fromEntries(state.decl.steps.map((s) => [s.name, s]));
  box.replaceChildren(...steps.map((x) => {
    const step = byName[x.name] || { params: [], origin: "", explain: "" };
    const params = step.params.map((n) => `${n}=${JSON.stringify(cfg[n])}`).join(" ");
    return el("li", { "data-step": x.name, "data-cut": x.cut === null ? "" : String(x.cut),
      title: `${step.origin}${step.explain ? " — cuts a token: " + step.explain : ""}` },
      el("code", { text: x.name }), el("span", { class: "thin", text: ` ${params}` }),
      el("span", { class: "cutcount", text: x.cut === null ? "" : ` cut ${x.cut.toLocaleString()}` }));
  }));
  box.hidden = !steps.length;
}

function serverKeptMass(d, st) {
  // Mass of the kept tokens under the temperature-scaled distribution (before renormalising).
  const cands = d.raw.candidates;
  if (d.raw.kept_count === d.V) return 1; // nothing cut
  let m = 0, all = true;
  for (const c of cands) if (c.kept) m += st.temperature === 0 ? c.raw_probability : c.scaled_probability;
  if (d.raw.kept_count > cands.filter((c) => c.kept).length) all = false;
  return all ? m : null;
}

// ------------------------------------------------------------------------------------------------------------
// Talking to the server

function candidatesWanted() {
  const V = state.model ? state.model.vocab_size : 256;
  const max = state.model ? state.model.limits.max_candidates : 1000;
  if (state.candidates) return Math.min(state.candidates, max, V); // set by hand (window.lmhead.state)
  return V <= max ? V : 256; // a small vocabulary is sent whole: then everything is exact
}

function loadData(raw, st) {
  const z = raw.candidates.map((c) => c.logit);
  state.data = {
    raw, z, V: raw.vocab_size, lse: raw.logsumexp,
    byId: new Map(raw.candidates.map((c) => [c.token_id, c])),
    sorted: z.every((v, i) => i === 0 || z[i - 1] >= v), // by logit: what the prefix pipeline needs
    rawP: raw.candidates.map((c) => c.raw_probability),
    scaledT: st.temperature > 0 ? st.temperature : null,
    scaledLse: st.temperature > 0 ? raw.scaled_logsumexp : null,
  };
  state.dataSettings = st;
  state.dataConstraint = constraintKey(raw.constraint ? constraintAsked() : null);
  document.querySelectorAll(".n-cand").forEach((e) => (e.textContent = String(z.length)));
  document.querySelectorAll(".n-vocab").forEach((e) => (e.textContent = raw.vocab_size.toLocaleString()));
}

async function predict(opts = {}) {
  const prompt = opts.prompt ?? $("#prompt").value;
  if (!prompt) { setStatus("Type a prompt first.", true); return; }
  const { st, error } = readSettings();
  if (error) { setStatus(error, true); return; }
  const seq = ++state.seq;
  if (!opts.quiet) setStatus("Running the model…");
  try {
    const raw = await api("/api/predict", { prompt, top: candidatesWanted(), ...st, ...constraintFields(prompt) });
    if (seq !== state.seq) return; // a newer request is on its way
    state.prompt = prompt;
    if (opts.generatedFrom !== undefined) state.generatedFrom = opts.generatedFrom;
    loadData(raw, st);
    renderChips(raw.prompt_tokens, state.generatedFrom);
    render();
    if (!opts.quiet) setStatus("");
    if (!opts.quiet) refreshCharts(prompt);
    if ($("#layers-panel").open) loadLayers();
  } catch (e) {
    if (seq === state.seq) setStatus(e.message, true);
  }
}

function scheduleRequery(ms) {
  clearTimeout(state.requery);
  state.requery = setTimeout(() => {
    if (!state.data || (sameSettings(settings(), state.dataSettings) &&
      constraintKey(constraintAsked()) === state.dataConstraint)) return;
    predict({ quiet: true, prompt: state.prompt });
  }, ms);
}

function setBusy(b) {
  state.busy = b;
  for (const id of ["#next-token", "#generate", "#predict"]) $(id).disabled = b;
}

function noteChoice(ev) {
  const box = $("#chosen");
  const text = visible(ev.text);
  const why = `rank ${ev.rank}` + (ev.rank === 1 ? " (the most likely token)" : " — sampling drew a less likely token");
  const pick = el("span", { class: "pick" }, "chose ", el("code", { text: text || visible(ev.decoded || "") || `id ${ev.token_id}` }),
    ` id ${ev.token_id}: p = ${pct(ev.probability)} after the pipeline, ${pct(ev.raw_probability)} raw, ${why}`);
  box.append(pick);
  while (box.children.length > 6) box.firstChild.remove();
}

async function nextToken() {
  if (state.busy) return;
  const prompt = $("#prompt").value;
  if (!prompt) { setStatus("Type a prompt first.", true); return; }
  setBusy(true);
  try {
    const before = state.generatedFrom ?? (state.data ? state.data.raw.prompt_tokens.length : null);
    const { st, error } = readSettings();
    if (error) { setStatus(error, true); return; }
    const r = await api("/api/step", { prompt, ...st, ...constraintFields(prompt), seed: seed(), step: state.step });
    state.step += 1;
    noteGenerated(prompt, r.token_id, r.text, st);
    $("#prompt").value = r.prompt;
    state.prompt = r.prompt;
    noteChoice(r);
    if (r.finish_reason === "stop" && !r.text) setStatus("The model chose its end-of-sequence token.");
    await predict({ generatedFrom: before });
    loadSteps();
  } catch (e) {
    setStatus(e.message, true);
  } finally {
    setBusy(false);
  }
}

async function generate() {
  if (state.busy) return;
  const prompt = $("#prompt").value;
  if (!prompt) { setStatus("Type a prompt first.", true); return; }
  const n = Math.max(1, Math.min(64, parseInt($("#steps").value, 10) || 8));
  setBusy(true);
  setStatus("Generating…");
  const before = state.generatedFrom ?? (state.data ? state.data.raw.prompt_tokens.length : null);
  try {
    const { st, error } = readSettings();
    if (error) { setStatus(error, true); return; }
    const r = await fetch(withModel("/api/generate"), {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ prompt, ...st, ...constraintFields(prompt), seed: seed(), step: state.step, max_tokens: n }),
    });
    if (!r.ok) {
      const j = await r.json().catch(() => ({}));
      throw new Error(typeof j.detail === "string" ? j.detail : `HTTP ${r.status}`);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    let text = prompt;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let k;
      while ((k = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, k).trim();
        buf = buf.slice(k + 2);
        if (!line.startsWith("data: ")) continue;
        const payload = line.slice(6);
        if (payload === "[DONE]") continue;
        const ev = JSON.parse(payload);
        if (ev.error) throw new Error(ev.error);
        noteGenerated(text, ev.token_id, ev.text, st);
        text += ev.text;
        $("#prompt").value = text;
        noteChoice(ev);
        if (ev.finish_reason) setStatus(ev.finish_reason === "stop" ? "Stopped: end of sequence." : "");
      }
    }
    state.step += n;
    state.prompt = text;
    await predict({ generatedFrom: before });
    loadSteps();
    setStatus("");
  } catch (e) {
    setStatus(e.message, true);
  } finally {
    setBusy(false);
  }
}

async function loadLayers() {
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

async function score(ev) {
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

async function loadParams() {
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

// ------------------------------------------------------------------------------------------------------------
// The pictures (drawn by charts.js; every number from /api/geometry, /distribution, /draws, /steps: the server
// computes them over the full vocabulary with the full-precision head)

const charts = () => window.lmheadCharts;
const MAX_DRAWS = 10000, DRAW_WORK = 2 ** 26; // lmhead.explain_charts.MAX_DRAWS / DRAW_WORK

function chartError(sel, e) {
  $(sel).replaceChildren(el("p", { class: "status error", role: "alert", text: e.message }));
}

function refreshCharts(prompt) {
  loadDistribution();
  if (prompt !== state.geoPrompt) loadGeometry();
  if (state.draws && state.draws.prompt !== prompt) clearDraws();
}

async function loadDistribution() {
  const prompt = state.prompt;
  if (!prompt) return;
  const seq = ++state.distSeq;
  const { st, error } = readSettings();
  if (error) { setStatus(error, true); return; }
  try {
    const d = await api("/api/distribution", { prompt, ...st });
    if (seq !== state.distSeq) return; // a newer setting is on its way
    state.dist = d;
    const fig = $("#dist-chart");
    charts().rankChart(fig, d);
    fig.dataset.settings = JSON.stringify(st);
    updateDrawLimit(d.kept_count);
  } catch (e) {
    if (seq === state.distSeq) chartError("#dist-chart", e);
  }
}

function scheduleDistribution(ms) {
  clearTimeout(state.distTimer);
  state.distTimer = setTimeout(loadDistribution, ms);
}

async function loadGeometry() {
  const prompt = state.prompt;
  if (!prompt) return;
  const top = parseInt($("#geo-top").value, 10);
  try {
    const g = await api("/api/geometry", { prompt, top });
    if (prompt !== state.prompt || top !== parseInt($("#geo-top").value, 10)) return;
    state.geo = g;
    state.geoPrompt = prompt;
    renderGeometry();
  } catch (e) {
    chartError("#geo-chart", e);
  }
}

function renderGeometry() {
  if (!state.geo) return;
  const fig = $("#geo-chart");
  charts().geometryChart(fig, state.geo, state.candProbs);
  fig.dataset.top = String(state.geo.candidates.length);
}

function updateDrawLimit(kept) {
  const most = Math.max(1, Math.min(MAX_DRAWS, Math.floor(DRAW_WORK / Math.max(1, kept))));
  $("#draw-n").max = String(most);
  $("#draw-n-help").textContent = `at most ${most.toLocaleString()} with ${kept.toLocaleString()} tokens kept ` +
    "(every draw reads each kept token)";
}

async function draw() {
  const prompt = state.prompt;
  if (!prompt) { setStatus("Show the candidates first.", true); return; }
  const most = parseInt($("#draw-n").max, 10) || MAX_DRAWS;
  const n = Math.max(1, Math.min(most, parseInt($("#draw-n").value, 10) || 1000));
  $("#draw-n").value = String(n);
  const { st, error } = readSettings();
  if (error) { setStatus(error, true); return; }
  $("#draw").disabled = true;
  try {
    const d = await api("/api/draws", { prompt, ...st, n, seed: seed() ?? 0 });
    state.draws = { ...d, prompt, settings: st };
    $("#draw-upto").disabled = false;
    $("#draw-upto").value = "1000";
    renderDraws();
    $("#draw-chart").dataset.settings = JSON.stringify(st);
  } catch (e) {
    chartError("#draw-chart", e);
  } finally {
    $("#draw").disabled = false;
  }
}

// The replay slider is logarithmic: position v of 0..1000 shows the first N^(v/1000) draws.
function drawsUpTo() {
  const N = state.draws.n;
  return Math.max(1, Math.min(N, Math.round(Math.pow(N, parseInt($("#draw-upto").value, 10) / 1000))));
}

function renderDraws() {
  if (!state.draws) return;
  const n = drawsUpTo();
  $("#draw-upto-out").value = `${n.toLocaleString()} of ${state.draws.n.toLocaleString()}`;
  $("#draw-upto").setAttribute("aria-valuetext", `the first ${n} of ${state.draws.n} draws`);
  charts().drawChart($("#draw-chart"), state.draws, n);
}

function clearDraws() {
  state.draws = null;
  $("#draw-chart").replaceChildren();
  $("#draw-upto").disabled = true;
  $("#draw-upto-out").value = "–";
}

function scheduleRedraw() {
  if (!state.draws) return;
  clearTimeout(state.drawTimer);
  state.drawTimer = setTimeout(draw, 150); // the settings changed: the histogram must be of the new distribution
}

// This generation: the prompt it grew from, and each token with the settings it was drawn with.
function noteGenerated(textBefore, tokenId, text, st) {
  const g = state.gen;
  const sofar = g.prompt === null ? null : g.prompt + g.tokens.map((t) => t.text).join("");
  if (sofar !== textBefore || g.tokens.length >= 256) { g.prompt = textBefore; g.tokens = []; }
  g.tokens.push({ token_id: tokenId, text, settings: st });
}

function resetGeneration() {
  state.gen = { prompt: null, tokens: [] };
  $("#steps-section").hidden = true;
  $("#steps-chart").replaceChildren();
}

async function loadSteps() {
  const g = state.gen;
  if (!g.prompt || !g.tokens.length) return;
  $("#steps-section").hidden = false;
  try {
    const r = await api("/api/steps", { prompt: g.prompt,
      tokens: g.tokens.map((t) => ({ token_id: t.token_id, ...t.settings })) });
    charts().stepsChart($("#steps-chart"), r.steps);
  } catch (e) {
    chartError("#steps-chart", e);
  }
}

// ------------------------------------------------------------------------------------------------------------
// The model selector: the server's models, each loaded on its first use (GET /api/models, ?model=NAME)

async function loadModelInfo() {
  const m = await api("/api/model");
  state.model = m;
  $("#model-facts").textContent = `· vocabulary ${m.vocab_size.toLocaleString()} · width ${m.width} · ` +
    `${m.layers} layers · ${m.tied_head ? "tied" : "untied"} head` + (m.softcap ? ` · softcap ${m.softcap}` : "");
}

async function loadModels() {
  const m = await api("/api/models");
  state.models = m;
  const sel = $("#model-select");
  sel.replaceChildren(...m.models.map((x) => el("option", { value: x.name,
    text: x.name + (x.loaded ? "" : " (loads on first use)") })));
  sel.value = state.modelName || m.default;
}

async function chooseModel() {
  const sel = $("#model-select");
  const name = sel.value, before = state.modelName;
  state.modelName = name;
  sel.disabled = true;
  document.body.dataset.ready = "0";
  setStatus(`Loading ${name}… (a model loads on its first use; this can take a while)`);
  try {
    await loadModelInfo();
    state.data = null; state.geo = null; state.geoPrompt = null; state.dist = null;
    clearDraws();
    resetGeneration();
    $("#params-out").dataset.loaded = "";
    $("#params-out").replaceChildren();
    await loadModels();
    setStatus("");
    if ($("#prompt").value) { state.step = 0; await predict({ generatedFrom: null }); }
  } catch (e) {
    state.modelName = before;
    await loadModels().catch(() => {});
    sel.value = before || (state.models ? state.models.default : name);
    setStatus(e.message, true);
  } finally {
    sel.disabled = false;
    document.body.dataset.ready = "1";
  }
}

// ------------------------------------------------------------------------------------------------------------
// Wiring

function selectTab(tab) {
  for (const t of document.querySelectorAll("[role=tab]")) {
    const on = t === tab;
    t.setAttribute("aria-selected", String(on));
    t.tabIndex = on ? 0 : -1;
    document.getElementById(t.getAttribute("aria-controls")).hidden = !on;
  }
  tab.focus();
  if (tab.id === "tab-params") loadParams();
}

function resetSettings() {
  $("#temperature").value = "1"; $("#top-k").value = "0"; $("#top-p").value = "1"; $("#min-p").value = "0";
  if (state.decl) resetStepControls();
  settingsChanged(true);
}

async function init() {
  const tabs = Array.from(document.querySelectorAll("[role=tab]"));
  tabs.forEach((t, i) => {
    t.addEventListener("click", () => selectTab(t));
    t.addEventListener("keydown", (e) => {
      const d = e.key === "ArrowRight" ? 1 : e.key === "ArrowLeft" ? -1 : 0;
      if (d) { e.preventDefault(); selectTab(tabs[(i + d + tabs.length) % tabs.length]); }
      if (e.key === "Home") { e.preventDefault(); selectTab(tabs[0]); }
      if (e.key === "End") { e.preventDefault(); selectTab(tabs[tabs.length - 1]); }
    });
  });
  const submit = () => { state.step = 0; resetGeneration(); predict({ generatedFrom: null }); };
  $("#prompt-form").addEventListener("submit", (e) => { e.preventDefault(); submit(); });
  $("#prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); submit(); }
  });
  for (const id of ["#temperature", "#top-k", "#top-p", "#min-p"]) {
    $(id).addEventListener("input", () => settingsChanged(false));
    $(id).addEventListener("change", () => settingsChanged(true));
  }
  $("#rows").addEventListener("change", render);
  for (const id of ["#constraint-kind", "#constraint-text"]) {
    $(id).addEventListener("change", () => { state.answer = null; scheduleRequery(0); });
  }
  // typing (not the page's own writes of chosen tokens) moves where a constrained answer starts
  $("#prompt").addEventListener("input", () => { state.answer = null; });
  $("#next-token").addEventListener("click", nextToken);
  $("#generate").addEventListener("click", generate);
  $("#reset").addEventListener("click", resetSettings);
  $("#layers-panel").addEventListener("toggle", () => { if ($("#layers-panel").open) loadLayers(); });
  $("#score-form").addEventListener("submit", score);
  $("#geo-top").addEventListener("input", () => { $("#geo-top-out").value = $("#geo-top").value; });
  $("#geo-top").addEventListener("change", () => { $("#geo-top-out").value = $("#geo-top").value; loadGeometry(); });
  $("#draw").addEventListener("click", draw);
  $("#draw-upto").addEventListener("input", renderDraws);
  $("#model-select").addEventListener("change", chooseModel);
  showSettings();
  try {
    await loadModelInfo();
    await loadModels();
    state.decl = await api("/api/samplers");
    buildStepControls(state.decl);
  } catch (e) {
    setStatus(`The server did not answer: ${e.message}`, true);
    return;
  }
  document.body.dataset.ready = "1";
}

// For tests and the curious: the pipeline functions and the state (in Node: module.exports, for the tests that
// compare this pipeline with lmhead.sampling's over a full vocabulary).
if (typeof window !== "undefined") {
  window.lmhead = { state, compute, settings, readSettings, settingsKey, pct, withModel };
  init();
} else if (typeof module !== "undefined") {
  module.exports = { compute, tailBounds, runPipeline, entropyOf };
}
