// lmhead explainer — the page's entry: it asks the server for the model and the declared steps, builds the controls
// from the declarations and wires every view. Plain JavaScript modules, no libraries, everything served locally:
//
//   util.js, state.js        formatting, elements, the API; what the page holds between events
//   rows.js, steps.js        arithmetic on a row of logits; the table of the declared steps' previews (one entry a step)
//   pipeline.js              the declared chain run over the whole row, in lmhead.sampling's order and rules
//   settings.js              every declared parameter's control, the order, the constraint box, the seed
//   candidates.js            the prompt's chips, the output stage's table, the summary and the steps that ran
//   generation.js            Next token, Generate and the strip of this generation
//   pictures.js, charts.js   the rank curve, the head's geometry and the draws (charts.js draws them as SVG)
//   swap.js, lens.js         swap the head; the logit lens
//   score.js, params.js      the "Score a text" and "Parameters" tabs
//   models.js                the model selector

import { predict, render, scheduleRequery } from "./candidates.js";
import { generate, nextToken, resetGeneration } from "./generation.js";
import { loadLayers } from "./lens.js";
import { chooseModel, loadModelInfo, loadModels } from "./models.js";
import { loadParams } from "./params.js";
import { draw, loadGeometry, renderDraws, scheduleDistribution, scheduleRedraw } from "./pictures.js";
import { score } from "./score.js";
import { buildControls, readSettings, resetControls, settings, settingsKey } from "./settings.js";
import { state } from "./state.js";
import { STEPS } from "./steps.js";
import { $, api, pct, setStatus, withModel } from "./util.js";

// A control moved (input) or was released (change): the page recomputes at once; on release it also asks the server
// for the candidates and the pictures at the new settings. While a control moves, its renders are coalesced to one per
// frame: over a large vocabulary one run of the declared steps can take longer than the events come.
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

function resetSettings() {
  resetControls();
  settingsChanged(true);
}

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

function wireTabs() {
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
}

function wireNextToken() {
  const submit = () => { state.step = 0; resetGeneration(); predict({ generatedFrom: null }); };
  $("#prompt-form").addEventListener("submit", (e) => { e.preventDefault(); submit(); });
  $("#prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); submit(); }
  });
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
  $("#geo-top").addEventListener("input", () => { $("#geo-top-out").value = $("#geo-top").value; });
  $("#geo-top").addEventListener("change", () => { $("#geo-top-out").value = $("#geo-top").value; loadGeometry(); });
  $("#draw").addEventListener("click", draw);
  $("#draw-upto").addEventListener("input", renderDraws);
}

async function init() {
  wireTabs();
  wireNextToken();
  $("#score-form").addEventListener("submit", score);
  $("#model-select").addEventListener("change", chooseModel);
  try {
    await loadModelInfo();
    await loadModels();
    state.decl = await api("/api/samplers");
    buildControls(state.decl, settingsChanged);
  } catch (e) {
    setStatus(`The server did not answer: ${e.message}`, true);
    return;
  }
  document.body.dataset.ready = "1";
}

// For tests and the curious: the state, the settings and the steps' table.
window.lmhead = { state, settings, readSettings, settingsKey, pct, withModel, steps: STEPS };
init();
