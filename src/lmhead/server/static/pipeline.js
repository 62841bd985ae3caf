// lmhead explainer — the declared steps of the logits pipeline, run in the page over the whole row.
//
// The server declares the steps (GET /api/samplers: lmhead.sampling.steps.describe): their names, stages,
// parameters with defaults and ranges, lmhead's order, the presets and the aliases an order may use. This file holds
// only what a declaration cannot carry: each step's arithmetic, written after its torch implementation in
// lmhead/sampling/steps/ (masks, penalties, temperature, cutoffs, mirostat), in float64 where torch mostly runs
// float32 (the tests compare at a stated tolerance). A step the server declares and this file does not implement
// makes `runChain` report it in `missing`, and the page then shows the server's numbers.
//
// One next-token prediction, as lmhead.explain.predict runs it: the prompt is the history (the penalties, DRY,
// n-grams and bad words read it; presence / frequency count generated tokens, none yet; min_tokens withholds the
// stop tokens and the model's end of sequence, none generated yet), mirostat starts from μ = 2τ (a fresh row),
// and XTC's coin is not thrown: the distribution shown is the one the draw follows, the mixture
// (1 − P)·p(coin off) + P·p(coin on), while the cut marks are those of the coin landing (lmhead.sampling.general).
"use strict";

(function (root) {
  const NEG = -Infinity;
  const GREEDY_TEMPERATURE = 1e-5; // lmhead.sampling.steps.temperature
  const FLOAT_MAX_LOG = 88.7228391; // log(FLT_MAX): llama.cpp's cap of DRY's exponent
  const MIROSTAT_M = 100;

  // --- row helpers ----------------------------------------------------------------------------------------------

  function maxOf(x) {
    let m = NEG;
    for (let i = 0; i < x.length; i++) if (x[i] > m) m = x[i];
    return m;
  }
  function argmaxOf(x) { // the first maximum, as torch.argmax
    let m = NEG, k = 0;
    for (let i = 0; i < x.length; i++) if (x[i] > m) { m = x[i]; k = i; }
    return k;
  }
  function logSoftmax(x) {
    const m = maxOf(x), out = new Float64Array(x.length);
    let s = 0;
    for (let i = 0; i < x.length; i++) if (x[i] > NEG) s += Math.exp(x[i] - m);
    const lse = m + Math.log(s);
    for (let i = 0; i < x.length; i++) out[i] = x[i] - lse;
    return out;
  }
  function softmax(x) {
    const lp = logSoftmax(x);
    for (let i = 0; i < lp.length; i++) lp[i] = Math.exp(lp[i]);
    return lp;
  }
  function entropyOf(logp) { // nats; tokens of probability 0 add nothing (torch's nansum)
    let h = 0;
    for (let i = 0; i < logp.length; i++) if (logp[i] > NEG) h -= Math.exp(logp[i]) * logp[i];
    return h;
  }
  // The k-th largest value (k ≥ 1) by Hoare's selection on a copy: linear on average, where a sort of the whole row
  // would cost far more at a vocabulary of 262,144.
  function kthLargest(x, k) {
    const a = Float64Array.from(x), t = k - 1;
    let lo = 0, hi = a.length - 1;
    while (lo < hi) {
      const pivot = a[(lo + hi) >> 1];
      let i = lo, j = hi;
      while (i <= j) {
        while (a[i] > pivot) i++;
        while (a[j] < pivot) j--;
        if (i <= j) { const v = a[i]; a[i] = a[j]; a[j] = v; i++; j--; }
      }
      if (t <= j) hi = j;
      else if (t >= i) lo = i;
      else break;
    }
    return a[t];
  }
  // The indices of the m largest values and of every value tied with the m-th, largest first.
  function topIndices(x, m) {
    const floor = kthLargest(x, Math.min(m, x.length));
    const idx = [];
    for (let i = 0; i < x.length; i++) if (x[i] >= floor) idx.push(i);
    return idx.sort((a, b) => x[b] - x[a] || a - b);
  }
  function keepTop(x, drop) { // drop[i] at -inf, the row's largest logit (and its ties) always kept
    const top = maxOf(x), out = Float64Array.from(x);
    for (let i = 0; i < x.length; i++) if (drop(i) && x[i] < top) out[i] = NEG;
    return out;
  }
  function withCut(x, cut) {
    const out = Float64Array.from(x);
    for (const i of cut) if (i >= 0 && i < out.length) out[i] = NEG;
    return out;
  }
  const sameSeq = (a, i, b) => { for (let j = 0; j < b.length; j++) if (a[i + j] !== b[j]) return false; return true; };

  // Python's float ** float where mirostat v1's k is computed: the cases where Python raises (the step then keeps
  // every token), a complex result as NaN (also every token).
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

  // --- stage 1: the masks ---------------------------------------------------------------------------------------

  function bannedByBadWords(badWords, history) { // transformers' NoBadWordsLogitsProcessor
    const out = [];
    for (const seq of badWords) {
      const head = seq.slice(0, -1);
      if (!head.length || (history.length >= head.length && sameSeq(history, history.length - head.length, head)))
        out.push(seq[seq.length - 1]);
    }
    return out;
  }

  // --- stage 2: the penalties -----------------------------------------------------------------------------------

  // llama.cpp's DRY: token → the length of the longest suffix of the history (within the last `lastN`, -1 = all;
  // not reaching back past the latest breaker) that also occurs earlier followed by that token; the Z-algorithm over
  // the reversed history, as lmhead.sampling.steps.penalties.dry_repeat_lengths.
  function dryRepeatLengths(history, breakers, allowedLength, lastN) {
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

  function bannedByNgrams(history, size) { // transformers' NoRepeatNGramLogitsProcessor
    if (size <= 0 || history.length + 1 < size) return [];
    const head = size > 1 ? history.slice(history.length - size + 1) : [];
    const out = [];
    for (let i = 0; i + size - 1 < history.length; i++) if (sameSeq(history, i, head)) out.push(history[i + size - 1]);
    return out;
  }

  // --- stage 3: temperature -------------------------------------------------------------------------------------

  function dynamicTemperature(x, t, spread, exponent) { // llama.cpp's llama_sampler_temp_ext_apply
    let n = 0;
    for (let i = 0; i < x.length; i++) if (Number.isFinite(x[i])) n++;
    if (n <= 1) return t;
    const low = Math.max(0, t - spread), high = t + spread;
    return low + (high - low) * Math.pow(entropyOf(logSoftmax(x)) / Math.log(n), exponent);
  }

  // --- stage 4: the cuts ----------------------------------------------------------------------------------------

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

  // transformers' TypicalLogitsWarper: tokens by |−log p − H| ascending, the set ends at the first token where the
  // mass reaches typical_p, and every token scored at most that token's is kept (the best scored always). The order
  // among equal scores does not change the set — the token where the mass crosses has the score of its whole tie
  // group — so the bound is the smallest score whose tokens scored at most it hold typical_p (or the largest score
  // when none does), found by bisection over the sorted scores instead of sorting the tokens.
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

  // XTC's cut once the coin has landed: the tokens with p ≥ threshold, all but the least probable of them (the
  // highest id among ties at that probability stays); none when fewer than two reach it.
  function xtcRemoved(x, threshold) {
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

  function mirostatK(pSorted, vocab, mu) { // llama.cpp v1's k from the Zipf exponent of the top m probabilities
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

  // --- the steps, by their declared names: when each is on (its `active`) and what it does to a row [V] ----------

  const hasBias = (c) => !!c.logit_bias && Object.keys(c.logit_bias).length > 0;
  const STEPS = {
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
    },
    dynatemp: {
      active: (c) => c.dynatemp_range > 0,
      apply(x, c) {
        const t = dynamicTemperature(x, c.temperature, c.dynatemp_range, c.dynatemp_exponent);
        if (t < GREEDY_TEMPERATURE) { const top = maxOf(x); return x.map((v) => (v === top ? 0 : NEG)); }
        return x.map((v) => v / t);
      },
    },
    top_k: { active: (c) => c.top_k > 0, apply: (x, c) => topK(x, c.top_k) },
    typical_p: { active: (c) => c.typical_p < 1, apply: (x, c) => typicalP(x, c.typical_p) },
    top_p: { active: (c) => c.top_p < 1, apply: (x, c) => topP(x, c.top_p) },
    min_p: { active: (c) => c.min_p > 0, apply: (x, c) => minP(x, c.min_p) },
    top_n_sigma: { active: (c) => c.top_n_sigma > 0, apply: (x, c) => topNSigma(x, c.top_n_sigma) },
    xtc: {
      active: (c) => c.xtc_probability > 0 && c.xtc_threshold <= 0.5,
      apply: (x, c, ctx) => (ctx.xtc ? withCut(x, xtcRemoved(x, c.xtc_threshold)) : x),
    },
    epsilon: { active: (c) => c.epsilon_cutoff > 0, apply: (x, c) => epsilon(x, c.epsilon_cutoff) },
    eta: { active: (c) => c.eta_cutoff > 0, apply: (x, c) => eta(x, c.eta_cutoff) },
    mirostat: { active: (c) => c.mirostat > 0, apply: mirostat },
  };

  // --- the settings and the order -------------------------------------------------------------------------------

  // A step's name as lmhead spells it, from its own or an alias (lmhead.sampling.steps.canonical).
  function canonical(decl, name) {
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
  function orderOf(decl, samplers) {
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

  // Every declared parameter: the given value or its declared default (ids and sequences as arrays); the model's end
  // of sequence joins the stop tokens where min_tokens is on (lmhead.sampling.steps.masks.withhold_stops).
  function configOf(decl, settings, eos = []) {
    const c = {};
    for (const [name, p] of Object.entries(decl.params)) {
      const v = settings[name];
      c[name] = v === undefined || (v === null && p.default !== null) ? p.default : v;
    }
    if (c.min_tokens > 0 && eos.length) c.stop_token_ids = Array.from(new Set([...c.stop_token_ids, ...eos]));
    return c;
  }

  const isGreedy = (c) => c.temperature < GREEDY_TEMPERATURE;

  // The declared steps that run for c, in order, the active ones only (lmhead.sampling.steps.chain): the masks first,
  // then the order (mirostat: temperature and mirostat alone, llama.cpp's rule); a greedy row runs stages 1-2. A step
  // this file does not implement counts as on when one of its parameters is off its default.
  function chain(decl, c) {
    const order = c.mirostat ? ["temperature", "mirostat"] : (orderOf(decl, c.samplers) ?? decl.order);
    const byName = Object.fromEntries(decl.steps.map((s) => [s.name, s]));
    const names = [...decl.masks, ...order.flatMap((o) => decl.groups[o] ?? [o])];
    let steps = names.map((n) => byName[n]).filter(Boolean);
    if (isGreedy(c)) steps = steps.filter((s) => s.stage <= 2);
    return steps.filter((s) => (STEPS[s.name] ? STEPS[s.name].active(c)
      : s.params.some((p) => JSON.stringify(c[p]) !== JSON.stringify(decl.params[p].default))));
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

  // One run of the chain (lmhead.sampling.general._run, and the explainer's stages): the row after each step, the
  // row after stages 1-2 (`adjusted`) and after stage 3 (`scaled`), and the processed row (greedy: its argmax).
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

  // The whole pipeline on one row (raw logits [V], float64): what lmhead.explain.predict reports for it.
  //   probs     the distribution the next draw follows (XTC: the mixture of both outcomes of its coin)
  //   adjusted  the logits after stages 1-2 (the candidates' order), scaled: after stage 3
  //   cutBy     the declared name of the first step that cut each token ("greedy" for the argmax's rivals), null if kept
  //   steps     each step that ran: its name and how many tokens it cut (of those still in; XTC's coin landing)
  //   xtc       the tokens XTC removes when its coin lands (empty without XTC); kept, entropy: of `probs`
  //   missing   declared steps that are on and that this file does not implement (the numbers are then not known)
  // ctx: { history: the prompt's ids, promptLen }.
  function runChain(decl, row, settings, ctx, eos = []) {
    const c = configOf(decl, settings, eos);
    const V = row.length;
    checkIds(c, V);
    const steps = chain(decl, c);
    const missing = steps.filter((s) => !STEPS[s.name]).map((s) => s.name);
    if (missing.length) return { missing };
    const base = { history: ctx.history || [], promptLen: ctx.promptLen ?? (ctx.history || []).length, mu: null };
    const hasXtc = steps.some((s) => s.name === "xtc");
    const on = runOnce(steps, row, c, { ...base, xtc: true });
    const probs = softmax(on.processed);
    const keep = new Uint8Array(V);
    for (let i = 0; i < V; i++) keep[i] = on.processed[i] > NEG ? 1 : 0;
    let xtc = [];
    if (hasXtc) {
      const at = steps.findIndex((s) => s.name === "xtc");
      xtc = xtcRemoved(at > 0 ? on.after[at - 1] : row, c.xtc_threshold);
      if (c.xtc_probability < 1) { // the mixture; a token is kept where it has mass (its log is then finite)
        const off = softmax(runOnce(steps, row, c, { ...base, xtc: false }).processed);
        const P = c.xtc_probability;
        for (let i = 0; i < V; i++) { probs[i] = (1 - P) * off[i] + P * probs[i]; keep[i] = probs[i] > 0 ? 1 : 0; }
      }
    }
    const cutBy = new Array(V).fill(null);
    const counts = [];
    let prev = row;
    steps.forEach((s, j) => {
      const x = on.after[j];
      const name = s.name === "logit_bias" ? "bias" : s.name; // the explainer's cut_by says "bias" for this step
      let n = 0;
      for (let i = 0; i < V; i++) if (prev[i] > NEG && !(x[i] > NEG)) { n++; if (cutBy[i] === null) cutBy[i] = name; }
      counts.push({ name: s.name, stage: s.stage, cut: n });
      prev = x;
    });
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

  // The indices of the `n` best tokens by the adjusted logit, ties by the raw logit, then by id (the explainer's
  // order: the kept tokens form a prefix).
  function topOrder(adjusted, row, n) {
    const V = adjusted.length;
    n = Math.min(n, V);
    const floor = kthLargest(adjusted, n);
    const idx = [];
    for (let i = 0; i < V; i++) if (adjusted[i] >= floor) idx.push(i);
    idx.sort((a, b) => (adjusted[b] - adjusted[a]) || (row[b] - row[a]) || (a - b));
    return idx.slice(0, n);
  }

  const api = { STEPS, runChain, chain, configOf, orderOf, canonical, topOrder, isGreedy, softmax, logSoftmax,
    dryRepeatLengths, bannedByNgrams, bannedByBadWords, mirostatK };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else root.lmheadPipeline = api;
})(typeof window !== "undefined" ? window : globalThis);
