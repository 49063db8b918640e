// Playground: conversations side by side, each streaming from /v1/chat/completions; with MCP servers
// ticked in its settings, from /v1/responses, whose mcp tools the server runs (each call shown).
import { el, errorText, events, json, onStatus, postJSON } from "./api.js";
import { speak } from "./mic.js";

let chatModels = [];
let mcpServers = [];
let count = 0;
const conversations = [];

export async function startPlayground() {
  document.getElementById("add-conversation").addEventListener("click", () => addConversation(true));
  document.getElementById("ask-all").addEventListener("click", () => conversations.forEach((c) => c.send()));
  const counter = document.getElementById("cancel-counter");
  onStatus((s) => {
    const c = s.cancellations;
    const total = Object.values(c).reduce((a, b) => a + b, 0);
    counter.dataset.total = total;
    counter.textContent = `Cancellations (server): ${total} — queued ${c.queued}, prefill ${c.prefill}, decode ${c.decode}`;
  });
  try {
    const list = await json("/v1/models");
    chatModels = list.data.filter((m) => m.capabilities.includes("completion")).map((m) => m.id);
  } catch (err) {
    chatModels = [];
  }
  try {
    mcpServers = (await json("/v1/mcp/tools")).data;
  } catch (err) {
    mcpServers = [];
  }
  addConversation(false);
}

function addConversation(focus) {
  const node = document.getElementById("conversation-template").content.firstElementChild.cloneNode(true);
  const n = ++count;
  node.querySelector(".conv-title").textContent = `Conversation ${n}`;
  node.dataset.conversation = n;
  const select = node.querySelector(".model");
  for (const id of chatModels) select.append(el("option", { value: id }, id));
  const mcp = node.querySelector(".mcp");
  mcp.hidden = mcpServers.length === 0;
  for (const s of mcpServers) {
    mcp.append(el("label", { title: s.tools.map((t) => t.name).join(", ") },
      el("input", { type: "checkbox", class: "mcp-server", value: s.name }), ` ${s.name} (${s.tools.length} tools, ${s.state}) `));
  }
  document.getElementById("conversations").append(node);
  conversations.push(new Conversation(node));
  if (focus) node.querySelector(".input").focus();
}

class Conversation {
  constructor(node) {
    this.node = node;
    this.messages = [];
    this.controller = null;
    this.log = node.querySelector(".log");
    const form = node.querySelector(".ask");
    form.addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
    node.querySelector(".input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); this.send(); }
    });
    node.querySelector(".stop").addEventListener("click", () => this.stop());
    node.querySelector(".clear").addEventListener("click", () => { this.stop(); this.messages = []; this.log.replaceChildren(); });
    // images for the next message: picked, pasted or dropped (a vision model reads them)
    this.images = [];
    this.attached = node.querySelector(".attached");
    const attach = node.querySelector(".attach");
    attach.addEventListener("change", () => { this.attach(attach.files); attach.value = ""; });
    node.querySelector(".input").addEventListener("paste", (e) => {
      const files = [...(e.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
      if (files.length) { e.preventDefault(); this.attach(files); }
    });
    node.addEventListener("dragover", (e) => { e.preventDefault(); node.classList.add("dropping"); });
    node.addEventListener("dragleave", () => node.classList.remove("dropping"));
    node.addEventListener("drop", (e) => {
      e.preventDefault();
      node.classList.remove("dropping");
      this.attach(e.dataTransfer?.files || []);
    });
  }

  async attach(files) {
    for (const file of files) {
      if (!file.type.startsWith("image/")) continue;
      const url = await new Promise((resolve, reject) => {
        const reader = new FileReader();
        reader.onload = () => resolve(reader.result);
        reader.onerror = () => reject(reader.error);
        reader.readAsDataURL(file);
      });
      this.images.push(url);
      const remove = el("button", { type: "button", "aria-label": `Remove ${file.name}` }, "×");
      const item = el("li", {}, el("img", { src: url, alt: file.name }), remove);
      remove.addEventListener("click", () => { this.images.splice(this.images.indexOf(url), 1); item.remove(); });
      this.attached.append(item);
    }
  }

  request() {
    const q = (s) => this.node.querySelector(s);
    const body = { model: q(".model").value || "any", stream: true, stream_options: { include_usage: true } };
    const messages = [];
    if (q(".system").value.trim()) messages.push({ role: "system", content: q(".system").value });
    body.messages = messages.concat(this.messages);
    const temperature = parseFloat(q(".temperature").value);
    if (!Number.isNaN(temperature)) body.temperature = temperature;
    const maxTokens = parseInt(q(".max-tokens").value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const schema = q(".schema").value.trim();
    if (schema) body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(schema) } };
    const tools = q(".tools").value.trim();
    if (tools) body.tools = JSON.parse(tools);
    return body;
  }

  mcpChosen() {
    return [...this.node.querySelectorAll(".mcp-server:checked")].map((box) => box.value);
  }

  // The same conversation as a Responses request, its mcp tools run by the server.
  responsesRequest(servers) {
    const chat = this.request();
    const part = (p) => p.type === "image_url" ? { type: "input_image", image_url: p.image_url.url } : { type: "input_text", text: p.text };
    const body = {
      model: chat.model, stream: true, temperature: chat.temperature, max_output_tokens: chat.max_tokens,
      input: chat.messages.filter((m) => m.role !== "tool" && (m.content || "").length).map((m) =>
        ({ role: m.role, content: typeof m.content === "string" ? m.content : m.content.map(part) })),
      tools: servers.map((name) => ({ type: "mcp", server_label: name, require_approval: "never" })),
    };
    for (const t of chat.tools || []) body.tools.push({ type: "function", ...t.function });
    if (chat.response_format) body.text = { format: { type: "json_schema", name: "answer", schema: chat.response_format.json_schema.schema } };
    return body;
  }

  async send() {
    const input = this.node.querySelector(".input");
    const text = input.value.trim();
    if (!text || this.controller) return;
    const images = this.images;
    const content = images.length
      ? [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }]
      : text;
    let body;
    const servers = this.mcpChosen();
    try {
      this.messages.push({ role: "user", content });
      body = servers.length ? this.responsesRequest(servers) : this.request();
    } catch (err) {
      this.messages.pop();
      this.log.append(el("li", { role: "alert" }, `The JSON schema or tools do not parse: ${err.message}`));
      return;
    }
    input.value = "";
    this.images = [];
    this.attached.replaceChildren();
    const shown = images.length
      ? el("ul", { class: "thumbs" }, ...images.map((url, i) => el("li", {}, el("img", { src: url, alt: `Image ${i + 1}` }))))
      : null;
    this.log.append(el("li", { class: "user" }, el("span", { class: "who" }, "You"), shown, text));
    const answer = new Answer(this.log);
    this.controller = new AbortController();
    this.busy(true);
    const began = performance.now();
    try {
      const path = servers.length ? "/v1/responses" : "/v1/chat/completions";
      const response = await postJSON(path, body, this.controller.signal);
      if (!response.ok) throw new Error(errorText(await response.json(), response.status));
      for await (const { event, data } of events(response)) {
        if (data === "[DONE]") break;
        if (event === "error") throw new Error(errorText(data, 0));
        if (event === "response.failed") throw new Error(errorText(data.response, 0));
        if (servers.length) answer.responseEvent(event, data, began);
        else answer.chunk(data, began);
      }
      answer.finish(began, "done");
      this.messages.push(answer.message());
    } catch (err) {
      if (err.name === "AbortError") answer.finish(began, "stopped");
      else answer.fail(err.message);
    } finally {
      this.controller = null;
      this.busy(false);
    }
  }

  stop() { if (this.controller) this.controller.abort(); }

  busy(on) {
    this.node.querySelector(".send").disabled = on;
    this.node.querySelector(".stop").disabled = !on;
    this.node.setAttribute("aria-busy", String(on));
  }
}

class Answer {
  constructor(log) {
    this.text = el("span", { class: "content" });
    this.reasoningText = el("span");
    this.reasoning = el("details", { class: "reasoning", hidden: "" }, el("summary", {}, "Reasoning"), this.reasoningText);
    this.tools = el("div", { class: "tools" });
    this.stats = el("span", { class: "stats" }, "waiting…");
    this.node = el("li", { class: "assistant" }, el("span", { class: "who" }, "Assistant"), this.reasoning, this.text, this.tools, this.stats);
    log.append(this.node);
    this.log = log;
    this.calls = [];
    this.first = null;
    this.usage = null;
    this.pieces = 0;
  }

  chunk(data, began) {
    if (data.usage) this.usage = data.usage;
    for (const choice of data.choices || []) {
      const d = choice.delta || {};
      const reasoning = d.reasoning_content || d.reasoning;
      if (d.content || reasoning || d.tool_calls) {
        if (this.first === null) this.first = performance.now();
        this.pieces++;
        this.stats.textContent = `streaming… ${this.pieces} pieces, first after ${Math.round(this.first - began)} ms`;
      }
      if (d.content) this.text.append(d.content);
      if (reasoning) { this.reasoning.hidden = false; this.reasoningText.append(reasoning); }
      for (const call of d.tool_calls || []) this.toolCall(call);
    }
    this.log.scrollTop = this.log.scrollHeight;
  }

  // A Responses stream's event: text, reasoning, the MCP calls the server ran, the usage.
  responseEvent(event, data, began) {
    if (event === "response.output_text.delta" || event === "response.reasoning_text.delta") {
      if (this.first === null) this.first = performance.now();
      this.pieces++;
      this.stats.textContent = `streaming… ${this.pieces} pieces, first after ${Math.round(this.first - began)} ms`;
      if (event === "response.output_text.delta") this.text.append(data.delta);
      else { this.reasoning.hidden = false; this.reasoningText.append(data.delta); }
    } else if (event === "response.output_item.done" && data.item.type === "mcp_call") {
      const item = data.item;
      this.tools.append(el("div", { class: "tool-card mcp-call", role: "group", "data-status": item.status },
        el("strong", {}, `${item.server_label} · ${item.name}`), el("br"), el("code", {}, item.arguments), el("br"),
        el("span", { class: "tool-output" }, item.error === null ? item.output : `Error: ${item.error}`)));
    } else if (event === "response.completed") {
      const u = data.response.usage;
      this.usage = { prompt_tokens: u.input_tokens, completion_tokens: u.output_tokens };
    }
    this.log.scrollTop = this.log.scrollHeight;
  }

  toolCall(delta) {
    let call = this.calls[delta.index || 0];
    if (!call) {
      call = { id: delta.id, name: "", args: "", card: el("div", { class: "tool-card", role: "group" }) };
      call.title = el("strong"); call.body = el("code");
      call.card.append(call.title, el("br"), call.body);
      this.calls[delta.index || 0] = call;
      this.tools.append(call.card);
    }
    if (delta.function?.name) call.name += delta.function.name;
    if (delta.function?.arguments) call.args += delta.function.arguments;
    call.title.textContent = call.name;
    call.body.textContent = call.args;
  }

  finish(began, how) {
    const end = performance.now();
    const u = this.usage;
    const parts = [how === "stopped" ? "Stopped" : "Done"];
    if (u) parts.push(`${u.prompt_tokens} prompt + ${u.completion_tokens} completion tokens`);
    else parts.push(`${this.pieces} pieces`);
    if (this.first !== null) {
      parts.push(`TTFT ${Math.round(this.first - began)} ms`);
      const tokens = u ? u.completion_tokens : this.pieces;
      const seconds = (end - this.first) / 1000;
      if (seconds > 0 && tokens > 1) parts.push(`${(tokens / seconds).toFixed(1)} tok/s`);
    }
    this.stats.textContent = parts.join(" · ");
    this.node.dataset.state = how;
    const text = this.text.textContent;
    if (text.trim() && document.getElementById("tts-model").value) this.node.append(el("button", { type: "button", class: "speak", onclick: () => speak(text) }, "Speak this answer"));
  }

  fail(message) {
    this.stats.textContent = `Error: ${message}`;
    this.stats.setAttribute("role", "alert");
    this.node.dataset.state = "error";
  }

  message() {
    const m = { role: "assistant", content: this.text.textContent };
    const calls = this.calls.filter(Boolean);
    if (calls.length) m.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.args } }));
    return m;
  }
}
