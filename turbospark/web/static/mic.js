// Microphone: 16 kHz float samples into the realtime transcription WebSocket; partial and
// final transcripts as they come. Speech: /v1/audio/speech played back.
import { el, errorText, json, openSocket, postJSON } from "./api.js";

let session = null;

export async function startMic() {
  document.getElementById("record").addEventListener("click", () => (session ? stop() : record()));
  document.getElementById("speak").addEventListener("click", () => speak(document.getElementById("speak-text").value));
  try {
    const models = (await json("/v1/models")).data;
    fill("stt-model", models.filter((m) => m.task === "speech_to_text"));
    fill("tts-model", models.filter((m) => m.task === "text_to_speech"));
  } catch (err) { /* the key dialog or an error: the selects stay empty */ }
}

function fill(id, models) {
  const select = document.getElementById(id);
  select.replaceChildren(...models.map((m) => el("option", { value: m.id }, m.id)));
  if (!models.length) select.append(el("option", { value: "" }, "none attached"));
}

function state(text) { document.getElementById("mic-state").textContent = text; }

async function open(model, vad) {
  const path = `/v1/audio/transcriptions/realtime?model=${encodeURIComponent(model)}&encoding=f32le&vad=${vad}`;
  const ws = await openSocket(path, "turbospark", "the transcription socket was refused");
  ws.binaryType = "arraybuffer";
  return ws;
}

async function record() {
  const model = document.getElementById("stt-model").value;
  if (!model) { state("No speech-to-text model is attached."); return; }
  const button = document.getElementById("record");
  button.disabled = true;
  try {
    let ws;
    try { ws = await open(model, true); } catch (err) { ws = await open(model, false); } // no VAD here
    const stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false } });
    const context = new AudioContext({ sampleRate: 16000 });
    await context.audioWorklet.addModule("/ui/mic-worklet.js");
    const source = context.createMediaStreamSource(stream);
    const tap = new AudioWorkletNode(context, "pcm-tap");
    tap.port.onmessage = (e) => { if (ws.readyState === WebSocket.OPEN) ws.send(e.data.buffer); };
    source.connect(tap);
    session = { ws, stream, context, done: null };
    ws.onmessage = (e) => message(JSON.parse(e.data));
    ws.onclose = () => { if (session && session.ws === ws) finish(); };
    button.setAttribute("aria-pressed", "true");
    button.textContent = "Stop recording";
    state("Recording… speak now.");
  } catch (err) {
    state(`Could not record: ${err.message}`);
    session = null;
  } finally {
    button.disabled = false;
  }
}

function message(m) {
  if (m.type === "partial") document.getElementById("partial").textContent = m.text;
  else if (m.type === "complete") {
    document.getElementById("partial").textContent = "";
    if (m.text.trim()) document.getElementById("finals").append(el("li", { "data-segment": m.segment_id }, m.text.trim()));
    if (session && session.done) session.done();
  } else if (m.type === "error") {
    state(`Transcription: ${m.message}`);
    if (session && session.done) session.done();
  }
}

async function stop() {
  const s = session;
  if (!s) return;
  s.stream.getTracks().forEach((t) => t.stop());
  await s.context.close();
  state("Finishing the transcript…");
  // the last words: commit what is buffered and wait for its final (or give up after 30 s)
  await new Promise((resolve) => {
    s.done = resolve;
    setTimeout(resolve, 30000);
    s.ws.send(JSON.stringify({ type: "commit" }));
  });
  finish();
}

function finish() {
  const s = session;
  session = null;
  if (!s) return;
  s.stream.getTracks().forEach((t) => t.stop());
  if (s.context.state !== "closed") s.context.close();
  if (s.ws.readyState === WebSocket.OPEN) s.ws.close(1000);
  const button = document.getElementById("record");
  button.setAttribute("aria-pressed", "false");
  button.textContent = "Record";
  state("Not recording.");
}

export async function speak(text) {
  const model = document.getElementById("tts-model").value;
  const audio = document.getElementById("speech");
  if (!text.trim() || !model) return;
  const response = await postJSON("/v1/audio/speech", { model, input: text, response_format: "wav" });
  if (!response.ok) { state(`Speech: ${errorText(await response.json(), response.status)}`); return; }
  if (audio.src) URL.revokeObjectURL(audio.src);
  audio.src = URL.createObjectURL(await response.blob());
  audio.dataset.spoken = text;
  await audio.play().catch(() => {});
}
