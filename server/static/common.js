// What the views share: the element lookup, the API key (typed in, or `?api_key=` in the page's
// address), the server's limits from /readyz, the two views (#file, #live) and errors in words.

export const $ = (id) => document.getElementById(id);

const keyInput = $("api-key");
const fromAddress = new URLSearchParams(location.search).get("api_key");
if (fromAddress) {
  keyInput.value = fromAddress;
  showKey();
  $("docs").href = `/docs?${new URLSearchParams({ api_key: fromAddress })}`; // GET: the query key works
}

/** The API key to send ("" when none). */
export function apiKey() {
  return keyInput.value.trim();
}

/** Shows the API key field (the server wants a key); `focus` moves the keyboard there. */
export function showKey(focus = false) {
  $("key-label").hidden = false;
  if (focus) keyInput.focus();
}

// The server's limits and model, once /readyz answered (public: no key needed).
export const server = { ready: null, limits: null };
export const serverInfo = fetch("/readyz")
  .then((r) => r.json())
  .then((r) => {
    server.ready = r;
    server.limits = r.limits || null;
    if (r.limits && r.limits.auth) showKey();
    if (r.model) $("model").textContent = `model ${r.model} on ${r.provider}`;
    return r;
  })
  .catch(() => null);

export function bytes(n) {
  if (n >= 1024 * 1024) return `${(n / (1024 * 1024)).toFixed(1)} MB`;
  if (n >= 1024) return `${Math.round(n / 1024)} kB`;
  return `${n} bytes`;
}

/** An error answer of the service ({"error": {"kind", "message"}}) as a title and a sentence. */
export function errorInWords(status, body, retryAfter) {
  const e = (body && body.error) || {};
  const said = e.message ? `The server says: ${e.message}.` : "";
  const retry = retryAfter ? ` Try again in ${retryAfter} s.` : " Try again in a moment.";
  switch (e.kind || status) {
    case "unauthorized": case 401:
      return ["An API key is needed", "This server wants an API key: enter it in the API key field above and try again."];
    case "forbidden": case 403:
      return ["The API key is not valid", "The server did not accept this API key: check it in the API key field above."];
    case "too_large":
      return ["The file is too large", `${said} Send a shorter or more compressed file (FLAC, OGG or MP3).`];
    case "too_long":
      return ["The recording is too long", `${said} Cut it into shorter parts.`];
    case 413:
      return ["The file is too large", said];
    case "unsupported_media": case 415:
      return ["This is not an audio file the server can read",
        `${said} It takes WAV, FLAC, OGG (Vorbis or Opus), MP3 and AIFF files, among others.`];
    case "empty_input":
      return ["The file holds no audio", said];
    case "invalid_audio":
      return ["The audio file is damaged or not supported", said];
    case "invalid_parameter": case 422:
      return ["The server could not process this file", said];
    case "over_capacity":
      return ["The server is busy", `All of its enhancement capacity is in use.${retry}`];
    case "shutting_down":
      return ["The server is restarting", `It is shutting down for a restart.${retry}`];
    case 503:
      return ["The server is busy", `${said}${retry}`];
    case "idle_timeout": case 408:
      return ["The upload stalled", `${said} Check the connection and try again.`];
    case 0:
      return ["The server cannot be reached", "No answer came back: check the connection and that the service is running."];
    default:
      return [`The server answered ${status}`, said || "The request failed."];
  }
}

// ------------------------------------------------------------------------------ views
const VIEWS = ["file", "live", "examples"];
const listeners = [];

/** Calls fn(view) whenever the shown view changes (and once now). */
export function onView(fn) {
  listeners.push(fn);
  fn(currentView());
}

export function currentView() {
  const v = location.hash.replace("#", "");
  return VIEWS.includes(v) ? v : "file";
}

function showView() {
  const view = currentView();
  for (const v of VIEWS) {
    $(`view-${v}`).hidden = v !== view;
    const tab = $(`tab-${v}`);
    if (v === view) tab.setAttribute("aria-current", "page");
    else tab.removeAttribute("aria-current");
  }
  document.body.dataset.view = view;
  listeners.forEach((fn) => fn(view));
}

window.addEventListener("hashchange", showView);
showView();
