// Images: /v1/images/generations streamed. Progress from the server's ": step k/n" comments, the
// partial images as they come, then the image and the seed it was made with. Stop aborts the
// fetch: the server stops the run before its next denoising step.
import { api, el, errorText, json, lines } from "./api.js";

let running = null;

export async function startImages() {
  document.getElementById("image-form").addEventListener("submit", (e) => { e.preventDefault(); generate(); });
  document.getElementById("image-stop").addEventListener("click", () => running && running.abort());
  document.getElementById("tab-images").addEventListener("shown", models);
  await models();
}

async function models() {
  const select = document.getElementById("image-model");
  const chosen = select.value;
  try {
    const list = (await json("/v1/models")).data.filter((m) => (m.capabilities || []).includes("text_to_image"));
    select.replaceChildren(...list.map((m) => el("option", { value: m.id }, m.id)));
    if (!list.length) select.append(el("option", { value: "" }, "none: import a Diffusers pipeline (docs/images.md)"));
    if (list.some((m) => m.id === chosen)) select.value = chosen;
  } catch (err) { /* the key dialog or an error: the select stays as it was */ }
}

function state(text, name) {
  const p = document.getElementById("image-state");
  p.textContent = text;
  p.dataset.state = name;
}

function number(id) {
  const v = document.getElementById(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function picture(b64, format) { return `data:image/${format};base64,${b64}`; }

async function generate() {
  const model = document.getElementById("image-model").value;
  if (!model) { state("No image model is loaded or stored.", "error"); return; }
  const body = {
    model, prompt: document.getElementById("image-prompt").value,
    size: document.getElementById("image-size").value.trim() || "auto",
    steps: number("image-steps"), seed: number("image-seed"),
    partial_images: number("image-partials-count") ?? 0, output_format: "png", stream: true,
  };
  const progress = document.getElementById("image-progress");
  const partials = document.getElementById("image-partials");
  const result = document.getElementById("image-result");
  partials.replaceChildren();
  result.hidden = true;
  progress.value = 0;
  const go = document.getElementById("image-generate"), stop = document.getElementById("image-stop");
  go.disabled = true; stop.disabled = false;
  running = new AbortController();
  const started = performance.now();
  state("Queued…", "queued");
  try {
    const response = await api("/v1/images/generations", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal: running.signal,
    });
    if (!response.ok) {
      let detail = null;
      try { detail = await response.json(); } catch (err) { /* not JSON */ }
      throw new Error(errorText(detail, response.status));
    }
    const seed = response.headers.get("x-turbospark-seed");
    let event = "message", data = [];
    for await (const line of lines(response)) {
      const step = /^: step (\d+)\/(\d+)/.exec(line);
      if (step) {
        progress.max = +step[2]; progress.value = +step[1];
        state(`Step ${step[1]} of ${step[2]}…`, "running");
      } else if (line.startsWith("event:")) event = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      else if (line === "" && data.length) {
        const m = JSON.parse(data.join("\n"));
        data = [];
        if (event.endsWith(".partial_image")) {
          partials.append(el("li", {}, el("img", { src: picture(m.b64_json, m.output_format), alt: `Partial image ${m.partial_image_index + 1}`,
                                                  "data-index": String(m.partial_image_index) })));
        } else if (event.endsWith(".completed")) {
          const img = result.querySelector("img");
          img.src = picture(m.b64_json, m.output_format);
          img.alt = body.prompt;
          const seconds = ((performance.now() - started) / 1000).toFixed(1);
          result.querySelector("figcaption").textContent = `${m.size}, seed ${seed}, ${seconds} s`;
          result.dataset.seed = seed;
          result.hidden = false;
          progress.value = progress.max;
          state("Done.", "done");
        } else if (event === "error") {
          throw new Error(errorText(m, 500));
        }
        event = "message";
      }
    }
    if (document.getElementById("image-state").dataset.state !== "done") throw new Error("the stream ended without an image");
  } catch (err) {
    if (err.name === "AbortError") state(`Stopped at step ${progress.value} of ${progress.max}: the server ends the run before its next step.`, "stopped");
    else state(`Error: ${err.message}`, "error");
  } finally {
    running = null;
    go.disabled = false; stop.disabled = true;
  }
}
