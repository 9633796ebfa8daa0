// kvrun's built-in web chat: plain JS, no dependencies, no network beyond
// this server. Streams /v1/chat/completions (SSE), shows <think> text as a
// collapsible block, per-message stats from the final usage chunk
// (timings + kv), a stop button that aborts the request (the server stops
// generating when the stream's reader goes away), the policy table from
// /props, the conversation in localStorage, and what the slot's cache holds
// from /slots?cached=1.
"use strict";

const STORE = "kvrun-chat";
const $ = id => document.getElementById(id);
let state = load();
let busy = null; // {controller, msg, t0, chunks}
let policies = [];

function load() {
  try {
    const s = JSON.parse(localStorage.getItem(STORE));
    if (s && Array.isArray(s.messages)) return s;
  } catch (e) { /* a broken store starts afresh */ }
  return { messages: [], settings: {}, slot: null };
}
function save() { localStorage.setItem(STORE, JSON.stringify(state)); }

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem("kvrun-key");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function statsText(m) {
  const s = m.stats;
  if (!s) return m.status === "stopped" ? "stopped" : "";
  if (s.client) {
    return "stopped · " + s.chunks + " chunks in " + s.secs.toFixed(1) + " s (~" +
      (s.chunks / Math.max(s.secs, 1e-3)).toFixed(1) + " tok/s, measured here)";
  }
  const t = s.timings || {}, kv = s.kv || {}, u = s.usage || {};
  const parts = [
    (t.predicted_n ?? u.completion_tokens ?? 0) + " tokens",
    (t.predicted_per_second ?? 0).toFixed(1) + " tok/s",
    "prompt " + (t.prompt_n ?? 0) + (t.cache_n ? " (+" + t.cache_n + " cached)" : "") +
      " at " + (t.prompt_per_second ?? 0).toFixed(0) + " tok/s",
    "KV " + (kv.live_tokens ?? "?") + "/" + (kv.capacity_tokens ?? "?") + " (peak " + (kv.peak_tokens ?? "?") + ")",
    "evicted " + (kv.evicted ?? 0),
    (kv.policy || "?") + (kv.kv_budget ? "@" + kv.kv_budget : ""),
    s.finish || "",
  ];
  return parts.join(" · ");
}

function renderMsg(m) {
  const d = el("div", "msg " + m.role + (m.status === "error" ? " error" : ""));
  d.appendChild(el("div", "role", m.role));
  if (m.reasoning) {
    const t = el("details", "think");
    const sum = el("summary", "", "thinking (" + m.reasoning.length + " chars)");
    t.appendChild(sum);
    t.appendChild(el("div", "reasoning", m.reasoning));
    d.appendChild(t);
  }
  d.appendChild(el("div", "content", m.content));
  if (m.role === "assistant") d.appendChild(el("div", "stats", statsText(m)));
  return d;
}

function render() {
  const box = $("messages");
  box.textContent = "";
  for (const m of state.messages) box.appendChild(renderMsg(m));
  box.scrollTop = box.scrollHeight;
}

// update the streaming message in place (keeps an opened <think> open)
function renderLive(m, node) {
  let t = node.querySelector("details.think");
  if (m.reasoning) {
    if (!t) {
      t = el("details", "think");
      t.open = true;
      t.appendChild(el("summary"));
      t.appendChild(el("div", "reasoning"));
      node.insertBefore(t, node.querySelector(".content"));
    }
    t.querySelector("summary").textContent = "thinking (" + m.reasoning.length + " chars)";
    t.querySelector(".reasoning").textContent = m.reasoning;
  }
  node.querySelector(".content").textContent = m.content;
  node.querySelector(".stats").textContent = statsText(m);
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function settings() {
  return {
    policy: $("policy").value,
    budget: parseInt($("budget").value, 10),
    maxTokens: parseInt($("max-tokens").value, 10),
  };
}

function policyChanged() {
  const p = policies.find(x => x.name === $("policy").value);
  $("budget").disabled = !(p && p.budgeted);
  state.settings = settings();
  save();
}

async function loadProps() {
  const r = await fetch("props", { headers: headers() });
  if (!r.ok) throw new Error("GET /props: " + r.status);
  const p = await r.json();
  $("model").textContent = p.model_alias + " · ctx " + p.default_generation_settings.n_ctx;
  policies = p.kv.policies;
  const sel = $("policy");
  sel.textContent = "";
  for (const q of policies) {
    const o = el("option", "", q.name);
    o.value = q.name;
    o.title = q.about;
    sel.appendChild(o);
  }
  const s = state.settings || {};
  sel.value = s.policy || p.kv.policy || "full";
  $("budget").value = s.budget || p.kv.kv_budget || 256;
  $("max-tokens").value = s.maxTokens || 256;
  policyChanged();
}

function handleData(data, m) {
  if (data === "[DONE]") return true;
  const j = JSON.parse(data);
  if (j.error) throw new Error(j.error.message);
  const c = j.choices && j.choices[0];
  if (c && c.delta) {
    if (c.delta.reasoning_content) m.reasoning = (m.reasoning || "") + c.delta.reasoning_content;
    if (c.delta.content) m.content += c.delta.content;
    if (c.delta.content || c.delta.reasoning_content) busy.chunks++;
  }
  if (c && c.finish_reason) m.finish = c.finish_reason;
  if (j.timings || j.kv) m.stats = { usage: j.usage, timings: j.timings, kv: j.kv, finish: m.finish };
  return false;
}

async function send(text) {
  const s = settings();
  state.settings = s;
  state.messages.push({ role: "user", content: text });
  const m = { role: "assistant", content: "", reasoning: "", stats: null, status: "streaming" };
  state.messages.push(m);
  save();
  render();
  const node = $("messages").lastChild;
  node.classList.add("streaming");
  const body = {
    messages: state.messages.filter(x => x !== m && x.status !== "error")
      .map(x => ({ role: x.role, content: x.content })),
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: s.maxTokens,
    policy: s.policy,
  };
  const p = policies.find(x => x.name === s.policy);
  if (p && p.budgeted) body.kv_budget = s.budget;
  const controller = new AbortController();
  busy = { controller, msg: m, t0: performance.now(), chunks: 0 };
  $("send").disabled = true;
  $("stop").disabled = false;
  try {
    const r = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      const j = await r.json().catch(() => null);
      throw new Error(j && j.error ? j.error.message : "HTTP " + r.status);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "", done = false;
    while (!done) {
      const { value, done: end } = await reader.read();
      if (end) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while (!done && (i = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of ev.split("\n")) {
          if (line.startsWith("data: ") && handleData(line.slice(6), m)) done = true;
        }
      }
      renderLive(m, node);
    }
    m.status = "done";
    if (m.stats && m.stats.kv) state.slot = m.stats.kv.slot;
  } catch (e) {
    if (e.name === "AbortError") {
      m.status = "stopped";
      m.stats = { client: true, chunks: busy.chunks, secs: (performance.now() - busy.t0) / 1e3 };
    } else {
      m.status = "error";
      m.content = (m.content ? m.content + "\n" : "") + "error: " + e.message;
    }
  }
  busy = null;
  node.classList.remove("streaming");
  $("send").disabled = false;
  $("stop").disabled = true;
  save();
  render();
  // the server stops at its next token after a stop: give it a moment
  setTimeout(refreshCache, m.status === "stopped" ? 400 : 0);
}

async function refreshCache() {
  let slots;
  try {
    const r = await fetch("slots?cached=1", { headers: headers() });
    if (!r.ok) return;
    slots = await r.json();
  } catch (e) { return; }
  const s = slots.find(x => x.id === state.slot) ||
    slots.find(x => x.cache_view && x.cache_view.pieces.length) || slots[0];
  if (!s || !s.cache_view) return;
  const v = s.cache_view, view = $("cache-view");
  view.textContent = "";
  let kept = 0;
  const frag = document.createDocumentFragment();
  v.pieces.forEach((p, i) => {
    const k = v.kept[i];
    kept += k;
    const sp = el("span", k >= 0.999 ? "k1" : k <= 0.001 ? "k0" : "kp", p);
    sp.title = "position " + i + ": " + (100 * k).toFixed(0) + "% of its entries cached";
    frag.appendChild(sp);
  });
  view.appendChild(frag);
  $("cache-sum").textContent = "slot " + s.id + " · " + (s.kv.policy || "?") +
    (s.kv.kv_budget ? "@" + s.kv.kv_budget : "") + " · " + v.pieces.length + " tokens fed, " +
    kept.toFixed(0) + " cached, " + (v.pieces.length - kept).toFixed(0) + " evicted";
}

$("composer").addEventListener("submit", e => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || busy) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", e => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (busy) busy.controller.abort(); });
$("policy").addEventListener("change", policyChanged);
$("budget").addEventListener("change", policyChanged);
$("max-tokens").addEventListener("change", policyChanged);
$("new-chat").addEventListener("click", () => {
  if (busy) busy.controller.abort();
  state.messages = [];
  save();
  render();
});
$("api-key").value = localStorage.getItem("kvrun-key") || "";
$("api-key").addEventListener("change", e => {
  localStorage.setItem("kvrun-key", e.target.value);
  loadProps().catch(err => { $("model").textContent = err.message; });
});

render();
loadProps().then(refreshCache).catch(err => { $("model").textContent = err.message; });
