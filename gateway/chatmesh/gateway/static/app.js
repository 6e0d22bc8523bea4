// The chat page: conversation list, new chat, streamed replies (fetch + a small SSE reader, since EventSource
// cannot POST), stop, regenerate, delete, and a sign-in form when the edge requires auth. Session requests
// that change state carry the CSRF token from GET /v1/session in X-CSRF-Token.
"use strict";

const state = { csrf: null, current: null, turn: null, streaming: false };
const $ = (id) => document.getElementById(id);

function uuid() {
  if (crypto.randomUUID) return crypto.randomUUID();
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40; b[8] = (b[8] & 0x3f) | 0x80;
  const h = [...b].map((x) => x.toString(16).padStart(2, "0")).join("");
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

async function api(method, path, body, signal) {
  const headers = {};
  if (body !== undefined) headers["content-type"] = "application/json";
  if (state.csrf && method !== "GET") headers["x-csrf-token"] = state.csrf;
  const r = await fetch(path, { method, headers, signal, credentials: "same-origin",
                                body: body === undefined ? undefined : JSON.stringify(body) });
  if (r.status === 401) { showLogin(); throw new Error("please sign in"); }
  if (!r.ok) {
    const e = await r.json().catch(() => null);
    throw new Error((e && e.error && e.error.message) || r.statusText);
  }
  return r;
}

function setStatus(text) { $("status").textContent = text || ""; }

function setStreaming(on) {
  state.streaming = on;
  $("send").disabled = on;
  $("stop").disabled = !on;
  $("regenerate").disabled = on || !lastAssistant();
}

function showLogin() { $("login").hidden = false; $("chat").hidden = true; }

async function boot() {
  const r = await fetch("/v1/session", { credentials: "same-origin" });
  if (r.status === 401) return showLogin();
  const me = await r.json();
  state.csrf = me.csrf_token;
  $("whoami").textContent = `signed in as ${me.user}`;
  $("login").hidden = true; $("chat").hidden = false;
  const list = await loadConversations();
  const wanted = location.hash.slice(1);
  if (wanted && list.some((c) => c.id === wanted)) await openConversation(wanted);
  setStreaming(false);
}

async function loadConversations() {
  const { conversations } = await (await api("GET", "/v1/conversations")).json();
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    if (c.id === state.current) li.classList.add("current");
    const open = document.createElement("button");
    open.className = "open";
    open.type = "button";
    open.textContent = c.title || new Date(c.created_at_ms).toLocaleString();
    open.addEventListener("click", () => openConversation(c.id));
    const del = document.createElement("button");
    del.className = "delete";
    del.type = "button";
    del.textContent = "Delete";
    del.setAttribute("aria-label", "Delete conversation");
    del.addEventListener("click", () => deleteConversation(c.id));
    li.append(open, del);
    ul.append(li);
  }
  return conversations;
}

function addMessage(role, content, status, turnId) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.dataset.status = status || "complete";
  if (turnId) div.dataset.turnId = turnId;
  div.dataset.text = content;
  Markdown.render(div, content);
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// A reply that called tools (through the OpenAI-compatible surface) and the tool results sent back: each call as
// its tool's name and its arguments (pretty-printed JSON when they parse), each result as the tool it answers and
// its text. Text only (textContent), never HTML, like the replies.
function pretty(text) {
  try { return JSON.stringify(JSON.parse(text), null, 2); } catch { return text; }
}

function toolBlock(kind, heading, body) {
  const block = document.createElement("div");
  block.className = `tool-block tool-${kind}`;
  const title = document.createElement("div");
  title.className = "tool-heading";
  title.textContent = heading;
  const pre = document.createElement("pre");
  pre.textContent = body;
  block.append(title, pre);
  return block;
}

function addToolMessage(m, toolNames) {
  const div = document.createElement("div");
  div.className = `message ${m.role}`;
  div.dataset.status = m.status || "complete";
  if (m.turn_id) div.dataset.turnId = m.turn_id;
  div.dataset.text = m.content || "";
  if (m.content) {
    const text = document.createElement("div");
    Markdown.render(text, m.content);
    div.append(text);
  }
  for (const c of m.tool_calls || []) {
    toolNames.set(c.id, c.name);
    div.append(toolBlock("call", `Called ${c.name}`, pretty(c.arguments)));
  }
  for (const r of m.tool_results || []) {
    const name = toolNames.get(r.tool_call_id);
    div.append(toolBlock("result", name ? `Result of ${name}` : `Tool result (${r.tool_call_id})`, r.content));
  }
  $("messages").append(div);
  return div;
}

function lastAssistant() {
  const all = $("messages").querySelectorAll(".message.assistant");
  return all.length ? all[all.length - 1] : null;
}

async function openConversation(id) {
  const conv = await (await api("GET", `/v1/conversations/${id}`)).json();
  state.current = id;
  location.hash = id;
  $("messages").replaceChildren();
  const toolNames = new Map();  // tool call id -> the tool's name, for the results that answer it
  for (const m of conv.messages) {
    if ((m.tool_calls && m.tool_calls.length) || (m.tool_results && m.tool_results.length)) {
      addToolMessage(m, toolNames);
    } else if (m.role === "user" || m.role === "assistant") addMessage(m.role, m.content, m.status, m.turn_id);
  }
  for (const li of $("conversations").children) li.classList.toggle("current", li.dataset.id === id);
  setStreaming(false);
}

async function deleteConversation(id) {
  await api("DELETE", `/v1/conversations/${id}`);
  if (state.current === id) {
    state.current = null;
    history.replaceState(null, "", location.pathname);
    $("messages").replaceChildren();
  }
  await loadConversations();
}

// Reads one SSE response, calling onEvent(type, data) per event.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let type = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) type = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) onEvent(type, JSON.parse(data.join("\n")));
    }
  }
}

// Under a finished reply: its time to first token (as the edge saw it), prompt tokens, how many of them the
// engine found in its prefix cache, and the replica that answered. Text only (textContent), never HTML.
function showFigures(bubble, data) {
  const usage = data.usage || {};
  const figures = document.createElement("div");
  figures.className = "turn-figures";
  figures.dataset.ttftMs = data.ttft_ms ?? "";
  figures.dataset.promptTokens = usage.prompt_tokens ?? 0;
  figures.dataset.cachedTokens = usage.cached_prompt_tokens ?? 0;
  figures.dataset.replica = data.replica_id || "";
  const ttft = data.ttft_ms === undefined ? "" : `TTFT ${Math.round(data.ttft_ms)} ms · `;
  figures.textContent = `${ttft}${usage.prompt_tokens ?? 0} prompt tokens, ` +
    `${usage.cached_prompt_tokens ?? 0} from cache · ${data.replica_id || "?"}`;
  bubble.after(figures);
}

async function stream(path, body, bubble) {
  state.turn = body.turn_id;
  bubble.dataset.turnId = body.turn_id;
  setStreaming(true);
  setStatus("");
  let text = "";
  let pending = false;
  const paint = () => { pending = false; bubble.dataset.text = text; Markdown.render(bubble, text); };
  try {
    const r = await api("POST", path, body);
    await readEvents(r, (type, data) => {
      switch (type) {
        case "turn.started": break;
        case "turn.delta":
          text += data.text;
          if (!pending) { pending = true; requestAnimationFrame(paint); }
          break;
        case "turn.completed": bubble.dataset.status = "complete"; showFigures(bubble, data); break;
        case "turn.stopped": bubble.dataset.status = "stopped"; break;
        case "turn.blocked": bubble.dataset.status = "blocked"; setStatus("The reply was blocked."); break;
        case "turn.failed": bubble.dataset.status = "failed"; setStatus(data.message); break;
      }
    });
  } catch (err) {
    setStatus(err.message);
  } finally {
    paint();
    state.turn = null;
    setStreaming(false);
    loadConversations().catch(() => {});
  }
}

async function send(event) {
  event.preventDefault();
  const content = $("input").value;
  if (!content.trim() || state.streaming) return;
  try {
    if (!state.current) {
      const conv = await (await api("POST", "/v1/conversations", { title: content.slice(0, 60) })).json();
      state.current = conv.id;
      location.hash = conv.id;
    }
  } catch (err) { setStatus(err.message); return; }
  $("input").value = "";
  const turnId = uuid();
  addMessage("user", content, "complete", turnId);
  const bubble = addMessage("assistant", "", "streaming");
  await stream(`/v1/conversations/${state.current}/turns`, { turn_id: turnId, content }, bubble);
}

async function stop() {
  if (!state.turn || !state.current) return;
  try { await api("POST", `/v1/conversations/${state.current}/turns/${state.turn}/stop`); }
  catch (err) { setStatus(err.message); }
}

async function regenerate() {
  const last = lastAssistant();
  if (!last || !state.current || state.streaming) return;
  const old = last.dataset.turnId;
  last.remove();
  const bubble = addMessage("assistant", "", "streaming");
  await stream(`/v1/conversations/${state.current}/turns/${old}/regenerate`, { turn_id: uuid() }, bubble);
}

async function login(event) {
  event.preventDefault();
  const r = await fetch("/v1/session", { method: "POST", credentials: "same-origin",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ username: $("username").value, password: $("password").value }) });
  if (!r.ok) { $("login-error").textContent = "Wrong user name or password."; return; }
  await boot();
}

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", () => {
    state.current = null;
    history.replaceState(null, "", location.pathname);
    $("messages").replaceChildren();
    loadConversations().catch(() => {});
    $("input").focus();
  });
  $("login").addEventListener("submit", login);
  boot().catch((err) => setStatus(err.message));
});
