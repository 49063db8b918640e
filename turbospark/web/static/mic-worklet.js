// Microphone samples (already at the context's 16 kHz) posted to the page in ~100 ms blocks.
class PcmTap extends AudioWorkletProcessor {
  constructor() { super(); this.block = new Float32Array(1600); this.used = 0; }
  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) {
      for (let i = 0; i < channel.length; i++) {
        this.block[this.used++] = channel[i];
        if (this.used === this.block.length) { this.port.postMessage(this.block.slice(0)); this.used = 0; }
      }
    }
    return true;
  }
}
registerProcessor("pcm-tap", PcmTap);
