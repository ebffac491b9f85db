// File view: drop or choose a recording -> POST /v1/enhance (upload progress) -> A/B player of the
// original and the enhanced audio (same position when switching), both spectrograms on one scale,
// and the enhanced file to download exactly as the server returned it (the input's format).
import { $, apiKey, bytes, errorInWords, server, serverInfo, showKey } from "./common.js";
import { FILE_RANGE_DB, FileSpectrogram, clock, drawColourBar, monoOf, stft } from "./spectrogram.js";

// Everything the view knows, readable by tests.
const state = (window.fileState = {
  status: "idle", error: null, name: null, size: 0, atten: null, band: "full", level: "model", uploadProgress: 0, runs: 0,
  sampleRate: null, channels: null, frames: null, durationS: null, format: null, contentType: null,
  enhancedBytes: 0, downloadName: null, enhanceMs: null, decoded: { original: false, enhanced: false },
  columns: { original: 0, enhanced: 0 }, listen: "enhanced", playing: false, position: 0, switches: 0,
  statuses: [], // every status the view went through, in order
});

let file = null; // the chosen File
let request = null; // the XMLHttpRequest in flight
let run = 0; // the current enhancement: a newer file or limit makes older results stale
let downloadUrl = null;
let original = null; // { buffer, spec } of the current file, decoded once per file
let enhanced = null;
const specs = { original: new FileSpectrogram($("spec-original")), enhanced: new FileSpectrogram($("spec-enhanced")) };
let scale = null; // [lo, hi] dB shared by both spectrograms

serverInfo.then(() => {
  const l = server.limits;
  if (l) $("file-limits").textContent = `; up to ${bytes(l.max_upload_bytes)} and ${clock(l.max_duration_s)} on this server`;
});

// ------------------------------------------------------------------------------ choosing a file
const input = $("file"), drop = $("drop");
drop.addEventListener("click", () => input.click());
input.addEventListener("change", () => {
  if (input.files.length) choose(input.files[0]);
  input.value = ""; // choosing the same file again is a change too
});

// Files may be dropped on the drop zone or anywhere in the file view; elsewhere the browser must not
// open them instead of the page.
let dragDepth = 0;
document.addEventListener("dragenter", (e) => {
  if (!hasFiles(e)) return;
  dragDepth += 1;
  drop.classList.add("over");
});
document.addEventListener("dragleave", () => {
  dragDepth = Math.max(0, dragDepth - 1);
  if (!dragDepth) drop.classList.remove("over");
});
document.addEventListener("dragover", (e) => {
  if (!hasFiles(e)) return;
  e.preventDefault();
  e.dataTransfer.dropEffect = $("view-file").hidden ? "none" : "copy";
});
document.addEventListener("drop", (e) => {
  if (!hasFiles(e)) return;
  e.preventDefault();
  dragDepth = 0;
  drop.classList.remove("over");
  if (!$("view-file").hidden && e.dataTransfer.files.length) choose(e.dataTransfer.files[0]);
});

function hasFiles(e) {
  return !!e.dataTransfer && Array.from(e.dataTransfer.types || []).includes("Files");
}

function choose(f) {
  file = f;
  original = enhanced = null;
  scale = null;
  player.reset();
  Object.assign(state, {
    name: f.name, size: f.size, runs: 0, sampleRate: null, channels: null, frames: null, durationS: null,
    format: null, decoded: { original: false, enhanced: false }, columns: { original: 0, enhanced: 0 },
  });
  $("file-result").hidden = true;
  enhance();
}

$("file-atten").addEventListener("change", () => {
  if (file) enhance(); // the same file again with the new limit
});
$("file-band").addEventListener("change", () => {
  if (file) enhance(); // the same file again with the other band
});
$("file-level").addEventListener("change", () => {
  if (file) enhance(); // the same file again at the other level
});

// ------------------------------------------------------------------------------ upload
function enhance() {
  if (request) request.abort();
  const mine = ++run;
  hideError();
  const atten = $("file-atten").value;
  state.atten = atten === "" ? null : Number(atten);
  const limit = server.limits && server.limits.max_upload_bytes;
  if (limit && file.size > limit) {
    return fail(413, { error: { kind: "too_large", message: `the file is ${bytes(file.size)}; this server accepts uploads up to ${bytes(limit)}` } });
  }
  const url = new URL("/v1/enhance", location.href);
  url.search = "";
  if (state.atten !== null) url.searchParams.set("atten_lim_db", String(state.atten));
  state.band = $("file-band").value;
  if (state.band !== "full") url.searchParams.set("band", state.band);
  state.level = $("file-level").value;
  if (state.level !== "model") url.searchParams.set("level", state.level);
  const xhr = (request = new XMLHttpRequest());
  xhr.open("POST", url);
  xhr.responseType = "arraybuffer";
  // the server reads the format from the bytes; an unknown or non-audio type goes as octet-stream
  xhr.setRequestHeader("Content-Type", file.type.startsWith("audio/") ? file.type : "application/octet-stream");
  if (apiKey()) xhr.setRequestHeader("X-API-Key", apiKey());
  const t0 = performance.now();
  progress("uploading", 0, `Uploading ${file.name} (${bytes(file.size)})`);
  xhr.upload.onprogress = (e) => {
    if (e.lengthComputable) progress("uploading", e.loaded / e.total, `Uploading ${file.name}: ${Math.round((100 * e.loaded) / e.total)} %`);
  };
  xhr.upload.onload = () => progress("enhancing", null, "Enhancing on the server");
  xhr.onprogress = (e) => {
    if (e.lengthComputable && e.total) progress("downloading", e.loaded / e.total, "Receiving the enhanced file");
  };
  xhr.onerror = () => { if (xhr === request) fail(0, null); };
  xhr.onload = () => {
    if (xhr !== request) return;
    request = null;
    state.uploadProgress = 1;
    if (xhr.status !== 200) return fail(xhr.status, parseJson(xhr.response), xhr.getResponseHeader("Retry-After"));
    state.enhanceMs = Math.round(performance.now() - t0);
    received(xhr, mine).catch((err) => { if (mine === run) fail(-1, { error: { message: err.message || String(err) } }); });
  };
  xhr.send(file);
}

function parseJson(buffer) {
  try {
    return JSON.parse(new TextDecoder().decode(buffer));
  } catch {
    return null;
  }
}

function setStatus(status) {
  state.status = status;
  if (state.statuses[state.statuses.length - 1] !== status) state.statuses.push(status);
}

function progress(status, fraction, text) {
  setStatus(status);
  if (status === "uploading" && fraction !== null) state.uploadProgress = fraction;
  const bar = $("file-progress");
  if (fraction === null) bar.removeAttribute("value"); // indeterminate while the server works
  else bar.value = fraction;
  $("file-progress-label").textContent = { uploading: "Upload", enhancing: "Enhancing", downloading: "Download" }[status] || "Analysing";
  $("file-progress-box").hidden = false;
  $("file-status").textContent = text;
}

function fail(status, body, retryAfter = null) {
  request = null;
  const [title, text] = status === -1 ? ["Something went wrong in the page", body.error.message] : errorInWords(status, body, retryAfter);
  setStatus("error");
  state.error = { status, kind: (body && body.error && body.error.kind) || null, title, text };
  $("file-progress-box").hidden = true;
  $("file-status").textContent = "";
  $("file-error-title").textContent = title;
  $("file-error-text").textContent = text;
  $("file-error").hidden = false;
  if (status === 401 || status === 403) showKey(true);
}

function hideError() {
  state.error = null;
  $("file-error").hidden = true;
}

// ------------------------------------------------------------------------------ result
async function received(xhr, mine) {
  const body = xhr.response; // the enhanced file, exactly as the server sent it
  const type = xhr.getResponseHeader("Content-Type") || "application/octet-stream";
  const ext = (/filename="?[^".]*\.([A-Za-z0-9]+)"?/.exec(xhr.getResponseHeader("Content-Disposition") || "") || [])[1] || "wav";
  const rate = Number(xhr.getResponseHeader("X-Sample-Rate")), channels = Number(xhr.getResponseHeader("X-Channels"));
  const frames = Number(xhr.getResponseHeader("X-Frames"));
  if (downloadUrl) URL.revokeObjectURL(downloadUrl);
  downloadUrl = URL.createObjectURL(new Blob([body], { type }));
  const stem = file.name.replace(/\.[^.]*$/, "") || "recording";
  const name = `${stem}-enhanced${state.atten !== null ? `-${state.atten}dB` : ""}${state.band === "speech" ? "-speech" : ""}${state.level === "input" ? "-level" : ""}.${ext}`;
  const link = $("download");
  link.href = downloadUrl;
  link.download = name;
  Object.assign(state, {
    sampleRate: rate, channels, frames, durationS: frames / rate, format: ext.toUpperCase(), contentType: type,
    enhancedBytes: body.byteLength, downloadName: name,
  });
  progress("decoding", null, "Drawing the spectrograms");
  const first = !original;
  if (first) {
    const decoded = await analyse(await file.arrayBuffer(), rate);
    if (mine !== run) return; // another file or limit was chosen meanwhile
    original = decoded;
    state.decoded.original = !!original.buffer;
  }
  const decoded = await analyse(body.slice(0), rate);
  if (mine !== run) return;
  enhanced = decoded;
  state.decoded.enhanced = !!enhanced.buffer;
  if (!scale && original.spec) {
    const hi = 5 * Math.ceil(Math.max(original.spec.peak, -60) / 5);
    scale = [hi - FILE_RANGE_DB, hi];
  }
  const duration = Math.max(original.buffer ? original.buffer.duration : 0, enhanced.buffer ? enhanced.buffer.duration : 0) || frames / rate;
  for (const [k, a] of [["original", original], ["enhanced", enhanced]]) {
    const [lo, hi] = scale || [-100, -10];
    if (first || k === "enhanced") specs[k].set(a.spec, lo, hi, duration);
    state.columns[k] = a.spec ? a.spec.cols : 0;
  }
  if (scale) drawColourBar($("file-scale"), scale[0], scale[1]);
  player.load(original.buffer, enhanced.buffer);
  // what the browser could not decode (e.g. AIFF, CAF, W64 in Chromium) is still enhanced and downloadable
  const playable = !!(original.buffer || enhanced.buffer);
  const failed = [["original", original], ["enhanced", enhanced]].filter(([, a]) => !a.buffer).map(([k]) => k);
  $("play-note").textContent = !failed.length ? "" : `This browser cannot decode ${ext.toUpperCase()} audio, so it cannot ` +
    `play or draw the ${failed.join(" and the ")} file${failed.length > 1 ? "s" : ""}; the download works.`;
  $("play-note").hidden = !failed.length;
  for (const id of ["play", "seek", "ab-original", "ab-enhanced"]) $(id).disabled = !playable;
  $("spectrograms").hidden = !playable;

  $("file-info").textContent = `${file.name} · ${rate} Hz · ${channels === 1 ? "mono" : channels === 2 ? "stereo" : `${channels} channels`}` +
    ` · ${clock(frames / rate, 0.1)} · ${ext.toUpperCase()} · enhanced in ${(state.enhanceMs / 1000).toFixed(1)} s` +
    (state.atten !== null ? ` with an attenuation limit of ${state.atten} dB` : "") +
    (state.band === "speech" && rate > 16000 ? ", speech band only (nothing above 8 kHz)" : "") +
    (channels > 1 ? " (spectrograms of the channels' mix)" : "");
  $("file-result").hidden = false;
  $("file-progress-box").hidden = true;
  $("file-status").textContent = "";
  state.runs += 1;
  setStatus("ready");
  update();
}

/** Decodes a file at its own sample rate and computes its spectrogram (both null if the browser
 * cannot decode the format; the download still works). */
async function analyse(bytesBuffer, rate) {
  let ctx;
  try {
    ctx = new OfflineAudioContext(1, 1, rate >= 3000 && rate <= 768000 ? rate : 48000);
  } catch {
    ctx = new OfflineAudioContext(1, 1, 48000);
  }
  try {
    const buffer = await ctx.decodeAudioData(bytesBuffer);
    return { buffer, spec: stft(monoOf(buffer), buffer.sampleRate) };
  } catch {
    return { buffer: null, spec: null };
  }
}

// ------------------------------------------------------------------------------ A/B player
/** Both recordings play at once, sample-aligned, each through its own gain: switching turns one up
 * and the other down, so the position never jumps. */
class ABPlayer {
  constructor() {
    this.ctx = null;
    this.buffers = { original: null, enhanced: null };
    this.nodes = null;
    this.mode = state.listen;
    this.offset = 0;
    this.startedAt = 0;
    this.playing = false;
  }

  get duration() {
    return Math.max(this.buffers.original ? this.buffers.original.duration : 0, this.buffers.enhanced ? this.buffers.enhanced.duration : 0);
  }

  reset() {
    this.stopNodes();
    this.playing = false;
    this.offset = 0;
    this.buffers = { original: null, enhanced: null };
  }

  /** New buffers (a re-run keeps the position and, if playing, goes on playing). */
  load(originalBuffer, enhancedBuffer) {
    const was = this.playing, pos = this.position();
    this.stopNodes();
    this.buffers = { original: originalBuffer, enhanced: enhancedBuffer };
    this.offset = Math.min(pos, this.duration);
    if (was) this.start(this.offset);
  }

  async play() {
    if (!this.duration) return;
    if (!this.ctx) this.ctx = new AudioContext();
    if (this.ctx.state === "suspended") await this.ctx.resume();
    if (this.offset >= this.duration - 0.01) this.offset = 0;
    this.start(this.offset);
  }

  start(offset) {
    const t0 = this.ctx.currentTime + 0.03;
    this.nodes = {};
    for (const k of ["original", "enhanced"]) {
      const buffer = this.buffers[k];
      if (!buffer) continue;
      const src = this.ctx.createBufferSource();
      src.buffer = buffer;
      const gain = this.ctx.createGain();
      gain.gain.value = k === this.mode ? 1 : 0;
      src.connect(gain).connect(this.ctx.destination);
      src.start(t0, Math.min(offset, buffer.duration));
      this.nodes[k] = { src, gain };
    }
    this.startedAt = t0;
    this.offset = offset;
    this.playing = true;
  }

  pause() {
    if (!this.playing) return;
    this.offset = this.position();
    this.stopNodes();
    this.playing = false;
  }

  stopNodes() {
    if (!this.nodes) return;
    for (const { src, gain } of Object.values(this.nodes)) {
      src.stop();
      src.disconnect();
      gain.disconnect();
    }
    this.nodes = null;
  }

  seek(t) {
    t = Math.max(0, Math.min(t, this.duration));
    if (this.playing) {
      this.stopNodes();
      this.start(t);
    } else {
      this.offset = t;
    }
  }

  setMode(mode) {
    this.mode = mode;
    if (!this.nodes) return;
    for (const [k, { gain }] of Object.entries(this.nodes)) gain.gain.setTargetAtTime(k === mode ? 1 : 0, this.ctx.currentTime, 0.004);
  }

  position() {
    if (!this.playing) return this.offset;
    return Math.max(0, Math.min(this.offset + Math.max(0, this.ctx.currentTime - this.startedAt), this.duration));
  }
}

const player = (window.filePlayer = new ABPlayer());

$("play").addEventListener("click", async () => {
  if (player.playing) player.pause();
  else await player.play();
  update();
});
document.querySelectorAll("input[name=ab]").forEach((el) => el.addEventListener("change", () => {
  if (!el.checked) return;
  state.listen = el.value;
  state.switches += 1;
  player.setMode(el.value);
  update();
}));
const seek = $("seek");
let seeking = false;
seek.addEventListener("pointerdown", () => { seeking = true; });
seek.addEventListener("pointerup", () => { seeking = false; });
seek.addEventListener("input", () => {
  player.seek(Number(seek.value));
  update();
});
for (const canvas of [$("spec-original"), $("spec-enhanced")]) {
  canvas.addEventListener("click", async (e) => {
    const spec = specs[canvas.id === "spec-original" ? "original" : "enhanced"], a = spec.area();
    const x = e.clientX - canvas.getBoundingClientRect().left;
    if (!player.duration || x < a.x || x > a.x + a.w) return;
    player.seek(((x - a.x) / a.w) * player.duration);
    if (!player.playing) await player.play();
    update();
  });
}

function update() {
  const pos = player.position(), dur = player.duration;
  if (player.playing && pos >= dur) player.pause();
  state.playing = player.playing;
  state.position = player.position();
  $("play").textContent = player.playing ? "Pause" : "Play";
  $("play").setAttribute("aria-pressed", String(player.playing));
  seek.max = String(dur || 1);
  if (!seeking) seek.value = String(state.position);
  const text = `${clock(state.position, 0.1)} / ${clock(dur, 0.1)}`;
  $("time").textContent = text;
  seek.setAttribute("aria-valuetext", text);
  drawAll();
}

function drawAll() {
  if ($("view-file").hidden || $("file-result").hidden) return;
  const pos = player.duration ? player.position() : null;
  specs.original.draw(pos);
  specs.enhanced.draw(pos);
  if (scale) drawColourBar($("file-scale"), scale[0], scale[1]);
}

function tick() {
  if (player.playing) update();
  requestAnimationFrame(tick);
}
requestAnimationFrame(tick);
window.addEventListener("resize", drawAll);
window.addEventListener("hashchange", drawAll);
