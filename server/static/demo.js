// Browser demo: microphone -> AudioWorklet -> websocket /v1/stream -> playback, with a live plot of
// the competition scores the server sends as metadata. No build step: plain modern JavaScript.
"use strict";

const CHUNK_MS = 20;
const PLOT_FRAMES = 240; // frames (16 ms each) visible in the plot: about 4 s

// Everything the page knows, readable by tests and the results panel.
const state = (window.demoState = {
  status: "idle", error: null, sampleRate: 0, latencyMs: null, chunksSent: 0,
  enhancedMessages: 0, enhancedSamples: 0, metadataFrames: 0, plottedFrames: 0, mode: "enhanced",
});

const $ = (id) => document.getElementById(id);
let ctx = null, ws = null, mic = null, capture = null, playback = null;
const history = []; // recent metadata frames for the plot

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
    const silent = ctx.createGain();
    silent.gain.value = 0;
    ctx.createMediaStreamSource(mic).connect(capture).connect(silent).connect(ctx.destination);
    playback.connect(ctx.destination);
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
  const key = $("api-key").value.trim();
  if (key) url.searchParams.set("api_key", key);
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
      atten_lim_db: atten === "" ? null : Number(atten), metadata: true,
    }));
    sock.onmessage = (e) => {
      if (sock !== ws) return; // a stopped stream's tail: nobody listens to it any more
      if (typeof e.data !== "string") return onAudio(e.data);
      const msg = JSON.parse(e.data);
      if (msg.type === "ready") {
        state.latencyMs = msg.latency_ms;
        $("info").textContent = `${msg.sample_rate} Hz · algorithmic latency ${msg.latency_ms} ms`;
        setStatus("streaming");
        resolve();
      } else if (msg.type === "metadata") {
        onMetadata(msg.frames);
      } else if (msg.type === "error") {
        if (msg.kind === "unauthorized" || msg.kind === "forbidden") $("key-label").hidden = false;
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
  playback.port.postMessage({ kind: "original", samples });
  state.chunksSent += 1;
}

function onAudio(buffer) {
  const samples = new Float32Array(buffer);
  state.enhancedMessages += 1;
  state.enhancedSamples += samples.length;
  if (!playback) return; // stopped: the tail of the stream arrives after playback has ended
  playback.port.postMessage({ kind: "enhanced", samples }, [samples.buffer]);
  if (state.enhancedMessages % 10 === 0) showResults();
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
  if (ctx) ctx.close();
  ctx = mic = capture = playback = null;
  $("start").disabled = false;
  $("stop").disabled = true;
  if (state.status === "streaming") setStatus("stopped");
}

// ------------------------------------------------------------------------------ plot
function draw() {
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
  requestAnimationFrame(draw);
}

// ------------------------------------------------------------------------------ wiring
$("start").addEventListener("click", start);
$("stop").addEventListener("click", stop);
document.querySelectorAll("input[name=mode]").forEach((el) => el.addEventListener("change", () => {
  state.mode = el.value;
  if (playback) playback.port.postMessage({ kind: "mode", mode: el.value });
}));
fetch("/readyz").then((r) => r.json()).then((r) => {
  if (r.limits && r.limits.auth) $("key-label").hidden = false;
  if (r.model) $("info").textContent = `model ${r.model} on ${r.provider}`;
}).catch(() => {});
showResults();
requestAnimationFrame(draw);
