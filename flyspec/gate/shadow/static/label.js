// The labelling page (flyspec/gate/shadow/label.py). Every answer and request is hostile: text goes
// into the page through textContent only, never as HTML, so no script, tag or link in it can run.
"use strict";

const token = new URLSearchParams(location.search).get("token");
const headers = token ? { "X-Label-Token": token } : {};
const skipped = new Set();
let pairs = [];
let current = null;
let busy = false;

const $ = (id) => document.getElementById(id);
const name = () => localStorage.getItem("flyspec-labeller") || "";
const pairKey = (p) => p.dataset + "/" + p.question_id;

// Readable text: fenced code blocks as <pre>, the rest as paragraphs that keep their line breaks.
function render(element, text) {
  element.replaceChildren();
  String(text).split(/^```[^\n]*$/m).forEach((part, i) => {
    const body = part.replace(/^\n|\n$/g, "");
    if (!body) return;
    const node = document.createElement(i % 2 ? "pre" : "p");
    node.textContent = body;
    element.appendChild(node);
  });
}

function points(x) {
  return (x >= 0 ? "+" : "") + (100 * x).toFixed(1);
}

function showProgress(p) {
  $("labelled").textContent = p.labelled;
  $("waiting").textContent = p.waiting;
  const interval = p.low === null || p.high === null ? "" : ` [${points(p.low)}, ${points(p.high)}] points`;
  const margin = ` against a margin of -${(100 * p.margin).toFixed(1)}`;
  $("decision").textContent =
    (p.decision || `no decision yet${p.interim ? ", interim " + p.interim : ""}`) + interval + margin;
  $("more").textContent = p.more_labels === null ? (p.decision ? "none" : "-") : p.more_labels;
  $("judge-agreement").textContent =
    p.judge_agreement === null ? "no label yet" : `${(100 * p.judge_agreement).toFixed(0)}%`;
  const l = p.labellers;
  $("labeller-agreement").textContent = l.twice ? `${l.agreed} of ${l.twice} pairs labelled twice` : "no pair labelled twice";
  $("advice").textContent = p.advice || "";
}

function showPair() {
  current = pairs.find((p) => !skipped.has(pairKey(p))) || null;
  $("pair").hidden = current === null;
  if (current === null) {
    $("message").textContent = skipped.size
      ? "Only skipped pairs are left: reload the page to see them again."
      : "No pair waits for a label.";
    return;
  }
  const waiting = pairs.filter((p) => p.mode === "gold").length;
  $("where").textContent =
    `${pairKey(current)}` +
    (current.mode === "second" ? " - a second label: someone labelled it; yours is counted as agreement" : ` - ${waiting} waiting`);
  $("where").className = current.mode === "second" ? "second" : "hint";
  render($("request"), current.request);
  $("reference-box").hidden = !current.reference;
  render($("reference"), current.reference || "");
  render($("answer-a"), current.a);
  render($("answer-b"), current.b);
}

function show(view) {
  $("labeller").textContent = name();
  pairs = view.pairs;
  showProgress(view.progress);
  showPair();
}

async function load() {
  const response = await fetch("/label/api/queue?labeller=" + encodeURIComponent(name()), { headers });
  const body = await response.json();
  if (!response.ok) {
    $("message").textContent = body.error || body.detail || response.statusText;
    return;
  }
  show(body);
}

async function answer(key) {
  if (!current || busy) return;
  $("message").textContent = "";
  if (key === "s") {
    skipped.add(pairKey(current));
    $("message").textContent =
      "Skipped for now: the decision reads the pairs in their order and waits at the first unlabelled one.";
    showPair();
    return;
  }
  busy = true;
  try {
    const response = await fetch("/label/api/labels", {
      method: "POST",
      headers: { ...headers, "Content-Type": "application/json" },
      body: JSON.stringify({
        dataset: current.dataset,
        question_id: current.question_id,
        key,
        labeller: name(),
        second: current.mode === "second",
      }),
    });
    const body = await response.json();
    if (response.ok) {
      show(body);
    } else {
      $("message").textContent = body.error || body.detail || response.statusText;
      await load();
    }
  } finally {
    busy = false;
  }
}

function askName() {
  $("name-form").hidden = false;
  $("pair").hidden = true;
  $("name").value = name();
  $("name").focus();
}

document.addEventListener("DOMContentLoaded", () => {
  $("name-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const given = $("name").value.trim();
    if (!given) return;
    localStorage.setItem("flyspec-labeller", given);
    $("name").blur();
    $("name-form").hidden = true;
    load();
  });
  $("rename").addEventListener("click", (event) => {
    event.preventDefault();
    askName();
  });
  document.querySelectorAll("nav button").forEach((button) => {
    button.addEventListener("click", () => answer(button.dataset.key));
  });
  document.addEventListener("keydown", (event) => {
    if (!$("name-form").hidden || event.ctrlKey || event.metaKey || event.altKey) return;
    const key = event.key.toLowerCase();
    if (["a", "b", "e", "s"].includes(key)) {
      event.preventDefault();
      answer(key);
    }
  });
  if (name()) load();
  else askName();
});
