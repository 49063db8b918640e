// Conversation: the microphone into OpenAI's Realtime API (/v1/realtime, server VAD), the answer
// spoken back as it arrives. Speaking over the answer interrupts it: playback stops at once and
// the server cancels the answer within a step; the page tells it how much of the answer was
// played (conversation.item.truncate), and the conversation keeps only those words.
import { el, openSocket } from "./api.js";

const RATE = 24000;
let talk = null;

export function startTalk() {
  document.getElementById("talk").addEventListener("click", () => (talk ? hangUp() : call()));
}

function state(text) { document.getElementById("talk-state").textContent = text; }

function toBase64(int16) {
  const bytes = new Uint8Array(int16.buffer);
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

// One line of the conversation, by item id: who said it and what.
function line(id, role) {
  let li = document.querySelector(`#talk-log li[data-item="${id}"]`);
  if (!li) {
    li = el("li", { "data-item": id, "data-role": role }, el("strong", {}, role === "user" ? "You: " : "Answer: "), el("span"));
    document.getElementById("talk-log").append(li);
  }
  return li;
}

async function call() {
  const button = document.getElementById("talk");
  button.disabled = true;
  try {
    const ws = await openSocket("/v1/realtime?model=default", "realtime", "the realtime socket was refused");
    const stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true } });
    const context = new AudioContext({ sampleRate: RATE });
    await context.audioWorklet.addModule("/ui/mic-worklet.js");
    const tap = new AudioWorkletNode(context, "pcm-tap");
    tap.port.onmessage = (e) => {
      if (ws.readyState !== WebSocket.OPEN) return;
      const pcm = Int16Array.from(e.data, (x) => Math.max(-32768, Math.min(32767, Math.round(x * 32768))));
      ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: toBase64(pcm) }));
    };
    context.createMediaStreamSource(stream).connect(tap);
    talk = { ws, stream, context, playing: [], playAt: 0 };
    ws.onmessage = (e) => message(JSON.parse(e.data));
    ws.onclose = () => { if (talk && talk.ws === ws) hangUp(); };
    button.setAttribute("aria-pressed", "true");
    button.textContent = "Hang up";
    state("Listening… speak, then pause.");
  } catch (err) {
    state(`Could not start the conversation: ${err.message}`);
    talk = null;
  } finally {
    button.disabled = false;
  }
}

function play(b64, itemId) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const pcm = new Int16Array(bytes.buffer, 0, bytes.length >> 1);
  const buffer = talk.context.createBuffer(1, pcm.length, RATE);
  buffer.getChannelData(0).set(Float32Array.from(pcm, (x) => x / 32768));
  const source = talk.context.createBufferSource();
  source.buffer = buffer;
  source.connect(talk.context.destination);
  const at = Math.max(talk.context.currentTime, talk.playAt);
  source.start(at);
  if (!talk.heard || talk.heard.item !== itemId) talk.heard = { item: itemId, pieces: [] };
  talk.heard.pieces.push([at, buffer.duration]);
  talk.playAt = at + buffer.duration;
  talk.playing.push(source);
  source.onended = () => { if (talk) talk.playing = talk.playing.filter((s) => s !== source); };
  document.getElementById("talk-log").dataset.audioSeconds =
    String(Number(document.getElementById("talk-log").dataset.audioSeconds || 0) + buffer.duration);
}

// The answer's audio the person heard, in ms: what each scheduled piece has played by now.
function heardMs() {
  const now = talk.context.currentTime;
  return Math.floor(1000 * talk.heard.pieces.reduce((sum, [at, seconds]) => sum + Math.min(Math.max(now - at, 0), seconds), 0));
}

function silence() {
  if (talk.playing.length && talk.heard) {  // the server keeps only the words that were heard
    talk.ws.send(JSON.stringify({ type: "conversation.item.truncate", item_id: talk.heard.item,
                                  content_index: 0, audio_end_ms: heardMs() }));
  }
  for (const source of talk.playing) { try { source.stop(); } catch (err) { /* already ended */ } }
  talk.playing = [];
  talk.playAt = 0;
  talk.heard = null;
}

function message(m) {
  if (!talk) return;
  switch (m.type) {
    case "input_audio_buffer.speech_started":
      if (talk.playing.length) state("Interrupted: listening…");
      silence(); // barge-in: the answer stops here, and the server cancels it
      break;
    case "conversation.item.input_audio_transcription.completed":
      line(m.item_id, "user").querySelector("span").textContent = m.transcript;
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      line(m.item_id, "assistant").querySelector("span").textContent += m.delta;
      state("Answering…");
      break;
    case "response.output_audio.delta":
      play(m.delta, m.item_id);
      break;
    case "response.done": {
      const item = (m.response.output || []).find((i) => i.type === "message");
      if (item) {
        const li = line(item.id, "assistant");
        li.dataset.status = m.response.status;
        const part = item.content[0] || {};
        li.querySelector("span").textContent = (part.transcript ?? part.text ?? "") + (m.response.status === "cancelled" ? " (interrupted)" : "");
      }
      if (m.response.status !== "cancelled") state("Listening… speak, then pause.");
      break;
    }
    case "conversation.item.truncated":
      line(m.item_id, "assistant").dataset.truncatedMs = String(m.audio_end_ms);
      break;
    case "error":
      state(`Conversation: ${m.error.message}`);
      break;
    default:
      break;
  }
}

function hangUp() {
  const t = talk;
  talk = null;
  if (!t) return;
  t.stream.getTracks().forEach((track) => track.stop());
  if (t.context.state !== "closed") t.context.close();
  if (t.ws.readyState === WebSocket.OPEN) t.ws.close(1000);
  const button = document.getElementById("talk");
  button.setAttribute("aria-pressed", "false");
  button.textContent = "Talk";
  state("Not in a conversation.");
}
