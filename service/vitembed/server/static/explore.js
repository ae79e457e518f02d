// The vitembed explorer: plain ES module, no dependencies, only same-origin /v1 calls.
// State flows one way: controls -> requests -> drawings. Every request carries a generation number so an
// answer to an outdated question is dropped instead of drawn.

import { bitmapOf, displayWidth, drawCost, drawPca, heat, paintView, patchHeadMap, putGridImage } from "./explore_draw.js";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "vitembed-api-key";
const POLICY_HELP = {
  crop: "crop: the checkpoint's own processor (resize the short side, centre-crop): the edges are dropped.",
  squash: "squash: resized to exactly the size: everything kept, the aspect ratio distorted.",
  pad: "pad: fitted inside the size and letterboxed with the mean colour: aspect kept; letterbox patches are tokens spent on nothing.",
  dynamic: "dynamic: aspect kept within a token budget (the size's patch count), sides snapped to whole patches: the grid differs per image.",
};

const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  models: [],
  indexes: [],
  image: null, // Blob of the query image
  features: null, // last /v1/patch-features answer
  neighbours: [],
  chosen: null, // id of the neighbour for "where they match"
  patch: null, // [row, col] of the query patch
  cursor: [0, 0],
  generation: 0,
  thumbUrls: [],
};

// ------------------------------------------------------------------------------------------- the API
class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (state.key) headers.set("Authorization", `Bearer ${state.key}`);
  const response = await fetch(path, { ...options, headers, credentials: "omit" });
  if (!response.ok) {
    let code = "http_error";
    let message = response.statusText || "request failed";
    try {
      const body = await response.json();
      code = body.error.code;
      message = body.error.message;
    } catch (_) {
      /* not the service's error shape: keep the status text */
    }
    throw new ApiError(response.status, code, message);
  }
  return response;
}

const apiJson = async (path, options) => (await api(path, options)).json();

function showError(error) {
  if (error instanceof ApiError) {
    $("error").textContent = `${error.status} ${error.code}: ${error.message}`;
    if (error.status === 401) askForKey();
  } else {
    $("error").textContent = `error: ${error.message}`;
  }
}

function clearError() {
  $("error").textContent = "";
}

function setStatus(text) {
  $("status").textContent = text;
}

function askForKey() {
  $("key-field").hidden = false;
  $("api-key").focus();
}

// ------------------------------------------------------------------------------------------- options
function currentModel() {
  return state.models.find((m) => m.id === $("model").value) || state.models[0];
}

function fillModels(models) {
  state.models = models;
  const select = $("model");
  select.replaceChildren(
    ...models.map((m) => new Option(`${m.id} (${m.info.family}, ${m.info.dim}-wide, ${m.info.patch_size[0]} px patches)`, m.id)),
  );
  const preferred = models.find((m) => m.default) || models[0];
  if (preferred) select.value = preferred.id;
  fillModelOptions();
}

function fillModelOptions() {
  const model = currentModel();
  if (!model) return;
  const info = model.info;
  const defaults = info.defaults || {};
  const blocks = [];
  for (let i = 0; i < info.depth; i += 1) blocks.push(new Option(`block ${i}${i === info.depth - 1 ? " (last)" : ""}`, String(i)));
  $("layer").replaceChildren(...blocks);
  const layers = defaults.layers;
  $("layer").value = String(layers && layers.length ? layers[layers.length - 1] : info.depth - 1);
  $("policy").value = defaults.policy || "crop";
  const [ph, pw] = info.patch_size;
  $("size-h").step = String(ph);
  $("size-w").step = String(pw);
  $("size-h").placeholder = String(info.processing_grid[0] * ph);
  $("size-w").placeholder = String(info.processing_grid[1] * pw);
  $("policy-help").textContent = POLICY_HELP[$("policy").value];
  fillHeads();
}

function fillIndexes(indexes) {
  state.indexes = indexes;
  const select = $("index");
  if (!indexes.length) {
    select.replaceChildren(new Option("none served", ""));
    select.disabled = true;
    $("k").disabled = true;
    $("similar-caption").textContent = "No index is served (start the server with --index NAME=DB_PATH:TABLE).";
    return;
  }
  select.disabled = false;
  $("k").disabled = false;
  select.replaceChildren(...indexes.map((i) => new Option(`${i.name} (${i.rows} items, ${i.model})`, i.name)));
  $("similar-caption").textContent = "Load an image to search.";
}

function featureOptions(form) {
  form.append("model", $("model").value);
  form.append("layer", $("layer").value);
  form.append("policy", $("policy").value);
  const h = $("size-h").value.trim();
  const w = $("size-w").value.trim();
  if (h || w) form.append("size", `${h || w},${w || h}`);
}

const drawView = () => paintView(state.features, state.viewBitmap, state.cursor, state.patch);

// ------------------------------------------------------------------------------------------- requests
async function analyse() {
  if (!state.image) return;
  const generation = ++state.generation;
  clearError();
  setStatus("Computing the patch features…");
  const form = new FormData();
  form.append("image", state.image, "image");
  featureOptions(form);
  if ($("background").checked) form.append("background_threshold", $("threshold").value);
  let features;
  try {
    features = await apiJson("/v1/patch-features", { method: "POST", body: form });
  } catch (error) {
    if (generation === state.generation) {
      showError(error);
      setStatus("");
    }
    return;
  }
  if (generation !== state.generation) return;
  state.features = features;
  state.viewBitmap = await bitmapOf(features.view);
  if (generation !== state.generation) return;
  const [rows, cols] = features.grid;
  state.cursor = [Math.min(state.cursor[0], rows - 1), Math.min(state.cursor[1], cols - 1)];
  if (state.patch && (state.patch[0] >= rows || state.patch[1] >= cols)) state.patch = null;
  drawView();
  drawPca(features);
  drawCost(features);
  document.body.dataset.features = String(generation);
  setStatus(`Patch features of block ${features.layer} ready.`);
  if (state.patch && state.chosen) await match();
}

async function search() {
  if (!state.image || !state.indexes.length) return;
  const form = new FormData();
  form.append("image", state.image, "image");
  form.append("index", $("index").value);
  form.append("k", $("k").value || "6");
  let answer;
  try {
    answer = await apiJson("/v1/search", { method: "POST", body: form });
  } catch (error) {
    showError(error);
    return;
  }
  state.neighbours = answer.data[0].results;
  const p = answer.provenance;
  $("similar-caption").textContent = `${state.neighbours.length} nearest items of index ${answer.index} by ${p.metric} similarity of ${p.pooling} features of ${p.layers ? `block ${p.layers.join(", ")}` : "the last block"} (policy ${p.policy}, the index's own options).`;
  if (!state.neighbours.some((n) => n.id === state.chosen)) state.chosen = state.neighbours.length ? state.neighbours[0].id : null;
  await drawNeighbours(answer.index);
  document.body.dataset.neighbours = String(state.neighbours.length);
  if (state.patch && state.chosen) await match();
}

async function drawNeighbours(index) {
  state.thumbUrls.forEach((url) => URL.revokeObjectURL(url));
  state.thumbUrls = [];
  const list = $("neighbours");
  const items = state.neighbours.map((n, position) => {
    const li = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.className = "neighbour";
    button.dataset.id = n.id;
    button.setAttribute("aria-pressed", String(n.id === state.chosen));
    const img = document.createElement("img");
    img.alt = `catalog item ${n.id}`;
    img.width = 96;
    img.height = 96;
    const label = document.createElement("span");
    label.textContent = `${position + 1}. ${n.id} — ${n.score.toFixed(4)}`;
    button.append(img, label);
    button.addEventListener("click", () => chooseNeighbour(n.id));
    li.append(button);
    // an <img> cannot send the bearer token: fetch with it, show a blob URL
    api(`/v1/indexes/${encodeURIComponent(index)}/thumbnail?id=${encodeURIComponent(n.id)}&max_side=160`)
      .then((response) => response.blob())
      .then((blob) => {
        const url = URL.createObjectURL(blob);
        state.thumbUrls.push(url);
        img.src = url;
      })
      .catch((error) => {
        img.alt = `no thumbnail for ${n.id}: ${error.message}`;
      });
    return li;
  });
  list.replaceChildren(...items);
}

async function chooseNeighbour(id) {
  state.chosen = id;
  for (const button of document.querySelectorAll(".neighbour")) button.setAttribute("aria-pressed", String(button.dataset.id === id));
  if (state.patch) await match();
  else $("match-caption").textContent = `Neighbour ${id} chosen: now pick a patch of the query image.`;
}

async function match() {
  if (!state.image || !state.patch || !state.chosen) return;
  const generation = state.generation;
  const form = new FormData();
  form.append("image", state.image, "image");
  featureOptions(form);
  form.append("index", $("index").value);
  form.append("id", state.chosen);
  form.append("row", String(state.patch[0]));
  form.append("col", String(state.patch[1]));
  setStatus("Comparing patches…");
  let answer;
  try {
    answer = await apiJson("/v1/patch-similarity", { method: "POST", body: form });
  } catch (error) {
    showError(error);
    setStatus("");
    return;
  }
  if (generation !== state.generation) return;
  const bitmap = await bitmapOf(answer.view);
  const [height, width] = answer.size;
  const view = $("match-view");
  view.width = width;
  view.height = height;
  view.getContext("2d").drawImage(bitmap, 0, 0);
  const shown = displayWidth(width);
  for (const canvas of [view, $("match-heat")]) {
    canvas.style.width = `${shown}px`;
    canvas.style.height = `${(shown * height) / width}px`;
  }
  const values = answer.similarity.flat();
  const low = Math.min(...values);
  const high = Math.max(...values);
  const span = high - low || 1;
  const heatCanvas = $("match-heat");
  putGridImage(heatCanvas, answer.grid[0], answer.grid[1], (r, c) => heat((answer.similarity[r][c] - low) / span));
  heatCanvas.dataset.best = `${answer.best.row},${answer.best.col}`;
  heatCanvas.dataset.patch = `${answer.patch[0]},${answer.patch[1]}`;
  heatCanvas.dataset.id = answer.id;
  $("match-caption").textContent = `Query patch (row ${answer.patch[0]}, column ${answer.patch[1]}) against ${answer.id}: cosine from ${low.toFixed(3)} (black) to ${high.toFixed(3)} (yellow); best at row ${answer.best.row}, column ${answer.best.col}.`;
  setStatus("Patches compared.");
}

async function classify() {
  const container = $("heads");
  const heads = Object.entries(currentModel()?.info.heads || {});
  if (!heads.length || !state.image) return;
  for (const [name, card] of heads) {
    const box = container.querySelector(`[data-head="${CSS.escape(name)}"] .result`);
    const form = new FormData();
    form.append("image", state.image, "image");
    form.append("head", name);
    form.append("k", "5");
    try {
      const answer = await apiJson("/v1/classify", { method: "POST", body: form });
      const item = answer.data[0];
      if (item.labels) {
        const list = document.createElement("ol");
        list.replaceChildren(
          ...item.labels.map((l) => {
            const li = document.createElement("li");
            const meter = document.createElement("meter");
            meter.min = 0;
            meter.max = 1;
            meter.value = l.probability;
            meter.setAttribute("aria-label", `probability of ${l.label}`);
            li.append(`${l.label}: ${(100 * l.probability).toFixed(1)}% `, meter);
            return li;
          }),
        );
        box.replaceChildren(list);
      } else {
        box.replaceChildren(patchHeadMap(item.grid, answer.classes, name));
      }
    } catch (error) {
      box.textContent = error instanceof ApiError ? `${error.status} ${error.code}: ${error.message}` : error.message;
    }
  }
}

function fillHeads() {
  const heads = Object.entries(currentModel()?.info.heads || {});
  const container = $("heads");
  if (!heads.length) {
    container.innerHTML = '<p class="help">No heads are served for this model.</p>';
    return;
  }
  container.replaceChildren(
    ...heads.map(([name, card]) => {
      const section = document.createElement("div");
      section.className = "head";
      section.dataset.head = name;
      const title = document.createElement("h3");
      title.textContent = `${name} (${card.kind}, ${card.classes.length} classes; images prepared as it was trained: ${card.policy})`;
      const result = document.createElement("div");
      result.className = "result";
      result.textContent = "Load an image.";
      section.append(title, result);
      return section;
    }),
  );
}

// ------------------------------------------------------------------------------------------- events
// a new image: nothing drawn for the previous one stays on screen, even when the new one is refused
function resetPictures() {
  state.features = null;
  state.viewBitmap = null;
  state.neighbours = [];
  for (const id of ["view", "pca", "match-view", "match-heat"]) {
    const canvas = $(id);
    canvas.width = 1;
    canvas.height = 1;
    canvas.removeAttribute("style");
    for (const key of Object.keys(canvas.dataset)) delete canvas.dataset[key];
  }
  $("view-caption").textContent = "No image yet.";
  $("pca-caption").textContent = "No image yet.";
  $("match-caption").textContent = "Choose a neighbour and a patch.";
  $("cost").hidden = true;
  state.thumbUrls.forEach((url) => URL.revokeObjectURL(url));
  state.thumbUrls = [];
  $("neighbours").replaceChildren();
  if (state.indexes.length) $("similar-caption").textContent = "Load an image to search.";
  document.body.dataset.neighbours = "0";
  fillHeads();
}

async function useImage(blob) {
  if (!blob) return;
  if (blob !== state.image) resetPictures();
  state.image = blob;
  state.patch = null;
  await analyse();
  if (!state.features || $("error").textContent) return;
  await Promise.all([search(), classify()]);
}

function patchAt(event) {
  const f = state.features;
  if (!f) return null;
  const canvas = $("view");
  const rect = canvas.getBoundingClientRect();
  const x = ((event.clientX - rect.left) / rect.width) * f.size[1];
  const y = ((event.clientY - rect.top) / rect.height) * f.size[0];
  const row = Math.min(f.grid[0] - 1, Math.max(0, Math.floor(y / f.patch_size[0])));
  const col = Math.min(f.grid[1] - 1, Math.max(0, Math.floor(x / f.patch_size[1])));
  return [row, col];
}

async function pickPatch(patch) {
  state.patch = patch;
  state.cursor = patch;
  drawView();
  $("view-caption").dataset.patch = patch.join(",");
  if (state.chosen) await match();
  else $("match-caption").textContent = state.indexes.length ? "Choose a neighbour." : "No index is served.";
}

async function loadServer() {
  clearError();
  try {
    const models = await apiJson("/v1/models");
    fillModels(models.data);
    const indexes = await apiJson("/v1/indexes");
    fillIndexes(indexes.data);
    setStatus(`Serving ${state.models.map((m) => m.id).join(", ")}. Load an image.`);
    document.body.dataset.ready = "true";
  } catch (error) {
    showError(error);
  }
}

function wire() {
  $("api-key").value = state.key;
  $("use-key").addEventListener("click", () => {
    state.key = $("api-key").value.trim();
    sessionStorage.setItem(KEY_STORE, state.key);
    loadServer();
  });
  $("api-key").addEventListener("keydown", (event) => {
    if (event.key === "Enter") {
      event.preventDefault();
      $("use-key").click();
    }
  });
  $("options").addEventListener("submit", (event) => event.preventDefault());
  $("file").addEventListener("change", () => useImage($("file").files[0]));
  const drop = $("drop");
  drop.addEventListener("dragover", (event) => {
    event.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    const file = [...event.dataTransfer.files][0];
    if (file) useImage(file);
  });
  document.addEventListener("paste", (event) => {
    const item = [...(event.clipboardData?.items || [])].find((i) => i.kind === "file");
    if (item) useImage(item.getAsFile());
  });
  $("model").addEventListener("change", () => {
    fillModelOptions();
    useImage(state.image);
  });
  for (const id of ["layer", "policy", "background"]) $(id).addEventListener("change", analyse);
  $("policy").addEventListener("change", () => ($("policy-help").textContent = POLICY_HELP[$("policy").value]));
  $("threshold").addEventListener("input", () => ($("threshold-out").textContent = Number($("threshold").value).toFixed(2)));
  $("threshold").addEventListener("change", () => $("background").checked && analyse());
  $("apply-size").addEventListener("click", analyse);
  for (const id of ["size-h", "size-w"]) {
    $(id).addEventListener("keydown", (event) => {
      if (event.key === "Enter") {
        event.preventDefault();
        analyse();
      }
    });
  }
  $("index").addEventListener("change", search);
  $("k").addEventListener("change", search);
  const view = $("view");
  view.addEventListener("click", (event) => {
    const patch = patchAt(event);
    if (patch) pickPatch(patch);
  });
  view.addEventListener("keydown", (event) => {
    const f = state.features;
    if (!f) return;
    const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
    if (moves[event.key]) {
      event.preventDefault();
      const [dr, dc] = moves[event.key];
      state.cursor = [
        Math.min(f.grid[0] - 1, Math.max(0, state.cursor[0] + dr)),
        Math.min(f.grid[1] - 1, Math.max(0, state.cursor[1] + dc)),
      ];
      drawView();
    } else if (event.key === "Enter" || event.key === " ") {
      event.preventDefault();
      pickPatch([...state.cursor]);
    }
  });
}

wire();
loadServer();
