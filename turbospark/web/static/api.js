// Talking to this server only: the API key (asked once, kept for the tab), fetch with it,
// server-sent events read from a fetch body, and the live status feed shared by the views.
const KEY = "turbospark.apiKey";
let asking = null;

export function apiKey() { return sessionStorage.getItem(KEY) || ""; }

function base64url(text) {
  return btoa(String.fromCharCode(...new TextEncoder().encode(text))).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

// A WebSocket to this server offering `protocol`; a browser cannot send headers, so the key goes
// as the subprotocol turbospark-key.<base64url of the key>. Resolves once open.
export function openSocket(path, protocol, refused) {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const key = apiKey();
  const ws = new WebSocket(`${scheme}://${location.host}${path}`, key ? [protocol, `turbospark-key.${base64url(key)}`] : [protocol]);
  return new Promise((resolve, reject) => {
    ws.onopen = () => resolve(ws);
    ws.onerror = () => reject(new Error(refused));
  });
}

function askKey() {
  if (asking) return asking;
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  asking = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      if (input.value) sessionStorage.setItem(KEY, input.value);
      input.value = "";
      asking = null;
      resolve();
    }, { once: true });
  });
  dialog.showModal();
  input.focus();
  return asking;
}

export function authHeaders(headers = {}) {
  const key = apiKey();
  return key ? { ...headers, Authorization: `Bearer ${key}` } : headers;
}

// fetch with the key; a 401 asks for the key (once for every request waiting) and tries again.
export async function api(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: authHeaders(options.headers || {}) });
    if (response.status !== 401) return response;
    await askKey();
  }
}

export async function json(path, options = {}) {
  const response = await api(path, options);
  const body = await response.json();
  if (!response.ok) throw new Error(errorText(body, response.status));
  return body;
}

export function errorText(body, status) {
  const e = body && body.error;
  return (e && (e.message || e)) || `HTTP ${status}`;
}

export function postJSON(path, body, signal) {
  return api(path, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal });
}

// Lines of a streamed body (NDJSON or SSE).
export async function* lines(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let at;
    while ((at = buffer.indexOf("\n")) >= 0) {
      yield buffer.slice(0, at).replace(/\r$/, "");
      buffer = buffer.slice(at + 1);
    }
  }
  if (buffer) yield buffer;
}

// Server-sent events: {event, data} with data parsed as JSON ("[DONE]" as a string).
export async function* events(response) {
  let name = "message", data = [];
  for await (const line of lines(response)) {
    if (line === "") {
      if (data.length) {
        const text = data.join("\n");
        yield { event: name, data: text === "[DONE]" ? text : JSON.parse(text) };
      }
      name = "message"; data = [];
    } else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
    else if (line.startsWith("event:")) name = line.slice(6).trim();
  }
}

// The live status feed: one stream for the page, its snapshots handed to every listener.
const listeners = new Set();
export let latest = null;
export function onStatus(listener) { listeners.add(listener); if (latest) listener(latest); }

export async function followStatus(stateEl) {
  for (;;) {
    try {
      const response = await api("/status/feed?interval=0.5");
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      stateEl.textContent = "Status feed: live";
      for await (const { data } of events(response)) {
        latest = data;
        for (const listener of listeners) listener(data);
      }
      stateEl.textContent = "Status feed: ended; reconnecting…";
    } catch (err) {
      stateEl.textContent = `Status feed: ${err.message}; reconnecting…`;
    }
    await new Promise((r) => setTimeout(r, 2000));
  }
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

export function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
