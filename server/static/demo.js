// Live view: the microphone through the service's websocket /v1/stream with the service's own
// browser module (/client.js: capture, reconnect and resume, sample-aligned playback), with live
// spectrograms of the input and the output, level meters, the latency measured end to end and a
// plot of the competition scores the server sends as metadata. No build step: plain modern JavaScript.
import { EnhancedStream } from "/client.js";
import { $, apiKey, onView, showKey } from "./common.js";
import { LIVE_RANGE_DB, ScrollingSpectrogram, drawColourBar } from "./spectrogram.js";

const PLOT_FRAMES = 240; // frames (16 ms each) visible in the plot: about 4 s
const SPECTROGRAM_S = 5; // seconds visible in the live spectrograms

// Everything the page knows, readable by tests and shown under "Details".
const state = (window.demoState = {
  status: "idle", error: null, sampleRate: 0, latencyMs: null, atten: null, band: null, level: null, chunksSent: 0,
  enhancedMessages: 0, enhancedSamples: 0, metadataFrames: 0, plottedFrames: 0, mode: "enhanced",
  roundTripMs: null, playbackBufferMs: null, deviceLatencyMs: null, endToEndMs: null,
  inputLevelDb: null, outputLevelDb: null, spectrogramColumns: { input: 0, output: 0 }, sessions: 0,
});

let stream = null, mic = null;
const history = []; // recent metadata frames for the plot
let specIn = null, specOut = null;
let fresh = false; // a new stream: its spectrograms start empty
let sent = []; // [input samples sent after the chunk, time it was sent] of chunks not yet enhanced
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
    mic = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
    });
    const atten = $("atten").value;
    const s = (stream = new EnhancedStream(mic, {
      apiKey: apiKey(), atten_lim_db: atten === "" ? null : Number(atten), band: $("band").value,
      level: $("level").value, metadata: true,
    }));
    wire(s);
    sent = [];
    roundTrips = [];
    fresh = true;
    await s.start();
    if (stream !== s) return; // stopped while connecting
    s.monitor(state.mode);
    $("stop").disabled = false;
  } catch (err) {
    if (err.kind === "unauthorized" || err.kind === "forbidden") showKey(true);
    setStatus("error", err.message || String(err));
    stop();
  }
}

/** The page's handlers of stream `s`. Each belongs to its own stream: after Stop the old one still
 * delivers the enhanced tail and its end, which must not reach a stream started since. */
function wire(s) {
  const on = (type, fn) => s.addEventListener(type, (e) => { if (stream === s) fn(e.detail); });
  on("ready", (msg) => {
    state.latencyMs = msg.latency_ms;
    state.atten = msg.atten_lim_db;
    state.band = msg.band; // as the server took it: "full" keeps the band above 8 kHz (input above 16 kHz)
    state.level = msg.level;
    state.sessions = s.sessions;
    $("info").textContent = `${msg.sample_rate} Hz · algorithmic latency ${msg.latency_ms} ms` +
      (msg.band === "speech" ? " · speech band (nothing above 8 kHz)" : "") +
      (msg.level === "input" ? " · voice at the input's level" : "");
    setStatus("streaming");
  });
  on("input", ({ samples, total }) => onInput(samples, total, s.sampleRate));
  on("audio", ({ samples, total }) => onAudio(samples, total, s.sampleRate));
  on("metadata", ({ frames }) => onMetadata(frames));
  on("queue", ({ enhancedMs }) => { state.playbackBufferMs = Math.round(enhancedMs); });
  on("state", ({ state: now, code, message }) => {
    if (now === "waiting") setStatus("waiting", message);
    else if (now === "reconnecting" && state.status === "streaming") setStatus("reconnecting", `connection closed (${code})`);
  });
  on("error", (err) => {
    if (err.kind === "unauthorized" || err.kind === "forbidden") showKey(true);
    if (state.status !== "starting") setStatus("closed", err.message);
  });
}

function onInput(samples, total, rate) {
  if (fresh || specIn.sampleRate !== rate) { // a new stream, at the microphone's rate
    fresh = false;
    specIn = new ScrollingSpectrogram($("live-in"), rate, SPECTROGRAM_S);
    specOut = new ScrollingSpectrogram($("live-out"), rate, SPECTROGRAM_S);
  }
  state.sampleRate = rate;
  sent.push([total, performance.now()]);
  state.chunksSent += 1;
  level.input = Math.max(rmsDb(samples), level.input);
  specIn.push(samples);
}

function onAudio(samples, total, rate) {
  state.enhancedMessages += 1;
  state.enhancedSamples += samples.length;
  measureRoundTrip(total, rate);
  level.output = Math.max(rmsDb(samples), level.output);
  specOut.push(samples);
  if (state.enhancedMessages % 10 === 0) showResults();
}

/** Output sample i is the enhanced input sample i: the newest sample of this message went into the
 * capture worklet (end of its chunk - its place in the chunk) before its chunk was sent. */
function measureRoundTrip(samplesOut, rate) {
  while (sent.length && sent[0][0] < samplesOut) sent.shift();
  if (!sent.length) return;
  const [end, t] = sent[0];
  const waited = (1000 * (end - samplesOut)) / rate; // in the capture chunk before it was sent
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
  const s = stream;
  stream = null; // the stopped stream finishes on its own (tail, end, close); its events are ignored
  if (s) {
    if (s.state === "streaming") s.stop(); // the rest of the output comes, then the end
    else s.close(); // connecting, waiting or reconnecting: nothing more to wait for
  }
  if (mic) mic.getTracks().forEach((t) => t.stop());
  mic = null;
  $("start").disabled = false;
  $("stop").disabled = true;
  if (["streaming", "starting", "reconnecting", "waiting"].includes(state.status)) setStatus("stopped");
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
  const ctx = stream && stream.context;
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
  if (stream) stream.monitor(el.value);
}));
$("details").addEventListener("toggle", showResults);
window.addEventListener("resize", () => { scaleDrawn = false; });
onView(() => { scaleDrawn = false; });
specIn = new ScrollingSpectrogram($("live-in"), 48000, SPECTROGRAM_S); // empty until the microphone starts
specOut = new ScrollingSpectrogram($("live-out"), 48000, SPECTROGRAM_S);
showResults();
requestAnimationFrame(draw);
