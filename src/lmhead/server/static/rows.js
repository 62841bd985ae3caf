// lmhead explainer — arithmetic on one row of logits [V] (float64), shared by the steps' previews (steps.js) and the
// chain that runs them (pipeline.js). -Infinity is a cut token, as in lmhead.sampling.

export const NEG = -Infinity;

export function maxOf(x) {
  let m = NEG;
  for (let i = 0; i < x.length; i++) if (x[i] > m) m = x[i];
  return m;
}

export function argmaxOf(x) { // the first maximum, as torch.argmax
  let m = NEG, k = 0;
  for (let i = 0; i < x.length; i++) if (x[i] > m) { m = x[i]; k = i; }
  return k;
}

export function logSoftmax(x) {
  const m = maxOf(x), out = new Float64Array(x.length);
  let s = 0;
  for (let i = 0; i < x.length; i++) if (x[i] > NEG) s += Math.exp(x[i] - m);
  const lse = m + Math.log(s);
  for (let i = 0; i < x.length; i++) out[i] = x[i] - lse;
  return out;
}

export function softmax(x) {
  const lp = logSoftmax(x);
  for (let i = 0; i < lp.length; i++) lp[i] = Math.exp(lp[i]);
  return lp;
}

export function entropyOf(logp) { // nats; tokens of probability 0 add nothing (torch's nansum)
  let h = 0;
  for (let i = 0; i < logp.length; i++) if (logp[i] > NEG) h -= Math.exp(logp[i]) * logp[i];
  return h;
}

// The k-th largest value (k ≥ 1) by Hoare's selection on a copy: linear on average, where a sort of the whole row
// would cost far more at a vocabulary of 262,144.
export function kthLargest(x, k) {
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
export function topIndices(x, m) {
  const floor = kthLargest(x, Math.min(m, x.length));
  const idx = [];
  for (let i = 0; i < x.length; i++) if (x[i] >= floor) idx.push(i);
  return idx.sort((a, b) => x[b] - x[a] || a - b);
}

export function keepTop(x, drop) { // drop[i] at -inf, the row's largest logit (and its ties) always kept
  const top = maxOf(x), out = Float64Array.from(x);
  for (let i = 0; i < x.length; i++) if (drop(i) && x[i] < top) out[i] = NEG;
  return out;
}

export function withCut(x, cut) {
  const out = Float64Array.from(x);
  for (const i of cut) if (i >= 0 && i < out.length) out[i] = NEG;
  return out;
}

export const sameSeq = (a, i, b) => {
  for (let j = 0; j < b.length; j++) if (a[i + j] !== b[j]) return false;
  return true;
};
