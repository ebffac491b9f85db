// Live view: microphone -> AudioWorklet -> websocket /v1/stream -> playback, with live spectrograms
// of the input and the output, level meters, the latency measured end to end and a plot of the
// competition scores the server sends as metadata. No build step: plain modern JavaScript.
import { $, apiKey, onView, showKey } from "./common.js";
import { LIVE_RANGE_DB, ScrollingSpectrogram, drawColourBar } from "./spectrogram.js";

const CHUNK_MS = 20;
const PLOT_FRAMES = 240; // frames (16 ms each) visible in the plot: about 4 s
const SPECTROGRAM_S = 5; // seconds visible in the live spectrograms

// Everything the page knows, readable by tests and shown under "Details".
const state = (window.demoState = {
  status: "idle", error: null, sampleRate: 0, latencyMs: null, atten: null, band: null, chunksSent: 0,
  enhancedMessages: 0, enhancedSamples: 0, metadataFrames: 0, plottedFrames: 0, mode: "enhanced",
  roundTripMs: null, playbackBufferMs: null, deviceLatencyMs: null, endToEndMs: null,
  inputLevelDb: null, outputLevelDb: null, spectrogramColumns: { input: 0, output: 0 },
});

let ctx = null, ws = null, mic = null, capture = null, playback = null;
const history = []; // recent metadata frames for the plot
let specIn = null, specOut = null;
let sent = []; // [input samples sent after the chunk, time it was sent] of chunks not yet enhanced
let samplesIn = 0, samplesOut = 0;
let roundTrips = []; // recent measurements (ms)
const level = { input: -Infinity, output: -Infinity };

function setStatus(status, error) {
  state.status = status;
  if (error) state.error = error;
  $("status").textContent = error ? `${status}: ${error}` : status;
  document.body.dataset.status = status;
  showResults();
}

function showResults() {
  $("results").textContent = JSON.stringify(state, null, 1);
}

async function start() {
  $("start").disabled = true;
  state.error = null;
  try {
    setStatus("starting");
    ctx = new AudioContext({ latencyHint: "interactive" });
    await ctx.audioWorklet.addModule("/static/worklets.js");
    mic = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
    });
    state.sampleRate = ctx.sampleRate;
    const chunkSamples = Math.round((ctx.sampleRate * CHUNK_MS) / 1000);
    capture = new AudioWorkletNode(ctx, "capture", { processorOptions: { chunkSamples } });
    playback = new AudioWorkletNode(ctx, "playback", {
      numberOfInputs: 0, outputChannelCount: [1], processorOptions: { sampleRate: ctx.sampleRate },
    });
    playback.port.postMessage({ kind: "mode", mode: state.mode });
    const rate = ctx.sampleRate;
    playback.port.onmessage = (e) => {
      if (e.data.kind === "queue") state.playbackBufferMs = Math.round((1000 * e.data.enhanced) / rate);
    };
    const silent = ctx.createGain();
    silent.gain.value = 0;
    ctx.createMediaStreamSource(mic).connect(capture).connect(silent).connect(ctx.destination);
    playback.connect(ctx.destination);
    specIn = new ScrollingSpectrogram($("live-in"), rate, SPECTROGRAM_S);
    specOut = new ScrollingSpectrogram($("live-out"), rate, SPECTROGRAM_S);
    sent = [];
    roundTrips = [];
    samplesIn = samplesOut = 0;
    await openSocket();
    capture.port.onmessage = (e) => sendChunk(e.data);
    await ctx.resume();
    $("stop").disabled = false;
  } catch (err) {
    setStatus("error", err.message || String(err));
    stop();
  }
}

function socketUrl() {
  const url = new URL("/v1/stream", location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  url.search = "";
  url.hash = "";
  if (apiKey()) url.searchParams.set("api_key", apiKey());
  return url;
}

function openSocket() {
  return new Promise((resolve, reject) => {
    // Handlers belong to their own socket: after Stop the old one still delivers the enhanced tail
    // and its close, which must not reach the playback or the status of a stream started since.
    const sock = (ws = new WebSocket(socketUrl()));
    sock.binaryType = "arraybuffer";
    const atten = $("atten").value;
    const sampleRate = ctx.sampleRate;
    sock.onopen = () => sock.send(JSON.stringify({
      sample_rate: sampleRate, encoding: "f32le", channels: 1,
      atten_lim_db: atten === "" ? null : Number(atten), metadata: true, band: $("band").value,
    }));
    sock.onmessage = (e) => {
      if (sock !== ws) return; // a stopped stream's tail: nobody listens to it any more
      if (typeof e.data !== "string") return onAudio(e.data);
      const msg = JSON.parse(e.data);
      if (msg.type === "ready") {
        state.latencyMs = msg.latency_ms;
        state.atten = msg.atten_lim_db;
        state.band = msg.band; // as the server took it: "full" keeps the band above 8 kHz (input above 16 kHz)
        $("info").textContent = `${msg.sample_rate} Hz · algorithmic latency ${msg.latency_ms} ms` +
          (msg.band === "speech" ? " · speech band (nothing above 8 kHz)" : "");
        setStatus("streaming");
        resolve();
      } else if (msg.type === "metadata") {
        onMetadata(msg.frames);
      } else if (msg.type === "error") {
        if (msg.kind === "unauthorized" || msg.kind === "forbidden") showKey(true);
        setStatus("error", msg.message);
        reject(new Error(msg.message));
      }
    };
    sock.onclose = (e) => {
      reject(new Error(`connection closed (${e.code})`)); // no effect once the stream was ready
      if (sock !== ws) return;
      ws = null;
      if (state.status === "streaming") setStatus(e.code === 1000 ? "stopped" : "closed", e.code === 1000 ? null : `connection closed (${e.code})`);
    };
  });
}

function sendChunk(samples) {
  if (!ws || ws.readyState !== WebSocket.OPEN || !playback) return;
  ws.send(samples.buffer);
  samplesIn += samples.length;
  sent.push([samplesIn, performance.now()]);
  playback.port.postMessage({ kind: "original", samples });
  state.chunksSent += 1;
  level.input = Math.max(rmsDb(samples), level.input);
  specIn.push(samples);
}

function onAudio(buffer) {
  const samples = new Float32Array(buffer);
  state.enhancedMessages += 1;
  state.enhancedSamples += samples.length;
  if (!playback) return; // stopped: the tail of the stream arrives after playback has ended
  measureRoundTrip(samples.length);
  level.output = Math.max(rmsDb(samples), level.output);
  specOut.push(samples);
  playback.port.postMessage({ kind: "enhanced", samples }, [samples.buffer]);
  if (state.enhancedMessages % 10 === 0) showResults();
}

/** Output sample i is the enhanced input sample i: the newest sample of this message went into the
 * capture worklet (end of its chunk - its place in the chunk) before its chunk was sent. */
function measureRoundTrip(n) {
  samplesOut += n;
  while (sent.length && sent[0][0] < samplesOut) sent.shift();
  if (!sent.length) return;
  const [end, t] = sent[0];
  const waited = (1000 * (end - samplesOut)) / ctx.sampleRate; // in the capture chunk before it was sent
  roundTrips.push(performance.now() - t + waited);
  if (roundTrips.length > 100) roundTrips.shift();
}

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  return s.length ? s[Math.floor(s.length / 2)] : null;
}

function rmsDb(x) {
  let s = 0;
  for (let i = 0; i < x.length; i++) s += x[i] * x[i];
  return 10 * Math.log10(s / Math.max(1, x.length) + 1e-12);
}

function onMetadata(frames) {
  for (const f of frames) {
    history.push(f);
    state.metadataFrames += 1;
  }
  if (history.length > PLOT_FRAMES) history.splice(0, history.length - PLOT_FRAMES);
}

function stop() {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "end" }));
  else if (ws && ws.readyState === WebSocket.CONNECTING) ws.close();
  ws = null; // the stopped socket finishes on its own (tail, end, close); its messages are ignored
  if (mic) mic.getTracks().forEach((t) => t.stop());
  if (ctx && ctx.state !== "closed") ctx.close().catch(() => {});
  if (capture) capture.port.onmessage = null;
  if (playback) playback.port.onmessage = null;
  ctx = mic = capture = playback = null;
  $("start").disabled = false;
  $("stop").disabled = true;
  if (state.status === "streaming") setStatus("stopped");
}

// ------------------------------------------------------------------------------ readouts
function readouts() {
  // levels: the loudest 20 ms since the last frame, falling back by 20 dB/s (a meter's ballistics)
  for (const [k, id] of [["input", "level-in"], ["output", "level-out"]]) {
    const db = Math.max(-60, Math.min(0, level[k]));
    const shown = Number.isFinite(level[k]) ? db : -60;
    $(id).value = shown;
    $(`${id}-text`).textContent = Number.isFinite(level[k]) ? `${Math.round(level[k])} dBFS` : "–";
    state[`${k}LevelDb`] = Number.isFinite(level[k]) ? Math.round(level[k] * 10) / 10 : null;
    level[k] = Number.isFinite(level[k]) ? level[k] - 20 / 60 : level[k];
  }
  const rt = median(roundTrips);
  if (rt !== null && ctx) {
    state.roundTripMs = Math.round(rt);
    state.deviceLatencyMs = Math.round(1000 * ((ctx.baseLatency || 0) + (ctx.outputLatency || 0)));
    state.endToEndMs = state.roundTripMs + (state.playbackBufferMs || 0) + state.deviceLatencyMs;
    $("latency").textContent = `${state.endToEndMs} ms`;
    $("latency-detail").textContent = `round trip ${state.roundTripMs} ms (the model's own latency ${state.latencyMs} ms),` +
      ` playback buffer ${state.playbackBufferMs || 0} ms, audio device ${state.deviceLatencyMs} ms`;
  }
}

// ------------------------------------------------------------------------------ plot
function drawPlot() {
  const canvas = $("plot");
  const g = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height;
  g.clearRect(0, 0, W, H);
  const labelW = 70, plotW = W - labelW - 8;
  const frames = history;
  const layers = frames.length && frames[0].competition ? frames[0].competition[0].length : 0;
  const rowH = layers ? (H - 50) / layers : 0;
  const colW = plotW / PLOT_FRAMES;
  g.font = "12px system-ui, sans-serif";
  g.fillStyle = "#6b7385";
  for (let l = 0; l < layers; l++) g.fillText(`layer ${l + 1}`, 4, 20 + l * rowH + rowH / 2 + 4);
  g.fillText("activity", 4, H - 18);
  frames.forEach((f, i) => {
    const x = labelW + (PLOT_FRAMES - frames.length + i) * colW;
    for (let l = 0; l < layers; l++) {
      const p = f.competition[0][l][0]; // share of mechanism 1 (the mechanisms' scores sum to 1)
      const r = Math.round(47 + (242 - 47) * (1 - p)), gr = Math.round(91 + (140 - 91) * (1 - p)), b = Math.round(211 + (40 - 211) * (1 - p));
      g.fillStyle = `rgb(${r},${gr},${b})`;
      g.fillRect(x, 20 + l * rowH, Math.ceil(colW), rowH - 2);
    }
  });
  g.strokeStyle = "#1d2330";
  g.lineWidth = 1.5;
  g.beginPath();
  frames.forEach((f, i) => {
    const x = labelW + (PLOT_FRAMES - frames.length + i) * colW;
    const y = H - 6 - f.activity[0] * 28;
    if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
  });
  g.stroke();
  state.plottedFrames = frames.length;
  canvas.dataset.frames = String(frames.length);
}

let scaleDrawn = false;
function draw() {
  if (!$("view-live").hidden) {
    drawPlot();
    if (specIn) {
      specIn.draw();
      specOut.draw();
      state.spectrogramColumns = { input: specIn.columns, output: specOut.columns };
    }
    if (!scaleDrawn) {
      drawColourBar($("live-scale"), LIVE_RANGE_DB[0], LIVE_RANGE_DB[1]);
      scaleDrawn = true;
    }
    readouts();
  }
  requestAnimationFrame(draw);
}

// ------------------------------------------------------------------------------ wiring
$("start").addEventListener("click", start);
$("stop").addEventListener("click", stop);
document.querySelectorAll("input[name=mode]").forEach((el) => el.addEventListener("change", () => {
  state.mode = el.value;
  if (playback) playback.port.postMessage({ kind: "mode", mode: el.value });
}));
$("details").addEventListener("toggle", showResults);
window.addEventListener("resize", () => { scaleDrawn = false; });
onView(() => { scaleDrawn = false; });
specIn = new ScrollingSpectrogram($("live-in"), 48000, SPECTROGRAM_S); // empty until the microphone starts
specOut = new ScrollingSpectrogram($("live-out"), 48000, SPECTROGRAM_S);
showResults();
requestAnimationFrame(draw);
