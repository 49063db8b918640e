// The model manager: the store (/api/tags, /api/show, /api/ps), the catalogue (/api/catalogue,
// /api/pull with progress), load and unload (keep_alive), delete, and import: a GGUF file from
// this computer (uploaded as Ollama's client does, /api/blobs then /api/create with files) or a
// model from Ollama's store on the server's machine (/api/ollama/models, /api/create from ollama:).
// Beside them, the MCP servers the server runs and their tools (/v1/mcp/tools).
import { api, bytes, el, errorText, json, lines, postJSON } from "./api.js";

const message = () => document.getElementById("models-message");

export function startModels() {
  document.getElementById("tab-models").addEventListener("shown", refresh);
  document.getElementById("pull-form").addEventListener("submit", (e) => { e.preventDefault(); pull(); });
  document.getElementById("import-file-form").addEventListener("submit", (e) => { e.preventDefault(); importFile(); });
  document.getElementById("import-ollama-form").addEventListener("submit", (e) => { e.preventDefault(); importOllama(); });
  document.getElementById("import-file").addEventListener("change", (e) => {
    const file = e.target.files[0], name = document.getElementById("import-file-name");
    if (file && !name.value) name.value = file.name.replace(/\.gguf$/i, "").toLowerCase().replace(/[^a-z0-9._-]+/g, "-");
  });
  refresh();
}

async function refreshServers() {
  const servers = (await json("/v1/mcp/tools")).data;
  document.getElementById("mcp-none").hidden = servers.length > 0;
  document.querySelector("#mcp-servers tbody").replaceChildren(...servers.map((s) => el("tr", { "data-server": s.name },
    el("th", { scope: "row" }, s.name), el("td", {}, s.transport),
    el("td", { class: "state", title: s.error || "" }, s.state + (s.error ? `: ${s.error}` : "")),
    el("td", {}, ...s.tools.map((t) => el("span", { class: "tool", title: t.description }, t.name, " "))))));
}

async function refresh() {
  refreshServers().catch(() => {});
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
    const local = await json("/api/ollama/models");
    const offered = document.getElementById("import-ollama");
    offered.replaceChildren(...local.models.map((m) => el("option", { value: m.name, "data-name": m.store_name, ...(m.problem ? { disabled: "" } : {}) },
      `${m.name.slice(7)} (${bytes(m.size)}${m.problem ? `: ${m.problem}` : ""})`)));
    if (!local.models.length) offered.replaceChildren(el("option", { value: "", disabled: "" }, "none found"));
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
  if (!name) return;
  const report = progress("pull");
  report.say(`Pulling ${name}…`);
  if (await report.follow(await postJSON("/api/pull", { model: name }))) report.say(`Pulled ${name}.`);
  refresh();
}

// A progress bar and its status line, following an NDJSON progress stream to its end; true when
// it ended with success.
function progress(prefix) {
  const bar = document.getElementById(`${prefix}-progress`);
  const status = document.getElementById(`${prefix}-status`);
  bar.value = 0; bar.max = 1;
  return {
    say(text) { status.textContent = text; },
    async follow(response) {
      if (!response.ok) { status.textContent = errorText(await response.json(), response.status); return false; }
      let steps = 0;
      for await (const line of lines(response)) {
        if (!line.trim()) continue;
        const p = JSON.parse(line);
        if (p.error) { status.textContent = `Failed: ${p.error}`; return false; }
        if (p.total) {
          bar.max = p.total; bar.value = p.completed;
          bar.dataset.steps = ++steps;
          status.textContent = `${p.status}: ${bytes(p.completed)} of ${bytes(p.total)}`;
        } else status.textContent = p.status;
      }
      bar.value = bar.max;
      return true;
    },
  };
}

async function importFile() {
  const file = document.getElementById("import-file").files[0];
  const name = document.getElementById("import-file-name").value.trim();
  const report = progress("import");
  if (!file || !name) { report.say("Choose a GGUF file and a name."); return; }
  if (!crypto.subtle) { report.say("Hashing the file needs a secure page (localhost or https)."); return; }
  report.say(`Reading ${file.name}…`);
  let hash;
  try {
    hash = await crypto.subtle.digest("SHA-256", await file.arrayBuffer());
  } catch (err) {  // a file larger than the tab may hold
    report.say(`Could not read ${file.name} (${bytes(file.size)}): ${err.message}; import it with the command line.`);
    return;
  }
  const digest = "sha256:" + [...new Uint8Array(hash)].map((b) => b.toString(16).padStart(2, "0")).join("");
  if ((await api(`/api/blobs/${digest}`, { method: "HEAD" })).status !== 200) {
    report.say(`Uploading ${file.name} (${bytes(file.size)})…`);
    const sent = await api(`/api/blobs/${digest}`, { method: "POST", body: file });
    if (sent.status !== 201) { report.say(errorText(await sent.json(), sent.status)); return; }
  }
  const made = await report.follow(await postJSON("/api/create", { model: name, files: { [file.name]: digest } }));
  if (made) report.say(`Imported ${name}.`);
  refresh();
}

async function importOllama() {
  const chosen = document.getElementById("import-ollama").selectedOptions[0];
  if (!chosen || !chosen.value) return;
  const source = chosen.value, name = chosen.dataset.name;
  const report = progress("import");
  report.say(`Importing ${source}…`);
  if (await report.follow(await postJSON("/api/create", { model: name, from: source }))) report.say(`Imported ${name}.`);
  refresh();
}
