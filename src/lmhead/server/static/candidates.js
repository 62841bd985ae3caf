// lmhead explainer — the "Next token" view's candidates: the prompt's chips, the output stage's table, the summary
// (entropy, kept, how the numbers were computed) and the strip of the steps that ran.
//
// The server sends the top N candidates of a prompt (/api/predict); the page runs the declared chain itself over all V
// logits (pipeline.js with the steps' table, steps.js): the candidates when the whole vocabulary was sent, else POST
// /api/logits once per prompt. A control that moves recomputes every number at once, exact. The server's numbers are
// shown where the page cannot compute them: a constrained prompt (the constraint's mask is not known here) or a
// declared step the table does not hold; they are asked again when a setting is released.

import { configOf, isGreedy, runChain, topOrder } from "./pipeline.js";
import { softmax } from "./rows.js";
import { STEPS } from "./steps.js";
import { refreshCharts, renderGeometry } from "./pictures.js";
import { loadLayers } from "./lens.js";
import { constraintAsked, constraintFields, constraintKey, readSettings, sameSettings, settings, settingsKey,
  showSettings } from "./settings.js";
import { state } from "./state.js";
import { $, api, el, fix, nats, pct, setStatus, visible } from "./util.js";

export function chip(text, id, cls = "chip") {
  return el("span", { class: cls, role: "listitem", title: `id ${id}`, "data-id": String(id), tabindex: "0",
    "aria-label": `token ${visible(text)}, id ${id}` }, visible(text));
}

function renderChips(tokens, generatedFrom) {
  $("#chips").replaceChildren(...tokens.map((t, i) => chip(t.text, t.token_id,
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

const eosIds = () => (state.model ? state.model.eos_token_ids : []);

// All V logits of the prompt (float64): the candidates themselves when the server sent the whole vocabulary, else POST
// /api/logits once per prompt (the page re-renders when they arrive); null until then.
function fullRow(d) {
  if (d.row) return d.row;
  if (d.V === d.raw.candidates.length) {
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

// The page's own run of the chain for the shown prompt at `st` (null: not known here — the row has not arrived, the
// prompt is constrained, or a step that runs has no preview); throws the chain's error for settings it rejects.
function ownRun(d, st) {
  if (state.dataConstraint !== "") return null;
  const row = fullRow(d);
  if (!row) return null;
  const r = runChain(state.decl, row, st, { history: d.raw.prompt_tokens.map((t) => t.token_id) }, eosIds());
  return r.missing.length ? null : { ...r, row, scaledProbs: softmax(r.scaled) };
}

// The table's rows from the page's run, or from the server's candidates. `cum`: the running mass of the distribution
// after the temperature, before the cuts (the explainer's scaled_cumulative: what top-p compares with p); a greedy
// row's, of its probabilities.
function ownItems(d, r, n) {
  const xtc = new Set(r.xtc), mass = r.greedy ? r.probs : r.scaledProbs;
  let cum = 0;
  return topOrder(r.adjusted, r.row, n).map((id) => {
    cum += mass[id];
    const c = d.byId.get(id);
    return { id, text: c ? c.text : null, logit: r.row[id], scaled: r.greedy ? null : r.scaled[id], kept: !!r.keep[id],
      cutBy: r.cutBy[id], cum, p: r.probs[id], rawP: Math.exp(r.row[id] - d.lse), xtc: xtc.has(id) };
  });
}
const serverItems = (d, greedy, n) => d.raw.candidates.slice(0, n).map((c) => ({ id: c.token_id, text: c.text,
  logit: c.logit, scaled: greedy ? null : c.scaled_logit, kept: c.kept, cutBy: c.kept ? null : c.cut_by || "cut",
  cum: greedy ? c.cumulative : c.scaled_cumulative, p: c.probability, rawP: c.raw_probability, xtc: false }));

export function render() {
  const d = state.data;
  showSettings();
  const st = checkedSettings();
  if (!d || !st) return;
  const useServer = sameSettings(st, state.dataSettings) && constraintKey(constraintAsked()) === state.dataConstraint;
  let r;
  try {
    r = ownRun(d, st);
  } catch (e) {
    state.settingsError = e.message;
    setStatus(e.message, true);
    return;
  }
  const N = Math.min(parseInt($("#rows").value, 10), d.V);
  if (!r && !useServer) {
    const waiting = state.dataConstraint === "" && !fullRow(d);
    $("#exactness").textContent = waiting ? "waiting for all V logits…" : "computed by the server — waiting for its answer";
    $("#exactness").className = "badge bounded";
    if (!waiting) scheduleRequery(150); // while a control moves, once it rests
    return;
  }
  const cfg = r ? r.config : configOf(state.decl, st, eosIds());
  const items = r ? ownItems(d, r, N) : serverItems(d, isGreedy(cfg), N);
  if (r && items.some((x) => x.text === null)) scheduleRequery(400); // a token the candidates do not hold: its text
  paintRows(items, cfg);
  $("#stage").dataset.settings = settingsKey(st); // what the table shows (the tests wait for it)
  renderSummary(d, r, items);
  const probs = new Map();
  for (const c of d.raw.candidates) {
    probs.set(c.token_id, r ? { p: r.probs[c.token_id], kept: !!r.keep[c.token_id] } : { p: c.probability, kept: c.kept });
  }
  state.candProbs = probs;
  renderGeometry();
  renderChain(r ? r.steps : d.raw.steps || [], cfg);
}

// Entropy, the tokens kept and their share of the mass after the temperature, and who computed the numbers.
function renderSummary(d, r, items) {
  let mass = null;
  if (r) {
    mass = 0;
    for (let i = 0; i < r.scaledProbs.length; i++) if (r.keep[i]) mass += r.scaledProbs[i];
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
}

const stepLabel = (name) => (name === "constraint" ? "cut by the constraint" : name.replace(/_/g, "-"));
function stepReason(name) {
  const step = state.decl.steps.find((s) => s.name === (name === "bias" ? "logit_bias" : name));
  return name === "greedy" ? "temperature 0: only the most likely token" : step ? step.explain : "";
}

function bar(p, cls, label) {
  const b = el("div", { class: cls, role: "img", "aria-label": `${label} ${pct(p)}` }, el("span"));
  b.firstChild.style.width = `${Math.min(100, p * 100)}%`;
  b.append(el("em", { text: pct(p) }));
  return b;
}

// The stage table's rows from `items`: cut rows name the step that cut them (the explainer's cut_by, in data-cut);
// the last kept row above the rows a step with a `boundary` cut says where that step cut (top-p's crossing); rows XTC
// removes when its coin lands are marked (they keep a share of the mixture).
function paintRows(items, cfg) {
  const frag = document.createDocumentFragment();
  items.forEach((x, i) => {
    const cut = !x.kept, next = items[i + 1];
    const edge = !cut && next && !next.kept && STEPS[next.cutBy] && STEPS[next.cutBy].boundary;
    const tr = el("tr", { class: (cut ? "cut" : "kept") + (x.xtc ? " xtc" : "") + (edge ? " cross" : ""),
      "data-rank": String(i + 1), "data-id": String(x.id), "data-cut": cut ? x.cutBy || "" : "", "data-cum": String(x.cum) });
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
    if (edge) after.append(el("span", { class: "crossmark", text: `${stepLabel(next.cutBy)}: ${STEPS[next.cutBy].boundary(cfg)}` }));
    tr.append(after);
    tr.append(el("td", { class: "probcol prob", "data-p": String(x.p) }, bar(x.p, "bar", "probability")));
    tr.append(el("td", { class: "probcol raw", "data-p": String(x.rawP) }, bar(x.rawP, "bar raw", "raw probability")));
    frag.append(tr);
  });
  $("#stage tbody").replaceChildren(frag);
}

// The chain that runs, in order: each step with its settings and the tokens it cut (of those still in).
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

// --- talking to the server -------------------------------------------------------------------------------------

function candidatesWanted() {
  const V = state.model ? state.model.vocab_size : 256;
  const max = state.model ? state.model.limits.max_candidates : 1000;
  if (state.candidates) return Math.min(state.candidates, max, V); // set by hand (window.lmhead.state)
  return V <= max ? V : 256; // a small vocabulary is sent whole: the page then needs nothing more
}

function loadData(raw, st) {
  state.data = { raw, V: raw.vocab_size, lse: raw.logsumexp, byId: new Map(raw.candidates.map((c) => [c.token_id, c])) };
  state.dataSettings = st;
  state.dataConstraint = constraintKey(raw.constraint ? constraintAsked() : null);
  document.querySelectorAll(".n-cand").forEach((e) => (e.textContent = String(raw.candidates.length)));
  document.querySelectorAll(".n-vocab").forEach((e) => (e.textContent = raw.vocab_size.toLocaleString()));
}

export async function predict(opts = {}) {
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

// The server's numbers at the current settings, `ms` from now (unless the shown ones are already those).
export function scheduleRequery(ms) {
  clearTimeout(state.requery);
  state.requery = setTimeout(() => {
    if (!state.data || (sameSettings(settings(), state.dataSettings) &&
      constraintKey(constraintAsked()) === state.dataConstraint)) return;
    predict({ quiet: true, prompt: state.prompt });
  }, ms);
}
