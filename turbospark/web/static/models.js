// The model manager: the store (/api/tags, /api/show, /api/ps), the catalogue (/api/catalogue,
// /api/pull with progress), load and unload (keep_alive), delete.
import { api, bytes, el, errorText, json, lines, postJSON } from "./api.js";

const message = () => document.getElementById("models-message");

export function startModels() {
  document.getElementById("tab-models").addEventListener("shown", refresh);
  document.getElementById("pull-form").addEventListener("submit", (e) => { e.preventDefault(); pull(); });
  refresh();
}

async function refresh() {
  try {
    const [tags, ps, catalogue] = await Promise.all([json("/api/tags"), json("/api/ps"), json("/api/catalogue")]);
    const running = new Map(ps.models.map((m) => [m.model, m]));
    const rows = await Promise.all(tags.models.map(async (m) => {
      let show = {};
      try { show = await json("/api/show", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ model: m.model }) }); } catch (err) { /* a model without a card */ }
      const info = show.model_info || {};
      const context = Object.entries(info).find(([k]) => k.endsWith(".context_length"));
      const loaded = running.get(m.model);
      return el("tr", { "data-model": m.model },
        el("th", { scope: "row" }, m.model),
        el("td", {}, bytes(m.size)),
        el("td", {}, m.details?.quantization_level || "–"),
        el("td", {}, context ? String(context[1]) : (loaded ? String(loaded.context_length) : "–")),
        el("td", {}, (show.capabilities || []).join(", ")),
        el("td", { class: "state" }, loaded ? "loaded" : "stored"),
        el("td", {}, el("div", { class: "bar" },
          el("button", { type: "button", class: "load", onclick: () => lifecycle(m.model, "5m") }, "Load"),
          el("button", { type: "button", class: "unload", onclick: () => lifecycle(m.model, 0) }, "Unload"),
          el("button", { type: "button", class: "delete", onclick: () => remove(m.model) }, "Delete"))));
    }));
    document.querySelector("#store-models tbody").replaceChildren(...rows);
    const select = document.getElementById("pull-name");
    const have = new Set(tags.models.map((m) => m.model));
    select.replaceChildren(...catalogue.models.map((m) =>
      el("option", { value: m.name }, have.has(m.name) ? `${m.name} (stored)` : m.name)));
    select.disabled = !catalogue.models.length;
  } catch (err) {
    message().textContent = `Could not read the models: ${err.message}`;
  }
}

async function lifecycle(model, keepAlive) {
  message().textContent = `${keepAlive === 0 ? "Unloading" : "Loading"} ${model}…`;
  const response = await postJSON("/api/generate", { model, keep_alive: keepAlive, stream: false });
  const body = await response.json();
  const done = body.done_reason === "unload" ? "unloaded" : "loaded";
  message().textContent = response.ok ? `${model} ${done}.` : `${model}: ${errorText(body, response.status)}`;
  refresh();
}

async function remove(model) {
  if (!confirm(`Delete ${model} from the store?`)) return;
  const response = await api("/api/delete", { method: "DELETE", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ model }) });
  message().textContent = response.ok ? `${model} deleted` : `${model}: ${errorText(await response.json(), response.status)}`;
  refresh();
}

async function pull() {
  const name = document.getElementById("pull-name").value;
  const bar = document.getElementById("pull-progress");
  const status = document.getElementById("pull-status");
  if (!name) return;
  bar.value = 0; bar.max = 1;
  status.textContent = `Pulling ${name}…`;
  const response = await postJSON("/api/pull", { model: name });
  if (!response.ok) { status.textContent = errorText(await response.json(), response.status); return; }
  let steps = 0;
  for await (const line of lines(response)) {
    if (!line.trim()) continue;
    const p = JSON.parse(line);
    if (p.error) { status.textContent = `Failed: ${p.error}`; return; }
    if (p.total) {
      bar.max = p.total; bar.value = p.completed;
      steps++;
      bar.dataset.steps = steps;
      status.textContent = `${p.status}: ${bytes(p.completed)} of ${bytes(p.total)}`;
    } else status.textContent = p.status;
  }
  bar.value = bar.max;
  status.textContent = `Pulled ${name}.`;
  refresh();
}
