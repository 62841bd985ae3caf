// lmhead explainer — the model selector: the server's models, each loaded on its first use (GET /api/models; every
// request then carries ?model=NAME).

import { predict } from "./candidates.js";
import { resetGeneration } from "./generation.js";
import { clearDraws } from "./pictures.js";
import { state } from "./state.js";
import { $, api, el, setStatus } from "./util.js";

export async function loadModelInfo() {
  const m = await api("/api/model");
  state.model = m;
  $("#model-facts").textContent = `· vocabulary ${m.vocab_size.toLocaleString()} · width ${m.width} · ` +
    `${m.layers} layers · ${m.tied_head ? "tied" : "untied"} head` + (m.softcap ? ` · softcap ${m.softcap}` : "");
}

export async function loadModels() {
  const m = await api("/api/models");
  state.models = m;
  const sel = $("#model-select");
  sel.replaceChildren(...m.models.map((x) => el("option", { value: x.name,
    text: x.name + (x.loaded ? "" : " (loads on first use)") })));
  sel.value = state.modelName || m.default;
}

export async function chooseModel() {
  const sel = $("#model-select");
  const name = sel.value, before = state.modelName;
  state.modelName = name;
  sel.disabled = true;
  document.body.dataset.ready = "0";
  setStatus(`Loading ${name}… (a model loads on its first use; this can take a while)`);
  try {
    await loadModelInfo();
    state.data = null; state.geo = null; state.geoPrompt = null; state.dist = null;
    clearDraws();
    resetGeneration();
    $("#params-out").dataset.loaded = "";
    $("#params-out").replaceChildren();
    await loadModels();
    setStatus("");
    if ($("#prompt").value) { state.step = 0; await predict({ generatedFrom: null }); }
  } catch (e) {
    state.modelName = before;
    await loadModels().catch(() => {});
    sel.value = before || (state.models ? state.models.default : name);
    setStatus(e.message, true);
  } finally {
    sel.disabled = false;
    document.body.dataset.ready = "1";
  }
}
