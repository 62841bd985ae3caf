// lmhead explainer — formatting, building elements, the status line and the server's API, for every view.

import { state } from "./state.js";

export const $ = (sel) => document.querySelector(sel);

export function pct(p) {
  if (p === null || p === undefined || Number.isNaN(p)) return "–";
  const v = p * 100;
  if (v === 0) return "0%";
  if (v >= 99.995 && v < 100) return "99.99%";
  if (v >= 10) return v.toFixed(1) + "%";
  if (v >= 1) return v.toFixed(2) + "%";
  if (v >= 0.01) return v.toFixed(3) + "%";
  return v.toExponential(1) + "%";
}
export const nats = (h) => (h === null || h === undefined ? "–" : h.toFixed(3) + " nats");
export const fix = (x, d = 2) => (x === null || x === undefined || !Number.isFinite(x) ? "−∞" : x.toFixed(d));
const VISIBLE = { " ": "·", "\n": "↵", "\t": "⇥", "\r": "␍" };
export const visible = (s) => Array.from(s || "").map((c) => {
  if (VISIBLE[c]) return VISIBLE[c];
  const code = c.codePointAt(0);
  return code < 32 || code === 127 ? "\\x" + code.toString(16).padStart(2, "0") : c; // as lmhead.explain.visible
}).join("");

export function el(tag, attrs = {}, ...children) {
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

export function setStatus(msg, error = false) {
  const s = $("#status");
  s.textContent = msg || "";
  s.classList.toggle("error", !!error);
}

export function withModel(path) {
  return state.modelName ? `${path}${path.includes("?") ? "&" : "?"}model=${encodeURIComponent(state.modelName)}` : path;
}

// POST body as JSON (GET without one); the answer's JSON, or its bytes with as = "bytes".
export async function api(path, body, as = "json") {
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
