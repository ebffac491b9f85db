// Spectrograms computed in the browser: a radix-2 FFT, short-time spectra in dB relative to full
// scale (a full-scale sine peaks at 0 dB), one colour map, and two ways to draw them: a whole file
// (FileSpectrogram) and a live stream scrolling right to left (ScrollingSpectrogram).

export const LIVE_RANGE_DB = [-100, -10]; // fixed scale of the live view (input and output alike)
export const FILE_RANGE_DB = 80; // the file view shows this many dB below the loudest bin of the original
const AXIS_W = 40, AXIS_H = 18; // px (CSS) kept for the frequency and time labels

// ------------------------------------------------------------------------------ FFT
const plans = new Map();

function plan(n) {
  if (plans.has(n)) return plans.get(n);
  const bits = Math.log2(n);
  if (!Number.isInteger(bits)) throw new Error(`FFT size ${n} is not a power of two`);
  const rev = new Uint32Array(n);
  for (let i = 0; i < n; i++) rev[i] = (rev[i >> 1] >> 1) | ((i & 1) << (bits - 1));
  const cos = new Float32Array(n / 2), sin = new Float32Array(n / 2);
  for (let i = 0; i < n / 2; i++) { cos[i] = Math.cos((2 * Math.PI * i) / n); sin[i] = -Math.sin((2 * Math.PI * i) / n); }
  const window = new Float32Array(n);
  let sum = 0;
  for (let i = 0; i < n; i++) { window[i] = 0.5 - 0.5 * Math.cos((2 * Math.PI * i) / n); sum += window[i]; }
  const p = { n, rev, cos, sin, window, re: new Float32Array(n), im: new Float32Array(n), norm: 4 / (sum * sum) };
  plans.set(n, p);
  return p;
}

/** Hann-windowed power spectrum of x[start, start + n) in dB (n/2 + 1 bins) into out[offset ...]. */
export function spectrumDb(x, start, n, out, offset = 0) {
  const { rev, cos, sin, window, re, im, norm } = plan(n);
  for (let i = 0; i < n; i++) {
    const j = start + i;
    re[rev[i]] = j >= 0 && j < x.length ? x[j] * window[i] : 0;
    im[i] = 0;
  }
  for (let size = 2; size <= n; size <<= 1) {
    const half = size >> 1, step = n / size;
    for (let i = 0; i < n; i += size) {
      for (let k = 0, t = 0; k < half; k++, t += step) {
        const a = i + k, b = a + half;
        const tr = re[b] * cos[t] - im[b] * sin[t], ti = re[b] * sin[t] + im[b] * cos[t];
        re[b] = re[a] - tr; im[b] = im[a] - ti;
        re[a] += tr; im[a] += ti;
      }
    }
  }
  for (let k = 0; k <= n / 2; k++) out[offset + k] = 10 * Math.log10((re[k] * re[k] + im[k] * im[k]) * norm + 1e-20);
}

/** FFT size for a sample rate: about 30 ms. */
export function fftSize(sampleRate) {
  return 2 ** Math.max(7, Math.min(13, Math.round(Math.log2(sampleRate * 0.03))));
}

/** The mono mix of an AudioBuffer (the mean of its channels). */
export function monoOf(buffer) {
  if (buffer.numberOfChannels === 1) return buffer.getChannelData(0);
  const out = new Float32Array(buffer.length);
  for (let c = 0; c < buffer.numberOfChannels; c++) {
    const d = buffer.getChannelData(c);
    for (let i = 0; i < d.length; i++) out[i] += d[i] / buffer.numberOfChannels;
  }
  return out;
}

/** Short-time spectra of a whole signal: at most maxCols columns (the hop grows for long files). */
export function stft(x, sampleRate, maxCols = 3000) {
  const n = fftSize(sampleRate), bins = n / 2 + 1;
  const hop = Math.max(n / 4, Math.ceil(x.length / maxCols));
  const cols = Math.max(1, Math.ceil(x.length / hop));
  const db = new Float32Array(cols * bins);
  let peak = -Infinity;
  for (let c = 0; c < cols; c++) {
    spectrumDb(x, c * hop - n / 2, n, db, c * bins); // centred on c * hop
    for (let k = 0; k < bins; k++) if (db[c * bins + k] > peak) peak = db[c * bins + k];
  }
  return { db, cols, bins, hop, n, sampleRate, length: x.length, duration: x.length / sampleRate, peak };
}

// ------------------------------------------------------------------------------ colours
// A perceptually ordered dark-to-bright map (after matplotlib's "magma"), 256 entries.
const STOPS = [[0, 0, 4], [40, 11, 84], [101, 21, 110], [159, 42, 99], [212, 72, 66], [245, 125, 21], [250, 193, 39], [252, 255, 164]];
export const LUT = (() => {
  const lut = new Uint8ClampedArray(256 * 3);
  for (let i = 0; i < 256; i++) {
    const t = (i / 255) * (STOPS.length - 1), k = Math.min(STOPS.length - 2, Math.floor(t)), f = t - k;
    for (let c = 0; c < 3; c++) lut[i * 3 + c] = STOPS[k][c] + (STOPS[k + 1][c] - STOPS[k][c]) * f;
  }
  return lut;
})();

function colour(db, lo, hi) {
  const i = Math.max(0, Math.min(255, Math.round(((db - lo) / (hi - lo)) * 255)));
  return i * 3;
}

/** Draws the colour scale from lo to hi dB into a canvas (a horizontal bar with labels). */
export function drawColourBar(canvas, lo, hi) {
  const { g, W, H } = fitCanvas(canvas);
  g.clearRect(0, 0, W, H);
  const barH = Math.max(6, H - 16);
  for (let x = 0; x < W; x++) {
    const j = Math.round((x / Math.max(1, W - 1)) * 255) * 3;
    g.fillStyle = `rgb(${LUT[j]},${LUT[j + 1]},${LUT[j + 2]})`;
    g.fillRect(x, 0, 1, barH);
  }
  g.fillStyle = "#4a5264";
  g.font = "11px system-ui, sans-serif";
  g.textBaseline = "bottom";
  g.textAlign = "left";
  g.fillText(`${Math.round(lo)} dB`, 0, H);
  g.textAlign = "right";
  g.fillText(`${Math.round(hi)} dB`, W, H);
  g.textAlign = "center";
  g.fillText("dBFS", W / 2, H);
}

// ------------------------------------------------------------------------------ drawing helpers
/** Sizes the canvas' backing store to its CSS box (device pixels) and returns a context in CSS px. */
export function fitCanvas(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const W = Math.max(1, Math.round(canvas.clientWidth)), H = Math.max(1, Math.round(canvas.clientHeight));
  if (canvas.width !== Math.round(W * dpr) || canvas.height !== Math.round(H * dpr)) {
    canvas.width = Math.round(W * dpr);
    canvas.height = Math.round(H * dpr);
  }
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  return { g, W, H };
}

function image(cols, bins, db, lo, hi, maxRows = 512) {
  // rows: frequency bins from the top (Nyquist) down to 0 Hz; at most maxRows (max of the bins merged)
  const rows = Math.min(bins, maxRows), per = bins / rows;
  const off = document.createElement("canvas");
  off.width = cols;
  off.height = rows;
  const g = off.getContext("2d");
  const img = g.createImageData(cols, rows);
  for (let c = 0; c < cols; c++) {
    for (let r = 0; r < rows; r++) {
      const k0 = Math.floor((rows - 1 - r) * per), k1 = Math.max(k0 + 1, Math.floor((rows - r) * per));
      let v = -Infinity;
      for (let k = k0; k < k1 && k < bins; k++) v = Math.max(v, db[c * bins + k]);
      const j = colour(v, lo, hi), p = (r * cols + c) * 4;
      img.data[p] = LUT[j]; img.data[p + 1] = LUT[j + 1]; img.data[p + 2] = LUT[j + 2]; img.data[p + 3] = 255;
    }
  }
  g.putImageData(img, 0, 0);
  return off;
}

function frequencyAxis(g, x0, y0, h, nyquist) {
  g.fillStyle = "#4a5264";
  g.font = "11px system-ui, sans-serif";
  g.textAlign = "right";
  g.textBaseline = "middle";
  const khz = nyquist / 1000, step = khz > 16 ? 8 : khz > 6 ? 2 : 1;
  for (let f = 0; f <= khz + 1e-9; f += step) {
    const y = y0 + h - (f / khz) * h;
    g.fillText(f === 0 ? "0" : `${f}k`, x0 - 4, Math.max(y0 + 5, Math.min(y0 + h - 5, y)));
  }
  g.save();
  g.translate(9, y0 + h / 2);
  g.rotate(-Math.PI / 2);
  g.textAlign = "center";
  g.fillText("Hz", 0, 0);
  g.restore();
}

function timeAxis(g, x0, y0, w, seconds, fromEnd = false) {
  g.fillStyle = "#4a5264";
  g.font = "11px system-ui, sans-serif";
  g.textBaseline = "top";
  const steps = [0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1200];
  const step = steps.find((s) => (w / seconds) * s >= 60) || 1800;
  for (let t = 0; t <= seconds + 1e-9; t += step) {
    const x = x0 + (t / seconds) * w;
    g.textAlign = t === 0 ? "left" : x > x0 + w - 20 ? "right" : "center";
    const label = fromEnd ? (t === seconds ? "now" : `-${(seconds - t).toFixed(step < 1 ? 1 : 0)} s`) : clock(t, step);
    g.fillText(label, x, y0 + 3);
  }
}

export function clock(t, step = 1) {
  if (t < 60) return `${t.toFixed(step < 1 ? 1 : 0)} s`;
  if (t >= 3600 && t % 3600 === 0) return `${t / 3600} h`;
  const m = Math.floor(t / 60), s = Math.floor(t - m * 60);
  return `${m}:${String(s).padStart(2, "0")}`;
}

// ------------------------------------------------------------------------------ a whole file
/** One file's spectrogram on a canvas, with frequency and time axes and a play head. Two instances
 * given the same range and duration are time-aligned and on the same dB scale. */
export class FileSpectrogram {
  constructor(canvas) {
    this.canvas = canvas;
    this.spec = null;
    this.img = null;
    this.duration = 0;
  }

  set(spec, lo, hi, duration) {
    this.spec = spec;
    this.duration = duration;
    this.img = spec ? image(spec.cols, spec.bins, spec.db, lo, hi) : null;
    this.canvas.dataset.columns = spec ? String(spec.cols) : "0";
  }

  /** The plot area in CSS px (for mapping clicks to time). */
  area() {
    const W = this.canvas.clientWidth, H = this.canvas.clientHeight;
    return { x: AXIS_W, y: 2, w: Math.max(1, W - AXIS_W - 4), h: Math.max(1, H - AXIS_H - 2) };
  }

  draw(position = null) {
    const { g, W, H } = fitCanvas(this.canvas);
    g.clearRect(0, 0, W, H);
    if (!this.img) return;
    const a = this.area(), spec = this.spec;
    const w = (a.w * spec.duration) / this.duration; // a shorter decode of the same file keeps its time scale
    g.imageSmoothingEnabled = true;
    g.drawImage(this.img, a.x, a.y, w, a.h);
    frequencyAxis(g, a.x, a.y, a.h, spec.sampleRate / 2);
    timeAxis(g, a.x, a.y + a.h, a.w, this.duration);
    if (position !== null) {
      const x = a.x + (Math.min(position, this.duration) / this.duration) * a.w;
      g.fillStyle = "#ffffff";
      g.fillRect(x - 1, a.y, 2, a.h);
    }
  }
}

// ------------------------------------------------------------------------------ a live stream
/** A spectrogram of audio pushed as it comes, scrolling right to left over `seconds`. */
export class ScrollingSpectrogram {
  constructor(canvas, sampleRate, seconds = 5, [lo, hi] = LIVE_RANGE_DB) {
    this.canvas = canvas;
    this.sampleRate = sampleRate;
    this.n = fftSize(sampleRate);
    this.hop = this.n / 2;
    this.bins = this.n / 2 + 1;
    this.lo = lo; this.hi = hi;
    this.cols = Math.ceil((seconds * sampleRate) / this.hop);
    this.seconds = (this.cols * this.hop) / sampleRate;
    this.rows = Math.min(this.bins, 256);
    this.buf = new Float32Array(this.n * 4); // samples not yet analysed (from `start` on)
    this.fill = 0;
    this.col = new Float32Array(this.bins);
    this.img = document.createElement("canvas");
    this.img.width = this.cols;
    this.img.height = this.rows;
    const g = this.img.getContext("2d");
    g.fillStyle = `rgb(${LUT[0]},${LUT[1]},${LUT[2]})`;
    g.fillRect(0, 0, this.cols, this.rows);
    this.pending = []; // columns computed since the last draw
    this.columns = 0; // columns drawn so far
  }

  push(samples) {
    if (this.fill + samples.length > this.buf.length) {
      const grown = new Float32Array(Math.max(this.buf.length * 2, this.fill + samples.length));
      grown.set(this.buf.subarray(0, this.fill));
      this.buf = grown;
    }
    this.buf.set(samples, this.fill);
    this.fill += samples.length;
    let start = 0;
    while (start + this.n <= this.fill) {
      spectrumDb(this.buf, start, this.n, this.col);
      this.pending.push(this.column(this.col));
      start += this.hop;
    }
    if (start) {
      this.buf.copyWithin(0, start, this.fill);
      this.fill -= start;
    }
    if (this.pending.length > this.cols) this.pending.splice(0, this.pending.length - this.cols);
  }

  column(db) {
    const rows = this.rows, per = this.bins / rows, px = new Uint8ClampedArray(rows * 4);
    for (let r = 0; r < rows; r++) {
      const k0 = Math.floor((rows - 1 - r) * per), k1 = Math.max(k0 + 1, Math.floor((rows - r) * per));
      let v = -Infinity;
      for (let k = k0; k < k1 && k < this.bins; k++) v = Math.max(v, db[k]);
      const j = colour(v, this.lo, this.hi);
      px[r * 4] = LUT[j]; px[r * 4 + 1] = LUT[j + 1]; px[r * 4 + 2] = LUT[j + 2]; px[r * 4 + 3] = 255;
    }
    return px;
  }

  draw() {
    const k = this.pending.length;
    if (k) {
      const g = this.img.getContext("2d");
      g.drawImage(this.img, -k, 0); // scroll left by the new columns
      const img = g.createImageData(k, this.rows);
      this.pending.forEach((px, c) => {
        for (let r = 0; r < this.rows; r++) img.data.set(px.subarray(r * 4, r * 4 + 4), (r * k + c) * 4);
      });
      g.putImageData(img, this.cols - k, 0);
      this.columns += k;
      this.pending = [];
    }
    const { g, W, H } = fitCanvas(this.canvas);
    g.clearRect(0, 0, W, H);
    const a = { x: AXIS_W, y: 2, w: Math.max(1, W - AXIS_W - 4), h: Math.max(1, H - AXIS_H - 2) };
    g.imageSmoothingEnabled = true;
    g.drawImage(this.img, a.x, a.y, a.w, a.h);
    frequencyAxis(g, a.x, a.y, a.h, this.sampleRate / 2);
    timeAxis(g, a.x, a.y + a.h, a.w, Math.round(this.seconds), true);
    this.canvas.dataset.columns = String(this.columns);
  }
}
