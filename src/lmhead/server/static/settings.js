// lmhead explainer — the settings: every declared parameter's control, built from the server's declaration (GET
// /api/samplers), and what a request carries (every parameter off its declared default, the order, the constraint
// box, the seed).
//
// The parameters the steps' table (steps.js) gives a label come first, as sliders, in the declared order of their
// steps; every other step's parameters follow in the "Every other step" panel, one group per step, then the order.

import { STEPS, orderOf } from "./pipeline.js";
import { state } from "./state.js";
import { $, el } from "./util.js";

// --- what the controls hold --------------------------------------------------------------------------------------

// A parameter's text as its declared kind: numbers in their declared range (the single values it also allows), token
// ids "1, 2", token-id sequences "1 2; 3", a bias "id: value, ...". Returns undefined for the default (an empty field
// included), throws an Error naming the parameter and its range otherwise.
export function parseParam(p, text, name) {
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
  orderOf(state.decl, names); // an unknown or repeated name is an Error naming samplers
  return names;
}

// The settings a request carries: every parameter whose control is off its declared default, and the order; `error`
// says what is wrong with the controls that do not hold a value of their declared range.
export function readSettings() {
  const st = {};
  const errors = [];
  for (const input of document.querySelectorAll("input[data-param]")) {
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
  try {
    const order = orderSetting();
    if (order !== undefined) st.samplers = order;
  } catch (e) {
    errors.push(e.message);
  }
  return { st, error: errors.length ? errors.join("; ") : null };
}
export const settings = () => readSettings().st;
const sortedKeys = (o) => Object.fromEntries(Object.keys(o).sort().map((k) => [k, o[k]]));
export const settingsKey = (st) => JSON.stringify(sortedKeys(st));
export const sameSettings = (a, b) => !!a && !!b && settingsKey(a) === settingsKey(b);

// A slider's value in words: the declared words of a single value ("0 = off", "0 = greedy" in its range's text), else
// the number (floats to two places).
function shownValue(p, text) {
  const v = Number(text);
  for (const m of (p.allowed || "").matchAll(/(-?\d+(?:\.\d+)?) = ([^,)]+)/g)) {
    if (Number(m[1]) === v) return m[2] === "off" ? "off" : `${m[1]} (${m[2]})`;
  }
  return p.kind === "float" ? v.toFixed(2) : String(v);
}

export function showSettings() {
  for (const out of document.querySelectorAll("output[data-param]")) {
    const input = document.getElementById(out.htmlFor.value);
    out.value = shownValue(state.decl.params[out.dataset.param], input.value);
  }
}

// --- the controls, from the declaration --------------------------------------------------------------------------

// A parameter the table shows first is a slider over its declared range (its `max` where the range has none); so is a
// float whose declared range is a closed stretch of at most 1 (top-p's kind); any other number a number field with
// the declared bounds; ids, sequences and a bias are text.
function controlFor(name, p, hint) {
  const id = `p-${name}`;
  const help = el("small", { id: `${id}-help`, text: `${p.allowed}. ${p.doc}` });
  const attrs = { id, "data-param": name, "aria-describedby": help.id };
  let input, output = null;
  const high = hint && hint.max !== undefined ? hint.max : p.high;
  const bounded = (p.kind === "float" || p.kind === "int") && p.low !== null && high !== null;
  const slider = bounded && (!!hint || (p.kind === "float" && high - p.low <= 1 && !p.high_open));
  if (slider) {
    const step = hint && hint.step ? hint.step : p.kind === "int" ? 1 : 0.01;
    input = el("input", { ...attrs, type: "range", min: String(p.low_open ? p.low + step : p.low), max: String(high),
      step: String(step), value: String(p.default) });
    output = el("output", { id: `${id}-out`, "data-param": name, text: shownValue(p, p.default) });
    output.htmlFor.value = id;
  } else if (p.kind === "float" || p.kind === "int") {
    input = el("input", { ...attrs, type: "number", step: p.kind === "int" ? "1" : "any", inputMode: "decimal",
      placeholder: String(p.default) });
    if (p.low !== null && !p.also.some((v) => v < p.low)) input.min = String(p.low);
    if (p.high !== null) input.max = String(p.high);
  } else {
    const example = { ids: "e.g. 12, 40", sequences: "e.g. 12 7; 40", bias: "e.g. 12: 2.5, 40: -3" }[p.kind] || "";
    input = el("input", { ...attrs, type: "text", spellcheck: false, placeholder: example });
  }
  const label = el("label", { htmlFor: id, text: hint && hint.label ? hint.label : name });
  return el("div", { class: "control" + (slider ? "" : " wide") }, label, input, output, help);
}

// The order's own group: a preset or the names typed.
function orderControls(decl, onChange) {
  const presets = el("select", { id: "samplers-preset", "aria-describedby": "samplers-help" },
    ...Object.keys(decl.presets).map((k) => el("option", { value: k, text: k === "lmhead" ? "lmhead (the default)" : k })),
    el("option", { value: "custom", text: "your own order" }));
  const names = el("input", { id: "samplers", type: "text", spellcheck: false, "aria-describedby": "samplers-help",
    value: decl.order.join(";") });
  const p = decl.params.samplers;
  presets.addEventListener("change", () => {
    if (presets.value !== "custom") names.value = (decl.presets[presets.value] || decl.order).join(";");
    onChange(true);
  });
  names.addEventListener("input", () => { presets.value = "custom"; onChange(false); });
  names.addEventListener("change", () => onChange(true));
  return el("fieldset", { class: "step order", "data-step": "samplers" },
    el("legend", {}, el("code", { text: "samplers" }), " ", el("small", { text: "the order of stages 2-4" })),
    el("div", { class: "control wide" }, el("label", { htmlFor: "samplers-preset", text: "Order" }), presets),
    el("div", { class: "control wide" }, el("label", { htmlFor: "samplers", text: "samplers" }), names,
      el("small", { id: "samplers-help", text: `${p ? p.allowed + ". " + p.doc : ""} Names are separated by ; — ` +
        `a step left out does not run; mirostat replaces the cuts (llama.cpp's rule). Steps: ${decl.orderable.join(", ")}.` })));
}

const STAGES = { 1: "Masks", 2: "Penalties", 3: "Temperature", 4: "Cuts" };

// lmhead's order, its steps grouped by stage: "masks (logit_bias, …) → penalties (…) → temperature → cuts (…) → softmax".
function orderInWords(decl) {
  const stageOf = Object.fromEntries(decl.steps.map((s) => [s.name, s.stage]));
  const runs = [];
  for (const name of [...decl.masks, ...decl.order]) {
    const stage = stageOf[name], last = runs[runs.length - 1];
    if (last && last.stage === stage) last.names.push(name); else runs.push({ stage, names: [name] });
  }
  const words = runs.map((r) => {
    const stage = (STAGES[r.stage] || "").toLowerCase();
    return r.names.length === 1 && r.names[0] === stage ? stage : `${stage} (${r.names.join(", ")})`;
  });
  return [...words, "softmax"].join(" → ");
}

// Every declared parameter's control (each once, under the first step that declares it), and the pipeline's order in
// words. onChange(released): a control moved (false) or was released (true).
export function buildControls(decl, onChange) {
  const first = [], groups = [], shown = new Set(["samplers", "seed"]);
  for (const step of decl.steps) {
    const hints = (STEPS[step.name] && STEPS[step.name].controls) || {};
    const names = step.params.filter((n) => !shown.has(n) && n in decl.params);
    names.forEach((n) => shown.add(n));
    for (const n of names.filter((n) => hints[n])) first.push(controlFor(n, decl.params[n], hints[n]));
    const rest = names.filter((n) => !hints[n]);
    if (!rest.length) continue;
    const g = el("fieldset", { class: "step", "data-step": step.name, title: step.explain || "" });
    g.append(el("legend", {}, el("code", { text: step.name }), " ",
      el("small", { text: `${STAGES[step.stage] || ""} · ${step.origin}` })));
    for (const n of rest) g.append(controlFor(n, decl.params[n], null));
    groups.push(g);
  }
  $("#main-controls").replaceChildren(...first);
  $("#step-controls").replaceChildren(...groups, orderControls(decl, onChange));
  $("#pipeline-order").textContent = orderInWords(decl);
  $("#other-steps").textContent = groups.map((g) => g.dataset.step).join(", ");
  for (const input of document.querySelectorAll("input[data-param]")) {
    input.addEventListener("input", () => onChange(false));
    input.addEventListener("change", () => onChange(true));
  }
  showSettings();
}

// Every control back to its declared default, the order to lmhead's.
export function resetControls() {
  for (const input of document.querySelectorAll("input[data-param]")) {
    const p = state.decl.params[input.dataset.param];
    input.value = input.type === "range" ? String(p.default) : "";
    input.removeAttribute("aria-invalid");
  }
  if ($("#samplers-preset")) { $("#samplers-preset").value = "lmhead"; $("#samplers").value = state.decl.order.join(";"); }
}

// --- the constraint box and the seed -----------------------------------------------------------------------------

// The constraint box (structured output): the server applies its mask first; the page shows the server's numbers for
// a constrained prompt (its mask is not known here) and asks again when a setting changes.
export function constraintAsked() {
  const kind = $("#constraint-kind").value, text = $("#constraint-text").value.trim();
  return kind === "none" || !text ? null : { kind, text };
}
export const constraintKey = (c) => (c ? `${c.kind}\u0000${c.text}` : "");

// The constrained answer starts where the box was first asked for this prompt: the server consumes the text after that
// point as the answer so far, so Next token and Generate continue one answer, not start a new one at every click. A
// new box or an edited prompt (one that no longer extends it) starts the answer again.
export function constraintFields(prompt) {
  const asked = constraintAsked();
  if (!asked) { state.answer = null; return {}; }
  const key = constraintKey(asked);
  let answer = state.answer;
  if (!answer || answer.key !== key || !prompt.startsWith(answer.prompt)) {
    answer = { key, prompt };
    // Only the prompt in the box starts an answer: a requery of the shown data for an older prompt (the box edited
    // since, its input event already seen) must not move the start back to that older prompt.
    if (prompt === $("#prompt").value) state.answer = answer;
  }
  // code points, as the server counts characters
  return { constraint: asked, answer_from: Array.from(answer.prompt).length };
}

export function seed() {
  const v = $("#seed").value.trim();
  return v === "" ? null : Math.max(0, parseInt(v, 10));
}
