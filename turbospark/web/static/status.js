// Live status: the status feed's snapshots as figures, tables and two small plots.
import { bytes, el, onStatus } from "./api.js";

const SVG = "http://www.w3.org/2000/svg";
let last = null;

export function startStatus() {
  onStatus((s) => { last = s; render(s); });
  setInterval(() => { if (last) renderModels(last); }, 1000); // keep-alive countdowns
}

function figures(target, pairs) {
  target.replaceChildren(...pairs.map(([name, value]) =>
    el("div", { "data-name": name }, el("dt", {}, name), el("dd", {}, String(value)))));
}

function render(s) {
  figures(document.getElementById("status-figures"), [
    ["Tokens per second", s.tokens_per_second],
    ["Running sequences", s.running],
    ["Queue depth", s.queue_depth],
    ["KV cache in use", bytes(s.kv_bytes)],
    ["Tokens generated", s.generated_tokens],
    ["Prompt tokens", s.prompt_tokens],
    ["Requests", s.requests],
    ["Refused (queue full)", s.rejections],
  ]);
  figures(document.getElementById("status-cancellations"),
    Object.entries(s.cancellations).map(([phase, n]) => [phase, n]));
  plot(document.getElementById("plot-throughput"), s.history.map((p) => p.tokens), "tok/s");
  plot(document.getElementById("plot-batch"), s.history.map((p) => p.running), "sequences");
  renderModels(s);
  const errors = document.querySelector("#status-errors tbody");
  errors.replaceChildren(...(s.errors.length ? s.errors.map((e) => el("tr", {},
    el("td", {}, String(e.id)), el("td", {}, e.route), el("td", {}, String(e.status)), el("td", {}, e.error || "")))
    : [el("tr", {}, el("td", { colspan: "4" }, "No errors."))]));
  if (s.gaps) document.getElementById("feed-state").textContent = `Status feed: live (fell behind ${s.gaps} times)`;
}

function keepAlive(expires) {
  if (expires === undefined) return "";
  if (expires === null) return "kept";
  const left = Math.max(0, Math.round(expires - Date.now() / 1000));
  return `${Math.floor(left / 60)}:${String(left % 60).padStart(2, "0")} left`;
}

function renderModels(s) {
  const loaded = new Map(s.loaded.map((m) => [m.model, m]));
  const names = [...new Set([...Object.keys(s.models), ...loaded.keys()])].sort();
  const rows = names.map((name) => {
    const m = s.models[name] || {};
    const l = loaded.get(name);
    return el("tr", {},
      el("th", { scope: "row" }, name),
      el("td", {}, l ? "yes" : "no"),
      el("td", {}, l ? String(l.leases) : "–"),
      el("td", {}, l ? keepAlive(l.expires) : "–"),
      el("td", {}, String(m.running || 0)),
      el("td", {}, String(m.queued || 0)),
      el("td", {}, bytes(m.kv_bytes || 0)),
      el("td", {}, String(m.tokens || 0)));
  });
  document.querySelector("#status-models tbody").replaceChildren(...rows);
}

function plot(target, values, unit) {
  const width = 300, height = 100;
  const max = Math.max(1, ...values);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  const now = values.length ? values[values.length - 1] : 0;
  svg.setAttribute("aria-label", `${values.length} seconds; now ${now} ${unit}, peak ${max} ${unit}`);
  const line = document.createElementNS(SVG, "polyline");
  const step = width / Math.max(1, values.length - 1);
  line.setAttribute("points", values.map((v, i) => `${(i * step).toFixed(1)},${(height - 4 - (v / max) * (height - 16)).toFixed(1)}`).join(" "));
  const peak = Math.max(0, ...values);
  const label = el("p", { class: "plot-label" },
    values.length < 2 ? "collecting…" : `now ${now} ${unit} · peak ${peak} · last ${values.length} s`);
  svg.append(line);
  target.replaceChildren(svg, label);
}
