// lmhead explainer — the "Next token" view's pictures, drawn by charts.js: the rank curve of the whole distribution,
// the head's geometry and the draws. Every number comes from the server (/api/distribution, /geometry, /draws),
// computed over the full vocabulary with the full-precision head.

import * as charts from "./charts.js";
import { readSettings, seed } from "./settings.js";
import { state } from "./state.js";
import { $, api, el, setStatus } from "./util.js";

const MAX_DRAWS = 10000, DRAW_WORK = 2 ** 26; // lmhead.explain_charts.MAX_DRAWS / DRAW_WORK

export function chartError(sel, e) {
  $(sel).replaceChildren(el("p", { class: "status error", role: "alert", text: e.message }));
}

export function refreshCharts(prompt) {
  loadDistribution();
  if (prompt !== state.geoPrompt) loadGeometry();
  if (state.draws && state.draws.prompt !== prompt) clearDraws();
}

// --- the rank curve ----------------------------------------------------------------------------------------------

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
    charts.rankChart(fig, d);
    fig.dataset.settings = JSON.stringify(st);
    updateDrawLimit(d.kept_count);
  } catch (e) {
    if (seq === state.distSeq) chartError("#dist-chart", e);
  }
}

export function scheduleDistribution(ms) {
  clearTimeout(state.distTimer);
  state.distTimer = setTimeout(loadDistribution, ms);
}

// --- the head's geometry -----------------------------------------------------------------------------------------

export async function loadGeometry() {
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

export function renderGeometry() {
  if (!state.geo) return;
  const fig = $("#geo-chart");
  charts.geometryChart(fig, state.geo, state.candProbs);
  fig.dataset.top = String(state.geo.candidates.length);
}

// --- the draws ---------------------------------------------------------------------------------------------------

function updateDrawLimit(kept) {
  const most = Math.max(1, Math.min(MAX_DRAWS, Math.floor(DRAW_WORK / Math.max(1, kept))));
  $("#draw-n").max = String(most);
  $("#draw-n-help").textContent = `at most ${most.toLocaleString()} with ${kept.toLocaleString()} tokens kept ` +
    "(every draw reads each kept token)";
}

export async function draw() {
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

export function renderDraws() {
  if (!state.draws) return;
  const n = drawsUpTo();
  $("#draw-upto-out").value = `${n.toLocaleString()} of ${state.draws.n.toLocaleString()}`;
  $("#draw-upto").setAttribute("aria-valuetext", `the first ${n} of ${state.draws.n} draws`);
  charts.drawChart($("#draw-chart"), state.draws, n);
}

export function clearDraws() {
  state.draws = null;
  $("#draw-chart").replaceChildren();
  $("#draw-upto").disabled = true;
  $("#draw-upto-out").value = "–";
}

export function scheduleRedraw() {
  if (!state.draws) return;
  clearTimeout(state.drawTimer);
  state.drawTimer = setTimeout(draw, 150); // the settings changed: the histogram must be of the new distribution
}
