// lmhead explainer — the declared chain run in the page over the whole row: lmhead.sampling's order and rules from the
// declaration (GET /api/samplers: lmhead.sampling.steps.describe — the steps, their stages and parameters, lmhead's
// order, the presets and the aliases an order may use), each step's arithmetic from the page's table (steps.js), in
// float64 where torch mostly runs float32 (the tests compare at a stated tolerance). A step the server declares and the
// table does not hold makes `runChain` report it in `missing`, and the page then shows the server's numbers.
//
// XTC's coin is not thrown: the distribution shown is the one the draw follows, the mixture
// (1 − P)·p(coin off) + P·p(coin on), while the cut marks are those of the coin landing (lmhead.sampling.general).

import { NEG, argmaxOf, kthLargest, maxOf, softmax } from "./rows.js";
import { GREEDY_TEMPERATURE, STEPS, xtcRemoved } from "./steps.js";

export { STEPS };

// A step's name as lmhead spells it, from its own or an alias (lmhead.sampling.steps.canonical).
export function canonical(decl, name) {
  const key = String(name).trim().toLowerCase();
  const orderable = new Set(decl.orderable);
  for (const k of [key, key.replace(/-/g, "_")]) {
    for (const s of decl.steps) {
      if ((s.name === k || s.aliases.includes(k)) && orderable.has(s.name)) return s.name;
    }
  }
  throw new Error(`samplers: ${JSON.stringify(name)} is not a step that can be ordered; the names are ` +
    `${decl.order.join(", ")} (and their llama.cpp / transformers spellings), or a preset: ${Object.keys(decl.presets).join(", ")}`);
}

// The order of stages 2-4 a `samplers` value gives (null: lmhead's), as lmhead.sampling.steps._check_samplers.
export function orderOf(decl, samplers) {
  if (samplers === null || samplers === undefined) return null;
  let names = samplers;
  if (typeof samplers === "string") {
    if (samplers in decl.presets) return decl.presets[samplers];
    names = samplers.replace(/,/g, ";").split(";").filter((v) => v.trim());
  }
  const out = names.map((n) => canonical(decl, n));
  if (new Set(out).size !== out.length) throw new Error(`samplers must name each step once, got ${JSON.stringify(names)}`);
  return out;
}

// Every declared parameter: the given value or its declared default (ids and sequences as arrays); the model's end of
// sequence joins the stop tokens where min_tokens is on (lmhead.sampling.steps.masks.withhold_stops).
export function configOf(decl, settings, eos = []) {
  const c = {};
  for (const [name, p] of Object.entries(decl.params)) {
    const v = settings[name];
    c[name] = v === undefined || (v === null && p.default !== null) ? p.default : v;
  }
  if (c.min_tokens > 0 && eos.length) c.stop_token_ids = Array.from(new Set([...c.stop_token_ids, ...eos]));
  return c;
}

export const isGreedy = (c) => c.temperature < GREEDY_TEMPERATURE;

// Whether the declared step `s` runs for c: its table entry's rule, or for a step the table does not hold, one of its
// parameters off its declared default.
function isActive(decl, s, c) {
  if (STEPS[s.name]) return STEPS[s.name].active(c);
  return s.params.some((p) => JSON.stringify(c[p]) !== JSON.stringify(decl.params[p].default));
}

// The declared steps that run for c, in order, the active ones only (lmhead.sampling.steps.chain): the masks first,
// then the order (mirostat: temperature and mirostat alone, llama.cpp's rule); a greedy row runs stages 1-2.
export function chain(decl, c) {
  const order = c.mirostat ? ["temperature", "mirostat"] : (orderOf(decl, c.samplers) ?? decl.order);
  const byName = Object.fromEntries(decl.steps.map((s) => [s.name, s]));
  const names = [...decl.masks, ...order.flatMap((o) => decl.groups[o] ?? [o])];
  let steps = names.map((n) => byName[n]).filter(Boolean);
  if (isGreedy(c)) steps = steps.filter((s) => s.stage <= 2);
  return steps.filter((s) => isActive(decl, s, c));
}

function checkIds(c, V) {
  const lists = [["banned_tokens", c.banned_tokens], ["allowed_token_ids", c.allowed_token_ids || []],
    ["stop_token_ids", c.stop_token_ids], ["logit_bias", Object.keys(c.logit_bias || {}).map(Number)],
    ["bad_words", c.bad_words.flat()]];
  for (const [name, ids] of lists) {
    const big = ids.length ? Math.max(...ids) : -1;
    if (big >= V) throw new Error(`${name}: token id ${big} is outside the vocabulary [0, ${V})`);
  }
}

const allCut = (x) => !(maxOf(x) > NEG);
const NO_TOKEN = "logits: row 0 is all -inf (after logit_bias / banned_tokens): no token can be chosen";

// One run of the chain (lmhead.sampling.general._run, and the explainer's stages): the row after each step, the row
// after stages 1-2 (`adjusted`) and after stage 3 (`scaled`), and the processed row (greedy: its argmax).
function runOnce(steps, row, c, ctx) {
  let x = row, adjusted = row, scaled = row, masked = false;
  const after = [];
  for (const s of steps) {
    if (s.stage > 1 && !masked) { masked = true; if (allCut(x)) throw new Error(NO_TOKEN); }
    x = STEPS[s.name].apply(x, c, ctx);
    after.push(x);
    if (s.stage <= 2) adjusted = scaled = x;
    else if (s.stage === 3) scaled = x;
  }
  if (allCut(x)) throw new Error(NO_TOKEN);
  let processed = x;
  if (isGreedy(c)) {
    const i = argmaxOf(x);
    processed = new Float64Array(x.length).fill(NEG);
    processed[i] = x[i];
  }
  return { after, adjusted, scaled, processed };
}

// Each step's count of tokens cut (of those still in) and the first step that cut each token (the explainer's cut_by:
// "bias" for logit_bias; "greedy" for the argmax's rivals, marked by the caller).
function cutsOf(steps, row, after) {
  const V = row.length, cutBy = new Array(V).fill(null), counts = [];
  let prev = row;
  steps.forEach((s, j) => {
    const x = after[j];
    const name = s.name === "logit_bias" ? "bias" : s.name;
    let n = 0;
    for (let i = 0; i < V; i++) if (prev[i] > NEG && !(x[i] > NEG)) { n++; if (cutBy[i] === null) cutBy[i] = name; }
    counts.push({ name: s.name, stage: s.stage, cut: n });
    prev = x;
  });
  return { cutBy, counts };
}

// The whole pipeline on one row (raw logits [V], float64): what lmhead.explain.predict reports for it.
//   probs     the distribution the next draw follows (XTC: the mixture of both outcomes of its coin)
//   adjusted  the logits after stages 1-2 (the candidates' order), scaled: after stage 3
//   cutBy     the declared name of the first step that cut each token ("greedy" for the argmax's rivals), null if kept
//   steps     each step that ran: its name and how many tokens it cut (of those still in; XTC's coin landing)
//   xtc       the tokens XTC removes when its coin lands (empty without XTC); kept, entropy: of `probs`
//   missing   declared steps that are on and that the table does not hold (the numbers are then not known here)
// ctx: { history: the prompt's ids, promptLen }.
export function runChain(decl, row, settings, ctx, eos = []) {
  const c = configOf(decl, settings, eos);
  const V = row.length;
  checkIds(c, V);
  const steps = chain(decl, c);
  const missing = steps.filter((s) => !STEPS[s.name]).map((s) => s.name);
  if (missing.length) return { missing, config: c };
  const base = { history: ctx.history || [], promptLen: ctx.promptLen ?? (ctx.history || []).length, mu: null };
  const on = runOnce(steps, row, c, { ...base, xtc: true });
  const probs = softmax(on.processed);
  const keep = new Uint8Array(V);
  for (let i = 0; i < V; i++) keep[i] = on.processed[i] > NEG ? 1 : 0;
  let xtc = [];
  const at = steps.findIndex((s) => s.name === "xtc");
  if (at >= 0) {
    xtc = xtcRemoved(at > 0 ? on.after[at - 1] : row, c.xtc_threshold);
    if (c.xtc_probability < 1) { // the mixture; a token is kept where it has mass (its log is then finite)
      const off = softmax(runOnce(steps, row, c, { ...base, xtc: false }).processed);
      const P = c.xtc_probability;
      for (let i = 0; i < V; i++) { probs[i] = (1 - P) * off[i] + P * probs[i]; keep[i] = probs[i] > 0 ? 1 : 0; }
    }
  }
  const { cutBy, counts } = cutsOf(steps, row, on.after);
  const greedy = isGreedy(c);
  let kept = 0, h = 0;
  for (let i = 0; i < V; i++) {
    if (keep[i]) { kept++; if (probs[i] > 0) h -= probs[i] * Math.log(probs[i]); } else {
      probs[i] = 0;
      if (cutBy[i] === null && greedy) cutBy[i] = "greedy";
    }
  }
  return { probs, keep, adjusted: on.adjusted, scaled: on.scaled, cutBy, steps: counts, xtc, kept, entropy: h,
    missing: [], greedy, config: c };
}

// The indices of the `n` best tokens by the adjusted logit, ties by the raw logit, then by id (the explainer's order:
// the kept tokens form a prefix).
export function topOrder(adjusted, row, n) {
  const V = adjusted.length;
  n = Math.min(n, V);
  const floor = kthLargest(adjusted, n);
  const idx = [];
  for (let i = 0; i < V; i++) if (adjusted[i] >= floor) idx.push(i);
  idx.sort((a, b) => (adjusted[b] - adjusted[a]) || (row[b] - row[a]) || (a - b));
  return idx.slice(0, n);
}
