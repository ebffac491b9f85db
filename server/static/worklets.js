// AudioWorklet processors of the demo: "capture" (microphone -> main thread in fixed chunks) and
// "playback" (enhanced and original audio -> speakers, kept sample-aligned so switching is seamless).

class Capture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.size = options.processorOptions.chunkSamples;
    this.buf = new Float32Array(this.size);
    this.fill = 0;
  }

  process(inputs) {
    const input = inputs[0];
    if (input.length > 0) {
      const ch = input[0];
      let i = 0;
      while (i < ch.length) {
        const n = Math.min(ch.length - i, this.size - this.fill);
        this.buf.set(ch.subarray(i, i + n), this.fill);
        this.fill += n;
        i += n;
        if (this.fill === this.size) {
          this.port.postMessage(this.buf, [this.buf.buffer]);
          this.buf = new Float32Array(this.size);
          this.fill = 0;
        }
      }
    }
    return true;
  }
}

class Queue {
  constructor(capacity) { this.data = new Float32Array(capacity); this.read = 0; this.size = 0; }
  push(x) {
    const cap = this.data.length;
    if (this.size + x.length > cap) { // far behind: drop the oldest audio
      const drop = this.size + x.length - cap;
      this.read = (this.read + drop) % cap;
      this.size -= drop;
    }
    let w = (this.read + this.size) % cap;
    for (let i = 0; i < x.length; i++) { this.data[w] = x[i]; w = w + 1 === cap ? 0 : w + 1; }
    this.size += x.length;
  }
  pop(out) {
    const cap = this.data.length;
    for (let i = 0; i < out.length; i++) { out[i] = this.data[this.read]; this.read = this.read + 1 === cap ? 0 : this.read + 1; }
    this.size -= out.length;
  }
  skip(n) { this.read = (this.read + n) % this.data.length; this.size -= n; }
}

class Playback extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const rate = options.processorOptions.sampleRate;
    this.enhanced = new Queue(rate * 4);
    this.original = new Queue(rate * 4);
    this.mode = "enhanced";
    this.prebuffer = Math.round(rate * 0.04); // jitter buffer before playback starts
    this.playing = false;
    this.calls = 0;
    this.port.onmessage = (e) => {
      const m = e.data;
      if (m.kind === "enhanced") this.enhanced.push(m.samples);
      else if (m.kind === "original") this.original.push(m.samples);
      else if (m.kind === "mode") this.mode = m.mode;
    };
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    if (!this.playing && this.enhanced.size >= this.prebuffer) this.playing = true;
    // Both queues advance together: the enhanced stream is sample-aligned with the input, so the
    // original audio played in its place is delayed by exactly the same amount.
    if (!this.playing || this.enhanced.size < out.length || this.original.size < out.length) {
      out.fill(0);
      if (this.playing && this.enhanced.size < out.length) this.playing = false; // underrun: rebuffer
    } else if (this.mode === "enhanced") {
      this.enhanced.pop(out);
      this.original.skip(out.length);
    } else {
      this.original.pop(out);
      this.enhanced.skip(out.length);
    }
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    if (++this.calls % 32 === 0) this.port.postMessage({ kind: "queue", enhanced: this.enhanced.size }); // about 10 a second
    return true;
  }
}

registerProcessor("capture", Capture);
registerProcessor("playback", Playback);
