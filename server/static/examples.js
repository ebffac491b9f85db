// Examples view: before/after pairs made with the shipped model (server/static/examples/, made by
// tools/examples.py), listed from examples.json; each pair in two players.
import { $ } from "./common.js";

const state = (window.examplesState = { status: "loading", examples: [] });

fetch("/static/examples/examples.json")
  .then((r) => (r.ok ? r.json() : Promise.reject(new Error(`HTTP ${r.status}`))))
  .then((list) => {
    const ul = $("examples");
    for (const ex of list) {
      const li = document.createElement("li");
      const title = document.createElement("h3");
      title.textContent = ex.title;
      const about = document.createElement("p");
      about.className = "hint";
      about.textContent = `${ex.made_of} · ${ex.seconds} s`;
      li.append(title, about, player("before", ex.before, ex.title), player("after", ex.after, ex.title));
      ul.append(li);
    }
    Object.assign(state, { status: "ready", examples: list.map((e) => e.name) });
  })
  .catch((err) => Object.assign(state, { status: "error", error: String(err) }));

function player(which, file, title) {
  const label = document.createElement("label");
  label.className = "example";
  const audio = document.createElement("audio");
  audio.controls = true;
  audio.preload = "metadata";
  audio.src = `/static/examples/${file}`;
  audio.setAttribute("aria-label", `${title}, ${which}`);
  audio.addEventListener("play", () => { // one at a time
    document.querySelectorAll("#examples audio").forEach((a) => { if (a !== audio) a.pause(); });
  });
  label.append(which === "before" ? "Before (noisy)" : "After (enhanced)", audio);
  return label;
}
