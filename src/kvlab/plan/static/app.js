// The page draws what /api/plan answers (the planner's own --json); it computes no figure itself.
"use strict";
const form = document.getElementById("inputs");
const COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
let dropped = null;   // {name, bytes} of a dropped config.json / GGUF head
let pending = null;

function human(n) {
  if (n === null || n === undefined) return "";
  const a = Math.abs(n);
  if (a >= 2 ** 30) return (n / 2 ** 30).toFixed(2) + " GiB";
  if (a >= 2 ** 20) return (n / 2 ** 20).toFixed(1) + " MiB";
  return n.toLocaleString("en-US") + " B";
}

function query() {
  const params = new URLSearchParams();
  for (const el of form.elements) {
    if (!el.name) continue;
    if (el.type === "checkbox") { if (el.checked) params.set(el.name, "1"); }
    else if (el.value.trim() !== "") params.set(el.name, el.value.trim());
  }
  if (dropped) params.delete("model");
  return params;
}

function restore() {
  const params = new URLSearchParams(location.search);
  for (const [key, value] of params) {
    const el = form.elements.namedItem(key);
    if (!el) continue;
    if (el.type === "checkbox") el.checked = value !== "0"; else el.value = value;
  }
}

function fill(table, rows) {
  const body = table.tBodies[0];
  body.replaceChildren();
  for (const cells of rows) {
    const tr = body.insertRow();
    for (const c of cells) tr.insertCell().textContent = c;
  }
}

function draw(doc) {
  const plan = doc.plan;
  document.getElementById("error").hidden = true;
  document.getElementById("result").hidden = false;
  document.getElementById("title").textContent =
    `${plan.model} · ${plan.engine} · ctx ${plan.context.toLocaleString("en-US")} × ${plan.parallel} seq · KV ${plan.kv_type_k}/${plan.kv_type_v}`;
  const bar = document.getElementById("bar");
  bar.replaceChildren();
  const scale = Math.max(plan.total_bytes, plan.budget_bytes || 0) || 1;
  plan.components.forEach((c, i) => {
    const span = document.createElement("span");
    span.style.width = (100 * c.bytes / scale) + "%";
    span.style.background = COLORS[i % COLORS.length];
    span.title = `${c.name}: ${human(c.bytes)}`;
    span.textContent = c.name;
    bar.appendChild(span);
  });
  if (plan.budget_bytes) {
    const limit = document.createElement("div");
    limit.className = "limit";
    limit.style.left = (100 * plan.budget_bytes / scale) + "%";
    limit.title = `usable: ${human(plan.budget_bytes)}`;
    bar.appendChild(limit);
  }
  const set = (id, text, cls) => { const el = document.getElementById(id); el.textContent = text; el.className = cls || ""; };
  set("total", `${human(plan.total_bytes)} (${plan.total_bytes.toLocaleString("en-US")} B)`);
  set("budget", plan.budget_bytes ? `${human(plan.budget_bytes)} on ${plan.gpu}` : "give a GPU or VRAM");
  set("fits", plan.fits === null ? "no verdict" : plan.fits ? "fits" : "does not fit", plan.fits ? "fits" : plan.fits === false ? "short" : "");
  set("max-context", plan.max_context === null ? "" : plan.max_context.toLocaleString("en-US") +
      (plan.max_context_limited_by ? ` (limited by ${plan.max_context_limited_by})` : ""));
  set("max-sequences", plan.max_sequences === null ? "" : String(plan.max_sequences));
  set("kv-per-token", plan.kv_bytes_per_token.toLocaleString("en-US") + " B");
  set("launch", plan.launch);
  const verdict = document.getElementById("verdict");
  verdict.replaceChildren(...doc.verdict.slice(2).map(line => { const li = document.createElement("li"); li.textContent = line; return li; }));
  fill(document.getElementById("components"), plan.components.map(c => [c.name, c.formula, (c.exact ? "" : "≈ ") + c.bytes.toLocaleString("en-US")]));
  fill(document.getElementById("layers"), doc.layers.map(r => [r.layer, r.kind, r.kv_heads || "", r.head_dim_k === null ? "" : `${r.head_dim_k}/${r.head_dim_v}`,
    r.window || "", r.cells ? r.cells.toLocaleString("en-US") : "", r.k_bytes.toLocaleString("en-US"),
    r.v_bytes.toLocaleString("en-US"), r.state_bytes.toLocaleString("en-US")]));
  document.body.dataset.state = "ready";
}

function fail(message) {
  const el = document.getElementById("error");
  el.textContent = "error: " + message;
  el.hidden = false;
  document.getElementById("result").hidden = true;
  document.body.dataset.state = "error";
}

async function update() {
  const params = query();
  history.replaceState(null, "", "?" + params.toString());
  if (pending) pending.abort();
  pending = new AbortController();
  document.body.dataset.state = "loading";
  try {
    const init = dropped ? { method: "POST", body: dropped.bytes,
                             headers: { "X-File-Name": dropped.name, "X-File-Size": String(dropped.size) } } : {};
    const response = await fetch("/api/plan?" + params.toString(), { ...init, signal: pending.signal });
    const doc = await response.json();
    if (!response.ok) fail(doc.error); else draw(doc);
  } catch (err) {
    if (err.name !== "AbortError") fail(String(err));
  }
}

async function load(file) {
  const head = await file.slice(0, 32 * 1024 * 1024).arrayBuffer();
  dropped = { name: file.name, bytes: head, size: file.size };
  document.getElementById("model").value = "";
  update();
}

async function init() {
  restore();
  try {
    const catalog = await (await fetch("/api/catalog")).json();
    document.getElementById("models").replaceChildren(...catalog.models.map(m => new Option(m.repo, m.name)));
    document.getElementById("gpus").replaceChildren(...catalog.gpus.map(g => new Option("", g)));
  } catch (err) { /* the lists are a convenience */ }
  form.addEventListener("input", () => { if (document.activeElement && document.activeElement.id === "model") dropped = null; update(); });
  form.addEventListener("change", update);
  form.addEventListener("submit", e => { e.preventDefault(); update(); });
  document.getElementById("file").addEventListener("change", e => { if (e.target.files[0]) load(e.target.files[0]); });
  const drop = document.getElementById("drop");
  drop.addEventListener("dragover", e => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", e => { e.preventDefault(); drop.classList.remove("over"); if (e.dataTransfer.files[0]) load(e.dataTransfer.files[0]); });
  update();
}

init();
