// lmhead explainer — the page's table of the declared steps' previews: one entry per step that lmhead.sampling declares
// (GET /api/samplers: lmhead.sampling.steps.describe) and that the page can run itself, by its declared name:
//
//   active(c)         whether the step runs for the config c (every declared parameter, at its value or default)
//   apply(x, c, ctx)  the row [V] after the step (float64; -Infinity: cut), written after its torch implementation in
//                     lmhead/sampling/steps/ (the tests compare the two at a stated tolerance)
//   controls          (optional) the parameters shown first, above the other steps, as sliders over their declared
//                     range: { param: { label, step, max (the slider's end where the declared range has none) } }
//   boundary(c)       (optional) the words for the last kept row above the rows this step cut (top-p's crossing)
//
// Everything else — the names, stages, order, parameters, their ranges and defaults, the controls of every other
// parameter — comes from the declaration. A declared step without an entry here still gets its controls; the page
// then shows the server's numbers for a config that runs it (pipeline.js reports it in `missing`).
//
// One next-token prediction, as lmhead.explain.predict runs it: ctx.history is the prompt (the penalties, DRY, n-grams
// and bad words read it; presence / frequency count generated tokens, none yet; min_tokens withholds the stop tokens
// and the model's end of sequence, none generated yet), mirostat starts from μ = 2τ (a fresh row), and ctx.xtc says
// whether XTC's coin landed (pipeline.js runs both outcomes and mixes them).

import { NEG, keepTop, kthLargest, logSoftmax, entropyOf, maxOf, sameSeq, softmax, topIndices, withCut } from "./rows.js";

export const GREEDY_TEMPERATURE = 1e-5; // lmhead.sampling.steps.temperature
const FLOAT_MAX_LOG = 88.7228391; // log(FLT_MAX): llama.cpp's cap of DRY's exponent
const MIROSTAT_M = 100;

// Python's float ** float where mirostat v1's k is computed: the cases where Python raises (the step then keeps every
// token), a complex result as NaN (also every token).
function pyPow(a, b) {
  if (a === 1 || b === 0 || (a === -1 && !Number.isFinite(b) && !Number.isNaN(b))) return 1;
  if (a === 0 && b < 0 && Number.isFinite(b)) throw new RangeError("ZeroDivisionError");
  if (a < 0 && Number.isFinite(a) && Number.isFinite(b) && !Number.isInteger(b)) return NaN;
  const r = Math.pow(a, b);
  if (!Number.isFinite(r) && !Number.isNaN(r) && Number.isFinite(a) && Number.isFinite(b)) throw new RangeError("OverflowError");
  return r;
}
function pyDiv(a, b) {
  if (b === 0) throw new RangeError("ZeroDivisionError");
  return a / b;
}

// --- stage 1: the masks -----------------------------------------------------------------------------------------

export function bannedByBadWords(badWords, history) { // transformers' NoBadWordsLogitsProcessor
  const out = [];
  for (const seq of badWords) {
    const head = seq.slice(0, -1);
    if (!head.length || (history.length >= head.length && sameSeq(history, history.length - head.length, head)))
      out.push(seq[seq.length - 1]);
  }
  return out;
}

// --- stage 2: the penalties -------------------------------------------------------------------------------------

// llama.cpp's DRY: token → the length of the longest suffix of the history (within the last `lastN`, -1 = all; not
// reaching back past the latest breaker) that also occurs earlier followed by that token; the Z-algorithm over the
// reversed history, as lmhead.sampling.steps.penalties.dry_repeat_lengths.
export function dryRepeatLengths(history, breakers, allowedLength, lastN) {
  const tail = lastN < 0 ? history : history.slice(history.length - Math.min(lastN, history.length));
  const n = tail.length, out = new Map();
  if (n < 2) return out;
  const rev = tail.slice().reverse(), br = new Set(breakers);
  let limit = n;
  for (let i = 0; i < n; i++) if (br.has(rev[i])) { limit = i; break; }
  if (limit < allowedLength) return out;
  const z = new Array(n).fill(0);
  let left = 0, right = 0;
  for (let i = 1; i < n; i++) {
    if (i < right) z[i] = Math.min(right - i, z[i - left]);
    while (i + z[i] < n && rev[z[i]] === rev[i + z[i]]) z[i]++;
    if (i + z[i] > right) { left = i; right = i + z[i]; }
  }
  for (let i = 1; i < n; i++) {
    const len = Math.min(z[i], limit);
    if (len >= allowedLength) out.set(rev[i - 1], Math.max(out.get(rev[i - 1]) || 0, len));
  }
  return out;
}

export function bannedByNgrams(history, size) { // transformers' NoRepeatNGramLogitsProcessor
  if (size <= 0 || history.length + 1 < size) return [];
  const head = size > 1 ? history.slice(history.length - size + 1) : [];
  const out = [];
  for (let i = 0; i + size - 1 < history.length; i++) if (sameSeq(history, i, head)) out.push(history[i + size - 1]);
  return out;
}

// --- stage 3: temperature ---------------------------------------------------------------------------------------

function dynamicTemperature(x, t, spread, exponent) { // llama.cpp's llama_sampler_temp_ext_apply
  let n = 0;
  for (let i = 0; i < x.length; i++) if (Number.isFinite(x[i])) n++;
  if (n <= 1) return t;
  const low = Math.max(0, t - spread), high = t + spread;
  return low + (high - low) * Math.pow(entropyOf(logSoftmax(x)) / Math.log(n), exponent);
}

// --- stage 4: the cuts ------------------------------------------------------------------------------------------

function topK(x, k) {
  if (k >= x.length) return x;
  const kth = kthLargest(x, k);
  return keepTop(x, (i) => x[i] < kth);
}

// Top-p as lmhead.sampling.top_p.top_p_sorted: a tie group goes when the mass of it and every token below it is
// ≤ 1 − p, i.e. when the mass strictly above it is ≥ p; the most probable always stays. Removal runs from some value
// down, so it is a threshold on the logit, found in a window of the largest logits that grows until it holds the
// group where the mass reaches p (as lmhead.sampling's windows do; the whole row at the end).
function topP(x, p) {
  const top = maxOf(x);
  let z = 0;
  for (let i = 0; i < x.length; i++) z += Math.exp(x[i] - top);
  for (let m = 256; ; m *= 4) {
    const idx = topIndices(x, m);
    let above = 0;
    for (let j = 0; j < idx.length; j++) {
      const v = x[idx[j]];
      if (j > 0 && v !== x[idx[j - 1]] && 1 - above <= 1 - p) return keepTop(x, (i) => x[i] <= v);
      above += Math.exp(v - top) / z;
    }
    if (idx.length === x.length) return x;
    const last = x[idx[idx.length - 1]]; // every token below the window: one group's worth of mass above it
    if (1 - above <= 1 - p) return keepTop(x, (i) => x[i] < last);
    if (m >= x.length) return x;
  }
}

function minP(x, p) { // transformers' MinPLogitsWarper: p < min_p · p_max
  const top = maxOf(x);
  return keepTop(x, (i) => Math.exp(x[i] - top) < p);
}

function topA(x, a) { // text-generation-webui's TopALogitsWarper: p < top_a · p_max² (the top token always stays)
  const p = softmax(x), top = maxOf(p), out = Float64Array.from(x);
  for (let i = 0; i < x.length; i++) if (p[i] < a * top * top) out[i] = NEG;
  return out;
}

// transformers' TypicalLogitsWarper: tokens by |−log p − H| ascending, the set ends at the first token where the mass
// reaches typical_p, and every token scored at most that token's is kept (the best scored always). The order among
// equal scores does not change the set — the token where the mass crosses has the score of its whole tie group — so
// the bound is the smallest score whose tokens scored at most it hold typical_p (or the largest score when none
// does), found by bisection over the sorted scores instead of sorting the tokens.
function typicalP(x, tp) {
  const logp = logSoftmax(x), h = entropyOf(logp), V = x.length;
  const score = new Float64Array(V), p = new Float64Array(V);
  for (let i = 0; i < V; i++) { score[i] = Math.abs(-logp[i] - h); p[i] = Math.exp(logp[i]); }
  const sorted = Float64Array.from(score).sort();
  const holds = (bound) => { let m = 0; for (let i = 0; i < V; i++) if (score[i] <= bound) m += p[i]; return !(m < tp); };
  let lo = 0, hi = V - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (holds(sorted[mid])) hi = mid; else lo = mid + 1;
  }
  const bound = sorted[lo];
  const out = Float64Array.from(x);
  for (let i = 0; i < V; i++) if (score[i] > bound) out[i] = NEG;
  return out;
}

function topNSigma(x, n) { // llama.cpp: logits below max − n·σ over the finite logits (one candidate: unchanged)
  let count = 0, sum = 0, top = NEG;
  for (let i = 0; i < x.length; i++) if (Number.isFinite(x[i])) { count++; sum += x[i]; if (x[i] > top) top = x[i]; }
  if (count <= 1) return x;
  const mean = sum / count;
  let ss = 0;
  for (let i = 0; i < x.length; i++) if (Number.isFinite(x[i])) ss += (x[i] - mean) ** 2;
  const floor = top - n * Math.sqrt(ss / count), out = Float64Array.from(x);
  for (let i = 0; i < x.length; i++) if (x[i] < floor) out[i] = NEG;
  return out;
}

// XTC's cut once the coin has landed: the tokens with p ≥ threshold, all but the least probable of them (the highest
// id among ties at that probability stays); none when fewer than two reach it.
export function xtcRemoved(x, threshold) {
  const p = softmax(x), above = [];
  for (let i = 0; i < x.length; i++) if (p[i] >= threshold) above.push(i);
  if (above.length < 2) return [];
  let low = Infinity, last = -1;
  for (const i of above) if (p[i] < low || (p[i] === low && i > last)) { low = p[i]; last = i; }
  return above.filter((i) => i !== last);
}

function epsilon(x, eps) {
  const p = softmax(x);
  return keepTop(x, (i) => p[i] < eps);
}

function eta(x, e) { // transformers' EtaLogitsWarper: η' = min(η, √η · e^−H)
  const logp = logSoftmax(x), bound = Math.min(e, Math.sqrt(e) * Math.exp(-entropyOf(logp)));
  return keepTop(x, (i) => Math.exp(logp[i]) < bound);
}

export function mirostatK(pSorted, vocab, mu) { // llama.cpp v1's k from the Zipf exponent of the top m probabilities
  const m = Math.min(MIROSTAT_M - 1, pSorted.length - 1);
  if (m < 1) return 1;
  let tb = 0, tt = 0;
  for (let i = 0; i < m; i++) {
    const t = Math.log((i + 2) / (i + 1));
    tb += t * Math.log(pSorted[i] / pSorted[i + 1]);
    tt += t * t;
  }
  const sHat = tb / tt, e = sHat - 1;
  let k;
  try {
    k = pyPow(pyDiv(e * pyPow(2, mu), 1 - pyPow(vocab, -e)), pyDiv(1, sHat));
  } catch (err) {
    if (err instanceof RangeError) return vocab;
    throw err;
  }
  return Number.isFinite(k) ? Math.max(Math.trunc(k), 1) : vocab;
}

function mirostat(x, c, ctx) {
  const mu = ctx.mu ?? 2 * c.mirostat_tau;
  const logp = logSoftmax(x);
  if (c.mirostat === 1) {
    const p = new Float64Array(x.length);
    for (let i = 0; i < x.length; i++) p[i] = Math.exp(logp[i]);
    // the fit reads the top m + 1 probabilities only (the zeros of cut tokens included, as the sorted row has them)
    const top = topIndices(p, MIROSTAT_M).slice(0, MIROSTAT_M).map((i) => p[i]);
    const k = mirostatK(top, x.length, mu);
    return k >= x.length ? x : topK(x, k);
  }
  return keepTop(x, (i) => -logp[i] / Math.LN2 > mu);
}

// --- the table ----------------------------------------------------------------------------------------------------

const hasBias = (c) => !!c.logit_bias && Object.keys(c.logit_bias).length > 0;

export const STEPS = {
  logit_bias: {
    active: (c) => hasBias(c) || c.banned_tokens.length > 0,
    apply(x, c) {
      const out = Float64Array.from(x);
      for (const [id, v] of Object.entries(c.logit_bias || {})) out[+id] += v;
      for (const id of c.banned_tokens) out[id] = NEG;
      return out;
    },
  },
  allowed_token_ids: {
    active: (c) => c.allowed_token_ids !== null,
    apply(x, c) {
      const out = new Float64Array(x.length).fill(NEG);
      for (const id of c.allowed_token_ids) out[id] = x[id];
      return out;
    },
  },
  bad_words: {
    active: (c) => c.bad_words.length > 0,
    apply: (x, c, ctx) => withCut(x, bannedByBadWords(c.bad_words, ctx.history)),
  },
  min_tokens: {
    active: (c) => c.min_tokens > 0 && c.stop_token_ids.length > 0,
    apply: (x, c, ctx) => (ctx.history.length - ctx.promptLen >= c.min_tokens ? x : withCut(x, c.stop_token_ids)),
  },
  penalties: { // CTRL's repetition over the whole history, each token once; presence / frequency over the generated
    active: (c) => c.repetition_penalty !== 1 || c.presence_penalty !== 0 || c.frequency_penalty !== 0,
    apply(x, c, ctx) {
      const out = Float64Array.from(x), r = c.repetition_penalty;
      if (r !== 1) for (const t of new Set(ctx.history)) out[t] = out[t] < 0 ? out[t] * r : out[t] / r;
      const counts = new Map();
      for (const t of ctx.history.slice(ctx.promptLen)) counts.set(t, (counts.get(t) || 0) + 1);
      for (const [t, n] of counts) out[t] -= n * c.frequency_penalty + c.presence_penalty;
      return out;
    },
  },
  dry: {
    active: (c) => c.dry_multiplier > 0 && c.dry_penalty_last_n !== 0,
    apply(x, c, ctx) {
      const lengths = dryRepeatLengths(ctx.history, c.dry_sequence_breakers, c.dry_allowed_length, c.dry_penalty_last_n);
      const cap = c.dry_base > 1.000001 ? Math.trunc(FLOAT_MAX_LOG / Math.log(c.dry_base)) : Infinity;
      const out = Float64Array.from(x);
      for (const [t, n] of lengths) {
        if (t >= x.length) continue;
        // the penalty is a float32 there: one beyond its range is -inf, and the token is cut
        out[t] -= Math.fround(c.dry_multiplier * c.dry_base ** Math.min(n - c.dry_allowed_length, cap));
      }
      return out;
    },
  },
  no_repeat_ngram: {
    active: (c) => c.no_repeat_ngram_size > 0,
    apply: (x, c, ctx) => withCut(x, bannedByNgrams(ctx.history, c.no_repeat_ngram_size)),
  },
  temperature: {
    active: (c) => c.temperature !== 1 && c.dynatemp_range === 0,
    apply: (x, c) => x.map((v) => v / c.temperature),
    controls: { temperature: { label: "Temperature", step: 0.05 } },
  },
  dynatemp: {
    active: (c) => c.dynatemp_range > 0,
    apply(x, c) {
      const t = dynamicTemperature(x, c.temperature, c.dynatemp_range, c.dynatemp_exponent);
      if (t < GREEDY_TEMPERATURE) { const top = maxOf(x); return x.map((v) => (v === top ? 0 : NEG)); }
      return x.map((v) => v / t);
    },
  },
  top_k: {
    active: (c) => c.top_k > 0,
    apply: (x, c) => topK(x, c.top_k),
    controls: { top_k: { label: "Top-k", max: 100, step: 1 } },
  },
  typical_p: { active: (c) => c.typical_p < 1, apply: (x, c) => typicalP(x, c.typical_p) },
  top_p: {
    active: (c) => c.top_p < 1,
    apply: (x, c) => topP(x, c.top_p),
    controls: { top_p: { label: "Top-p", step: 0.01 } },
    boundary: (c) => `the mass reaches p = ${c.top_p.toFixed(2)} here`,
  },
  min_p: {
    active: (c) => c.min_p > 0,
    apply: (x, c) => minP(x, c.min_p),
    controls: { min_p: { label: "Min-p", step: 0.01 } },
  },
  top_a: { active: (c) => c.top_a > 0, apply: (x, c) => topA(x, c.top_a) },
  top_n_sigma: { active: (c) => c.top_n_sigma > 0, apply: (x, c) => topNSigma(x, c.top_n_sigma) },
  xtc: {
    active: (c) => c.xtc_probability > 0 && c.xtc_threshold <= 0.5,
    apply: (x, c, ctx) => (ctx.xtc ? withCut(x, xtcRemoved(x, c.xtc_threshold)) : x),
  },
  epsilon: { active: (c) => c.epsilon_cutoff > 0, apply: (x, c) => epsilon(x, c.epsilon_cutoff) },
  eta: { active: (c) => c.eta_cutoff > 0, apply: (x, c) => eta(x, c.eta_cutoff) },
  mirostat: { active: (c) => c.mirostat > 0, apply: mirostat },
};
