// tim-enhancer in the browser: live speech enhancement of a MediaStream (a microphone) through the
// service's websocket /v1/stream. An ES module with no dependencies and no build step, served by
// the service at /client.js:
//
//   import { openStream } from "http://127.0.0.1:8000/client.js";
//   const mic = await navigator.mediaDevices.getUserMedia({ audio: true });
//   const stream = await openStream(mic);               // reconnects and resumes by itself
//   audioElement.srcObject = stream.output;             // the enhanced audio, a MediaStream
//   stream.addEventListener("activity", (e) => console.log(e.detail.activity));
//   await stream.stop();                                // the enhanced tail, then the end
//
// The microphone is captured at the AudioContext's rate (mixed to mono) and sent in 20 ms f32le
// chunks; the enhanced audio comes back sample-aligned with it and plays from `output` (and, at
// the same delay, the original from `original`). On close 1013 (the service is full) the stream
// waits the error's retry_after_s and connects again. The stream is opened "resumable": when the
// service restarts it sends the output of every whole hop it read, then the stream's state, then
// closes 1012; the module reconnects at once, hands the state back ("resume_bytes", then the state
// in binary messages) and, once the ready says "resumed", sends the input from the first sample the
// state has not seen: the output goes on exactly where it stopped, as if uninterrupted. A restart
// without a usable state (the service could not take it, or the next replica refuses it: another
// model), 1001 or a lost connection: it reconnects with a backoff and resends the input from the
// first sample whose output it has not received, `resumeOverlapS` earlier (that output is dropped):
// nothing is lost, nothing plays twice. Events (CustomEvent, in `detail`): "state" {state, code,
// message} (connecting, streaming, waiting, reconnecting, ending, ended, error, closed), "ready" (the
// service's ready message; "resumed" when it continued from the state), "handoff" {input_samples,
// output_samples, bytes, kept} (the service restarts and handed over the state: absolute sample
// positions; kept when the next connection will use it), "activity" {time_s, activity, frames:
// [{time_s, activity}]} (the speech activity of each 16 ms hop), "metadata" {frames} (activity and
// the TIM competition, as sent), "input" {samples, total} and "audio" {samples, total} (each chunk
// sent / enhanced block received), "queue" {enhancedMs} (the playback buffer), "notice" (late,
// on_time, gap), "error" {kind, message, code}.

const PROCESSORS = `
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
      const n = input[0].length, k = input.length;
      for (let i = 0; i < n; i++) {
        let v = 0;
        for (let c = 0; c < k; c++) v += input[c][i];
        this.buf[this.fill++] = v / k;
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
    if (this.size + x.length > cap) this.skip(this.size + x.length - cap);
    let w = (this.read + this.size) % cap;
    for (let i = 0; i < x.length; i++) { this.data[w] = x[i]; w = w + 1 === cap ? 0 : w + 1; }
    this.size += x.length;
  }
  pop(out) {
    const cap = this.data.length;
    for (let i = 0; i < out.length; i++) { out[i] = this.data[this.read]; this.read = this.read + 1 === cap ? 0 : this.read + 1; }
    this.size -= out.length;
  }
  skip(n) { n = Math.min(n, this.size); this.read = (this.read + n) % this.data.length; this.size -= n; }
}

// Output 0: the enhanced audio; output 1: the original, delayed to stay sample-aligned with it.
class Playback extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = options.processorOptions;
    this.enhanced = new Queue(o.sampleRate * 8);
    this.original = new Queue(o.sampleRate * 8);
    this.prebuffer = o.prebuffer;
    this.maxBuffer = o.maxBuffer;
    this.playing = false;
    this.calls = 0;
    this.port.onmessage = (e) => {
      if (e.data.kind === "enhanced") this.enhanced.push(e.data.samples);
      else this.original.push(e.data.samples);
    };
  }
  process(inputs, outputs) {
    const enh = outputs[0][0], orig = outputs[1][0], n = enh.length;
    if (this.enhanced.size > this.maxBuffer) { // far behind (after a reconnect): back to live
      const drop = this.enhanced.size - this.prebuffer;
      this.enhanced.skip(drop);
      this.original.skip(drop);
    }
    if (!this.playing && this.enhanced.size >= this.prebuffer) this.playing = true;
    if (!this.playing || this.enhanced.size < n || this.original.size < n) {
      enh.fill(0);
      orig.fill(0);
      if (this.playing && this.enhanced.size < n) this.playing = false; // underrun: rebuffer
    } else {
      this.enhanced.pop(enh);
      this.original.pop(orig);
    }
    if (++this.calls % 32 === 0) this.port.postMessage({ kind: "queue", enhanced: this.enhanced.size });
    return true;
  }
}

registerProcessor("tim-capture", Capture);
registerProcessor("tim-playback", Playback);
`;

const RESUME = new Set([1001, 1006, 1012]); // going away, connection lost, restarting: resume

/** Opens an enhanced stream of `input` (a MediaStream) and resolves once the service is ready. */
export async function openStream(input, options = {}) {
  const stream = new EnhancedStream(input, options);
  await stream.start();
  return stream;
}

export class EnhancedStream extends EventTarget {
  constructor(input, options = {}) {
    super();
    const o = { url: null, apiKey: "", atten_lim_db: null, band: "full", level: "model", metadata: true,
      context: null, chunkMs: 20, resumeOverlapS: 1, maxRetries: 10, maxWaitS: 30, prebufferMs: 40,
      maxBufferMs: 400, ...options };
    this.options = o;
    this.input = input;
    this.context = o.context;
    this.ownContext = !o.context;
    this.state = "idle";
    this.ready = null; // the service's last ready message
    this.sessions = 0; // connections that got as far as ready
    this.samplesIn = 0; // samples captured and queued for the service
    this.samplesOut = 0; // enhanced samples received (the overlap of a resume left out)
    this.resumed = 0; // connections that continued the stream from its state
    this.handoff = null; // the last "state" message, decoded, until a connection uses it
    this.origin = 0; // the input sample where the service's stream began (its counts start there)
    this.held = []; // [first sample, Float32Array] of input whose output has not come back yet
    this.ws = null;
    this.ended = false;
    this.tries = 0;
    this.reached = false;
    this.lastError = null;
    this.done = new Promise((resolve, reject) => { this.finish = resolve; this.fail = reject; });
    this.done.catch(() => {}); // also reported as the "error" event and the state
  }

  get sampleRate() { return this.context ? this.context.sampleRate : 0; }

  async start() {
    const ctx = (this.context = this.context || new AudioContext({ latencyHint: "interactive" }));
    const url = URL.createObjectURL(new Blob([PROCESSORS], { type: "text/javascript" }));
    try { await ctx.audioWorklet.addModule(url); } finally { URL.revokeObjectURL(url); }
    const rate = ctx.sampleRate, o = this.options;
    this.capture = new AudioWorkletNode(ctx, "tim-capture", {
      processorOptions: { chunkSamples: Math.round((rate * o.chunkMs) / 1000) } });
    this.node = new AudioWorkletNode(ctx, "tim-playback", { numberOfInputs: 0, numberOfOutputs: 2,
      outputChannelCount: [1, 1], processorOptions: { sampleRate: rate,
        prebuffer: Math.round((rate * o.prebufferMs) / 1000), maxBuffer: Math.round((rate * o.maxBufferMs) / 1000) } });
    this.node.port.onmessage = (e) => this.emit("queue", { enhancedMs: (1000 * e.data.enhanced) / rate });
    const out = ctx.createMediaStreamDestination(), orig = ctx.createMediaStreamDestination();
    this.node.connect(out, 0);
    this.node.connect(orig, 1);
    this.output = out.stream;
    this.original = orig.stream;
    this.silent = ctx.createGain();
    this.silent.gain.value = 0; // the capture runs only when it is pulled to the destination
    this.source = ctx.createMediaStreamSource(this.input);
    this.source.connect(this.capture).connect(this.silent).connect(ctx.destination);
    this.capture.port.onmessage = (e) => this.onInput(e.data);
    await ctx.resume();
    const first = new Promise((resolve, reject) => { this.firstReady = resolve; this.firstFailed = reject; });
    this.connect();
    await first;
    return this;
  }

  /** Plays "enhanced", "original" (both at the same delay) or nothing (null) on the context's speakers. */
  monitor(which) {
    if (!this.node) return;
    if (!this.monitors) {
      this.monitors = [0, 1].map((i) => {
        const g = this.context.createGain();
        this.node.connect(g, i).connect(this.context.destination);
        return g;
      });
    }
    this.monitors[0].gain.value = which === "enhanced" ? 1 : 0;
    this.monitors[1].gain.value = which === "original" ? 1 : 0;
  }

  /** No more input: resolves with the number of samples once the service sent the rest and its end. */
  stop() {
    if (!this.ended) {
      this.ended = true;
      if (this.capture) this.capture.port.onmessage = null;
      if (this.source) this.source.disconnect();
      this.setState("ending");
      this.sendHeld();
    }
    return this.done;
  }

  /** Stops now, without the rest of the output; closes the AudioContext the stream made. */
  close() {
    this.ended = true;
    clearTimeout(this.timer);
    if (this.ws) { const ws = this.ws; this.ws = null; ws.onclose = null; ws.close(); }
    if (this.capture) this.capture.port.onmessage = null;
    if (this.source) this.source.disconnect();
    if (this.node) this.node.port.onmessage = null;
    if (this.ownContext && this.context && this.context.state !== "closed") this.context.close().catch(() => {});
    if (!["ended", "error"].includes(this.state)) this.setState("closed");
    this.finish({ samples: this.samplesOut, complete: false });
  }

  // ------------------------------------------------------------------ the service
  connect() {
    const o = this.options;
    const url = new URL(o.url || "/v1/stream", import.meta.url);
    url.protocol = url.protocol === "https:" || url.protocol === "wss:" ? "wss:" : "ws:";
    if (o.apiKey) url.searchParams.set("api_key", o.apiKey);
    // begin, drop and sent are set by the ready: where the state resumed, or the overlap's start
    const session = { begin: 0, drop: 0, sent: 0, ready: false, opened: false, got: 0, error: null, handoff: null };
    const ws = new WebSocket(url);
    ws.binaryType = "arraybuffer";
    this.setState(this.sessions ? "reconnecting" : "connecting");
    ws.onopen = () => {
      session.opened = true;
      session.handoff = this.handoff; // kept until a ready answers it (a refusal before one keeps it)
      const start = { sample_rate: this.sampleRate, encoding: "f32le", channels: 1, atten_lim_db: o.atten_lim_db,
        band: o.band, level: o.level, metadata: o.metadata, resumable: true };
      const blob = session.handoff && session.handoff.state;
      if (blob) start.resume_bytes = blob.length;
      ws.send(JSON.stringify(start));
      if (blob) { // the state right after the start message, before any audio
        const most = (this.ready && this.ready.max_message_bytes) || 1 << 20;
        for (let i = 0; i < blob.length; i += most) ws.send(blob.slice(i, i + most));
      }
    };
    ws.onmessage = (e) => (typeof e.data === "string" ? this.onText(ws, session, JSON.parse(e.data)) : this.onAudio(session, e.data));
    ws.onclose = (e) => this.onClose(ws, session, e.code);
  }

  onText(ws, session, msg) {
    if (msg.type === "ready") {
      if (session.ready) return;
      if (session.handoff && this.handoff === session.handoff) this.handoff = null; // used once: a state is of one moment
      if (!this.begin(session, msg)) {
        ws.onclose = null;
        ws.close();
        if (this.ws === ws) this.ws = null;
        return;
      }
      this.ready = msg;
      this.sessions += 1;
      session.ready = true;
      this.reached = true;
      this.ws = ws;
      this.session = session;
      this.emit("ready", msg);
      this.setState(this.ended ? "ending" : "streaming");
      this.firstReady();
      this.sendHeld();
    } else if (msg.type === "metadata") {
      this.emit("metadata", { frames: msg.frames });
      const frames = msg.frames.map((f) => ({ time_s: f.time_s, activity: f.activity[0] }));
      if (frames.length) {
        const last = frames[frames.length - 1];
        this.emit("activity", { time_s: last.time_s, activity: last.activity, frames });
      }
    } else if (msg.type === "error") {
      session.error = msg;
    } else if (msg.type === "state") {
      this.keepState(msg);
    } else if (msg.type !== "end") {
      this.emit("notice", msg); // late, on_time, gap, and types of later versions
    }
  }

  /** Where this connection's input starts (the ready `msg`): where the state resumed, or the overlap
   * before the first output sample missing; false (and the stream fails) if the service resumed
   * elsewhere than where the output stopped. */
  begin(session, msg) {
    const resumed = msg.resumed;
    if (session.handoff && resumed && typeof resumed === "object") {
      const at = this.origin + resumed.output_samples;
      if (at !== this.samplesOut) {
        this.failWith({ kind: "protocol", message: `the service resumed at output sample ${at}, ${this.samplesOut} were delivered` });
        return false;
      }
      this.resumed += 1;
      session.begin = this.origin + resumed.input_samples;
      session.drop = 0;
    } else {
      this.origin = Math.max(0, this.samplesOut - Math.round(this.options.resumeOverlapS * this.sampleRate));
      session.begin = this.origin;
      session.drop = this.samplesOut - session.begin;
    }
    session.sent = session.begin;
    return true;
  }

  /** A "state" message (the service restarts): kept for the next connection if it starts where the
   * output stopped and the input it needs is still held. */
  keepState(msg) {
    let state = null, atIn = NaN, atOut = NaN;
    try {
      const text = atob(msg.state || "");
      state = new Uint8Array(text.length);
      for (let i = 0; i < text.length; i++) state[i] = text.charCodeAt(i);
      atIn = this.origin + msg.input_samples;
      atOut = this.origin + msg.output_samples;
    } catch (e) {
      state = null; // not base64: the next connection resumes with the overlap
    }
    const held0 = this.held.length ? this.held[0][0] : this.samplesIn;
    const kept = !!(state && state.length && Number.isInteger(atIn) && Number.isInteger(atOut) &&
      atOut === this.samplesOut && held0 <= atIn && atIn <= this.samplesIn);
    if (kept) this.handoff = { state, input_samples: atIn, output_samples: atOut };
    this.emit("handoff", { input_samples: atIn, output_samples: atOut, bytes: state ? state.length : 0, kept });
  }

  onAudio(session, buffer) {
    let samples = new Float32Array(buffer);
    const k = Math.min(session.drop, samples.length);
    session.drop -= k;
    if (k) samples = samples.subarray(k);
    if (!samples.length) return;
    session.got += samples.length;
    this.samplesOut += samples.length;
    this.tries = 0;
    const keep = this.samplesOut - Math.round(this.options.resumeOverlapS * this.sampleRate);
    while (this.held.length && this.held[0][0] + this.held[0][1].length <= keep) this.held.shift();
    this.emit("audio", { samples, total: this.samplesOut });
    if (this.node) this.node.port.postMessage({ kind: "enhanced", samples });
  }

  onClose(ws, session, code) {
    if (this.ws === ws) this.ws = null;
    if (this.state === "closed") return;
    const error = session.error;
    if (code === 1000) {
      const complete = this.samplesOut === this.samplesIn;
      this.setState("ended");
      this.releaseContext();
      return this.finish({ samples: this.samplesOut, complete });
    }
    if (!this.reached && !session.opened) {
      return this.failWith({ kind: "unreachable", message: `cannot reach the service at ${ws.url}`, code });
    }
    this.reached = true;
    if (error && error.kind === "invalid_state" && session.handoff) {
      this.handoff = null; // a replica that cannot read the state: resume with the overlap instead
      code = 1012;
    }
    if (!RESUME.has(code) && code !== 1013) {
      return this.failWith(error || { kind: "closed", message: `the stream closed with ${code}`, code });
    }
    this.tries = session.got ? 0 : this.tries + 1;
    if (this.tries > this.options.maxRetries) {
      return this.failWith({ kind: (error && error.kind) || "unreachable",
        message: `gave up after ${this.options.maxRetries} tries (last: ${code}${error ? `, ${error.message}` : ""})`, code });
    }
    let wait = code === 1013 ? (error && error.retry_after_s) || 5 : 0.25 * 2 ** Math.max(this.tries - 1, 0);
    if (code === 1012 && this.handoff && this.tries <= 1) wait = 0; // the state is in hand: continue at once
    this.setState(code === 1013 ? "waiting" : "reconnecting", code, error && error.message);
    this.timer = setTimeout(() => this.connect(), 1000 * Math.min(wait, this.options.maxWaitS));
  }

  failWith(error) {
    this.lastError = error;
    this.emit("error", error);
    this.setState("error", error.code, error.message);
    this.releaseContext();
    const err = Object.assign(new Error(error.message), error);
    if (this.firstFailed) this.firstFailed(err);
    this.fail(err);
  }

  releaseContext() {
    if (this.capture) this.capture.port.onmessage = null;
    if (this.source) this.source.disconnect();
    // the tail still plays for a moment before an AudioContext of our own goes
    if (this.ownContext && this.context) setTimeout(() => this.context.state !== "closed" && this.context.close().catch(() => {}), 1000);
  }

  // ------------------------------------------------------------------ the microphone
  onInput(samples) {
    if (this.ended) return;
    this.held.push([this.samplesIn, samples]);
    this.samplesIn += samples.length;
    this.emit("input", { samples, total: this.samplesIn });
    if (this.node) this.node.port.postMessage({ kind: "original", samples });
    this.sendHeld();
  }

  sendHeld() {
    const ws = this.ws, s = this.session;
    if (!ws || ws.readyState !== WebSocket.OPEN || !s || !s.ready) return;
    const most = Math.floor(((this.ready && this.ready.max_message_bytes) || 1 << 20) / 4);
    for (const [start, samples] of this.held) {
      const end = start + samples.length;
      if (end <= s.sent) continue;
      for (let i = s.sent - start; i < samples.length; i += most) {
        const part = samples.subarray(i, Math.min(samples.length, i + most));
        ws.send(part.slice().buffer);
        s.sent += part.length;
      }
    }
    if (this.ended && s.sent === this.samplesIn && !s.endSent) {
      s.endSent = true;
      ws.send(JSON.stringify({ type: "end" }));
    }
  }

  setState(state, code = null, message = null) {
    this.state = state;
    this.emit("state", { state, code, message });
  }

  emit(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }
}
