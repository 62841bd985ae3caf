// lmhead explainer — what the page holds between events, one object shared by its views.

export const state = {
  model: null, // GET /api/model
  decl: null, // GET /api/samplers: the declared steps, their parameters, the order, the presets
  data: null, // the last /api/predict answer, with what the table needs (loadData)
  dataSettings: null, // the settings it was computed with
  dataConstraint: "", // the constraint box it was computed with ("" = none)
  answer: null, // where the constrained answer starts: { key (the box), prompt (the text before the answer) }
  prompt: "",
  generatedFrom: null, // index of the first generated token among the chips
  step: 0, // tokens generated since the prompt was typed: the seeded draws are keyed on (seed + step)
  requery: null, // debounce timer
  seq: 0, // predict request counter (stale answers are dropped)
  busy: false,
  modelName: null, // the model chosen in the selector (?model=NAME on every request); null = the server's default
  models: null, // GET /api/models
  row: null, // all V logits of the shown prompt: { key, x } (POST /api/logits)
  rowPending: null,
  geo: null, // the last /api/geometry answer, and the prompt it was for
  geoPrompt: null,
  candProbs: null, // token id → { p, kept } under the current settings (the head picture sizes its dots by them)
  dist: null, // the last /api/distribution answer
  distSeq: 0,
  distTimer: null,
  draws: null, // the last /api/draws answer
  drawTimer: null,
  gen: { prompt: null, tokens: [] }, // this generation: the prompt it started from, each token with its settings
  settingsError: null,
  frame: 0,
};
