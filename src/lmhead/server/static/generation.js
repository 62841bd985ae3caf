// lmhead explainer — the "Next token" view's generation: Next token (POST /api/step) and Generate (POST
// /api/generate, server-sent events) grow the prompt with the seeded draws of the current settings; the strip of this
// generation, token by token (POST /api/steps, drawn by charts.js).

import * as charts from "./charts.js";
import { predict } from "./candidates.js";
import { chartError } from "./pictures.js";
import { constraintFields, readSettings, seed } from "./settings.js";
import { state } from "./state.js";
import { $, api, el, pct, setStatus, visible, withModel } from "./util.js";

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

export async function nextToken() {
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

export async function generate() {
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



// This generation: the prompt it grew from, and each token with the settings it was drawn with.
function noteGenerated(textBefore, tokenId, text, st) {
  const g = state.gen;
  const sofar = g.prompt === null ? null : g.prompt + g.tokens.map((t) => t.text).join("");
  if (sofar !== textBefore || g.tokens.length >= 256) { g.prompt = textBefore; g.tokens = []; }
  g.tokens.push({ token_id: tokenId, text, settings: st });
}

export function resetGeneration() {
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
    charts.stepsChart($("#steps-chart"), r.steps);
  } catch (e) {
    chartError("#steps-chart", e);
  }
}
