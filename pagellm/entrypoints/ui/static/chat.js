// The chat page: conversations in localStorage, replies streamed from the server's own
// POST /v1/chat/completions (SSE read through fetch + ReadableStream), Stop aborts the fetch
// (the server aborts the request in the engine when the connection closes). Model text is
// only ever set as textContent (see markdown.js).
"use strict";

(function () {
  const { renderMarkdown } = window.pagellmMarkdown;
  const $ = (id) => document.getElementById(id);
  const KEYS = {
    conversations: "pagellm.conversations",
    current: "pagellm.current",
    settings: "pagellm.settings",
    apiKey: "pagellm.apiKey",
  };
  const DEFAULT_SETTINGS = { system: "", temperature: 0.7, top_p: 1, max_tokens: 512 };
  const EXPORT_FORMAT = "pagellm.conversations";
  const ROLES = new Set(["system", "user", "assistant"]);

  function loadJSON(key, fallback) {
    try {
      const raw = localStorage.getItem(key);
      return raw === null ? fallback : JSON.parse(raw);
    } catch (e) {
      return fallback;
    }
  }

  const state = {
    conversations: [],
    currentId: localStorage.getItem(KEYS.current),
    settings: Object.assign({}, DEFAULT_SETTINGS, loadJSON(KEYS.settings, {})),
    model: null,
    busy: null, // {controller, conv, msg} while a reply is on its way
  };
  state.conversations = sanitizeConversations(loadJSON(KEYS.conversations, [])) || [];

  // ---- storage -------------------------------------------------------------------------

  function save() {
    const stored = state.conversations.map((c) => ({
      id: c.id,
      title: c.title,
      created: c.created,
      messages: c.messages.map(storedMessage),
    }));
    localStorage.setItem(KEYS.conversations, JSON.stringify(stored));
    if (state.currentId) localStorage.setItem(KEYS.current, state.currentId);
  }

  function storedMessage(m) {
    const out = { role: m.role, content: m.content };
    if (m.reasoning) out.reasoning = m.reasoning;
    if (m.stats) out.stats = m.stats;
    if (m.error) out.error = m.error;
    if (m.stopped) out.stopped = true;
    if (m.finish) out.finish = m.finish;
    return out;
  }

  // Conversations from storage or an imported file are data from outside: keep only known
  // fields of the right types. Returns null when `data` holds no conversation list.
  function sanitizeConversations(data) {
    let list = data;
    if (data && !Array.isArray(data) && typeof data === "object") {
      list = Array.isArray(data.conversations) ? data.conversations : Array.isArray(data.messages) ? [data] : null;
    }
    if (!Array.isArray(list)) return null;
    const out = [];
    for (const c of list) {
      if (!c || typeof c !== "object" || !Array.isArray(c.messages)) continue;
      const messages = [];
      for (const m of c.messages) {
        if (!m || !ROLES.has(m.role) || typeof m.content !== "string") continue;
        const msg = { role: m.role, content: m.content };
        if (typeof m.reasoning === "string") msg.reasoning = m.reasoning;
        if (typeof m.error === "string") msg.error = m.error;
        if (m.stopped === true) msg.stopped = true;
        if (m.finish === "stop" || m.finish === "length") msg.finish = m.finish;
        if (m.stats && typeof m.stats === "object") {
          const s = {};
          for (const k of ["tokens", "ttft", "tps"]) if (Number.isFinite(m.stats[k])) s[k] = m.stats[k];
          msg.stats = s;
        }
        messages.push(msg);
      }
      out.push({
        id: typeof c.id === "string" && c.id ? c.id : newId(),
        title: typeof c.title === "string" && c.title ? c.title.slice(0, 80) : "New chat",
        created: Number.isFinite(c.created) ? c.created : Date.now(),
        messages,
      });
    }
    return out;
  }

  function newId() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  }

  function current() {
    return state.conversations.find((c) => c.id === state.currentId) || null;
  }

  function newConversation() {
    const existing = current();
    if (existing && existing.messages.length === 0) return existing;
    const conv = { id: newId(), title: "New chat", created: Date.now(), messages: [] };
    state.conversations.unshift(conv);
    state.currentId = conv.id;
    save();
    return conv;
  }

  // ---- API -----------------------------------------------------------------------------

  async function errorText(resp) {
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) return body.error.message;
      if (body && body.detail) return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    } catch (e) {
      // not JSON: fall through to the status line
    }
    return `HTTP ${resp.status} ${resp.statusText}`.trim();
  }

  // fetch() with the stored API key. On 401 the page asks for a key (showing the server's
  // error) and retries with it; closing the dialog gives up and returns the 401 response.
  // onSend runs just before each attempt (the reply's clock starts there).
  async function api(path, init = {}, onSend = () => {}) {
    for (;;) {
      const headers = Object.assign({ "Content-Type": "application/json" }, init.headers || {});
      const key = localStorage.getItem(KEYS.apiKey);
      if (key) headers.Authorization = "Bearer " + key;
      onSend();
      const resp = await fetch(path, Object.assign({}, init, { headers }));
      if (resp.status !== 401) return resp;
      const message = await errorText(resp.clone());
      const entered = await askForKey(key ? `The key was refused: ${message}` : message);
      if (entered === null) return resp;
      localStorage.setItem(KEYS.apiKey, entered);
    }
  }

  let keyWaiters = [];
  function askForKey(serverMessage) {
    const dialog = $("key-dialog");
    $("key-error").textContent = serverMessage;
    if (!dialog.open) {
      $("key-input").value = "";
      dialog.showModal();
    }
    $("key-input").focus();
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  function answerKey(value) {
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((resolve) => resolve(value));
  }

  async function loadModel() {
    try {
      const resp = await api("/v1/models");
      if (!resp.ok) throw new Error(await errorText(resp));
      const body = await resp.json();
      state.model = body.data && body.data.length ? body.data[0].id : null;
      $("model-name").textContent = state.model || "(no model)";
    } catch (e) {
      $("model-name").textContent = "model unavailable: " + e.message;
    }
  }

  // Reads an SSE body, calling onEvent(parsed JSON) per `data:` line until [DONE].
  async function readEvents(resp, onEvent) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          onEvent(JSON.parse(data));
        }
      }
    }
  }

  // ---- generation ----------------------------------------------------------------------

  function requestMessages(conv) {
    const messages = [];
    if (state.settings.system.trim()) messages.push({ role: "system", content: state.settings.system });
    for (const m of conv.messages) {
      if (m.error || (m.role === "assistant" && !m.content)) continue;
      messages.push({ role: m.role, content: m.content });
    }
    return messages;
  }

  async function generate(conv) {
    const msg = { role: "assistant", content: "", reasoning: "", phase: "reading", readingSince: performance.now() };
    const body = {
      messages: requestMessages(conv),
      stream: true,
      stream_options: { include_usage: true, continuous_usage_stats: true },
      temperature: state.settings.temperature,
      top_p: state.settings.top_p,
      max_tokens: state.settings.max_tokens,
    };
    if (state.model) body.model = state.model;
    conv.messages.push(msg);
    const controller = new AbortController();
    state.busy = { controller, conv, msg };
    render();
    let sentAt = 0;
    let firstAt = null;
    let tokens = null;
    try {
      const resp = await api("/v1/chat/completions", {
        method: "POST",
        body: JSON.stringify(body),
        signal: controller.signal,
      }, () => (sentAt = msg.readingSince = performance.now()));
      if (!resp.ok) throw new Error(await errorText(resp));
      await readEvents(resp, (event) => {
        if (event.error) throw new Error(event.error.message || "server error");
        if (event.usage) tokens = event.usage.completion_tokens;
        const choice = event.choices && event.choices[0];
        if (!choice) return;
        const delta = choice.delta || {};
        if (delta.reasoning_content) msg.reasoning += delta.reasoning_content;
        if (delta.content) msg.content += delta.content;
        if (firstAt === null && (delta.content || delta.reasoning_content)) {
          firstAt = performance.now();
          msg.phase = "streaming";
        }
        if (choice.finish_reason) msg.finish = choice.finish_reason;
        scheduleUpdate(msg);
      });
    } catch (e) {
      if (e.name === "AbortError") msg.stopped = true;
      else msg.error = e.message || String(e);
    }
    const end = performance.now();
    if (firstAt !== null) {
      msg.stats = { ttft: (firstAt - sentAt) / 1000 };
      if (tokens !== null) {
        msg.stats.tokens = tokens;
        // Decode rate: tokens after the first over the time after the first.
        if (tokens > 1 && end > firstAt) msg.stats.tps = (tokens - 1) / ((end - firstAt) / 1000);
      }
    }
    delete msg.phase;
    state.busy = null;
    save();
    render();
  }

  function send(text) {
    if (state.busy || !text.trim()) return;
    const conv = current() || newConversation();
    if (conv.messages.length === 0) conv.title = text.trim().split("\n")[0].slice(0, 60);
    conv.messages.push({ role: "user", content: text });
    $("input").value = "";
    save();
    generate(conv);
  }

  function regenerate() {
    const conv = current();
    if (state.busy || !conv) return;
    while (conv.messages.length && conv.messages[conv.messages.length - 1].role === "assistant") conv.messages.pop();
    if (!conv.messages.length || conv.messages[conv.messages.length - 1].role !== "user") return;
    generate(conv);
  }

  // Takes the last user message (and the reply to it) back into the input box.
  function editLast() {
    const conv = current();
    if (state.busy || !conv) return;
    const idx = conv.messages.map((m) => m.role).lastIndexOf("user");
    if (idx < 0) return;
    $("input").value = conv.messages[idx].content;
    conv.messages.splice(idx);
    save();
    render();
    $("input").focus();
  }

  // ---- rendering -----------------------------------------------------------------------

  function statsText(stats) {
    const parts = [];
    if (stats.tokens !== undefined) parts.push(`${stats.tokens} tokens`);
    if (stats.ttft !== undefined) parts.push(`TTFT ${stats.ttft.toFixed(2)} s`);
    if (stats.tps !== undefined) parts.push(`${stats.tps.toFixed(1)} tokens/s`);
    return parts.join(" · ");
  }

  function messageNode(m, index) {
    const node = document.createElement("article");
    node.className = "message " + m.role;
    node.dataset.index = String(index);
    const role = document.createElement("div");
    role.className = "role";
    role.textContent = m.role;
    node.appendChild(role);
    if (m.role === "assistant") {
      const reasoning = document.createElement("details");
      reasoning.className = "reasoning";
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      reasoning.appendChild(summary);
      const rtext = document.createElement("div");
      rtext.className = "reasoning-text";
      reasoning.appendChild(rtext);
      node.appendChild(reasoning);
      const reading = document.createElement("div");
      reading.className = "reading";
      node.appendChild(reading);
    }
    const content = document.createElement("div");
    content.className = m.role === "assistant" ? "content markdown" : "content plain";
    node.appendChild(content);
    const error = document.createElement("div");
    error.className = "error";
    error.setAttribute("role", "alert");
    node.appendChild(error);
    const footer = document.createElement("footer");
    footer.className = "message-footer";
    const stats = document.createElement("span");
    stats.className = "stats";
    footer.appendChild(stats);
    if (m.role === "assistant") {
      const copy = document.createElement("button");
      copy.type = "button";
      copy.className = "copy-reply";
      copy.textContent = "Copy";
      footer.appendChild(copy);
    }
    node.appendChild(footer);
    updateNode(m, node);
    return node;
  }

  function updateNode(m, node) {
    const content = node.querySelector(".content");
    if (m.role === "assistant") {
      renderMarkdown(m.content, content);
      const reasoning = node.querySelector(".reasoning");
      reasoning.hidden = !m.reasoning;
      node.querySelector(".reasoning-text").textContent = m.reasoning || "";
      const reading = node.querySelector(".reading");
      reading.hidden = m.phase !== "reading";
      if (m.phase === "reading") reading.textContent = `Reading the prompt… ${((performance.now() - m.readingSince) / 1000).toFixed(1)} s`;
    } else {
      content.textContent = m.content;
    }
    node.dataset.state = m.phase || (m.error ? "error" : m.stopped ? "stopped" : "done");
    node.querySelector(".error").textContent = m.error || "";
    node.querySelector(".error").hidden = !m.error;
    const stats = node.querySelector(".stats");
    const text = m.stats ? statsText(m.stats) : "";
    const parts = [m.stopped ? "stopped" : "", text, m.finish === "length" ? "max tokens reached" : ""];
    stats.textContent = parts.filter(Boolean).join(" · ");
    if (m.stats) {
      for (const k of ["tokens", "ttft", "tps"]) if (m.stats[k] !== undefined) stats.dataset[k] = String(m.stats[k]);
    }
  }

  let pending = null;
  function scheduleUpdate(msg) {
    if (pending) return;
    pending = requestAnimationFrame(() => {
      pending = null;
      const conv = current();
      const list = $("messages");
      if (!conv || !state.busy || state.busy.conv !== conv) return;
      const node = list.querySelector(`article[data-index="${conv.messages.indexOf(msg)}"]`);
      if (!node) return;
      const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
      updateNode(msg, node);
      if (atBottom) list.scrollTop = list.scrollHeight;
    });
  }

  function renderList() {
    const ul = $("conversation-list");
    ul.replaceChildren();
    for (const c of state.conversations) {
      const li = document.createElement("li");
      if (c.id === state.currentId) li.setAttribute("aria-current", "true");
      const open = document.createElement("button");
      open.type = "button";
      open.className = "open-conversation";
      open.textContent = c.title;
      open.title = c.title;
      open.dataset.id = c.id;
      const del = document.createElement("button");
      del.type = "button";
      del.className = "delete-conversation";
      del.textContent = "×";
      del.title = "Delete this conversation";
      del.dataset.id = c.id;
      li.append(open, del);
      ul.appendChild(li);
    }
  }

  function render() {
    renderList();
    const list = $("messages");
    list.replaceChildren();
    const conv = current();
    if (!conv || conv.messages.length === 0) {
      const empty = document.createElement("p");
      empty.className = "empty";
      empty.textContent = "Start a conversation: type a message below.";
      list.appendChild(empty);
    } else {
      conv.messages.forEach((m, i) => list.appendChild(messageNode(m, i)));
    }
    list.scrollTop = list.scrollHeight;
    const busy = Boolean(state.busy);
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("regenerate").disabled = busy || !conv || !conv.messages.some((m) => m.role === "user");
    $("edit-last").disabled = $("regenerate").disabled;
    $("new-chat").disabled = busy;
    document.body.dataset.busy = busy ? "true" : "false";
  }

  // The "reading the prompt" line counts seconds until the first token.
  setInterval(() => {
    if (state.busy && state.busy.msg.phase === "reading") scheduleUpdate(state.busy.msg);
  }, 100);

  // ---- copy, export, import ------------------------------------------------------------

  async function copyText(text, button) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (e) {
      const area = document.createElement("textarea");
      area.value = text;
      area.style.position = "fixed";
      area.style.opacity = "0";
      document.body.appendChild(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    const label = button.textContent;
    button.textContent = "Copied";
    setTimeout(() => (button.textContent = label), 1200);
  }

  function exportConversations() {
    const data = {
      format: EXPORT_FORMAT,
      version: 1,
      exported: new Date().toISOString(),
      conversations: state.conversations.map((c) => ({
        id: c.id,
        title: c.title,
        created: c.created,
        messages: c.messages.map(storedMessage),
      })),
    };
    const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
    const a = document.createElement("a");
    a.href = url;
    a.download = `pagellm-conversations-${new Date().toISOString().slice(0, 10)}.json`;
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  }

  async function importFile(file) {
    const status = $("import-status");
    let imported;
    try {
      imported = sanitizeConversations(JSON.parse(await file.text()));
      if (imported === null) throw new Error("no conversations in the file");
    } catch (e) {
      status.textContent = `Import failed: ${e.message}`;
      status.className = "note error";
      return;
    }
    const ids = new Set(state.conversations.map((c) => c.id));
    for (const c of imported) if (ids.has(c.id)) c.id = newId();
    state.conversations = imported.concat(state.conversations);
    if (imported.length) state.currentId = imported[0].id;
    save();
    render();
    status.textContent = `Imported ${imported.length} conversation${imported.length === 1 ? "" : "s"}.`;
    status.className = "note";
  }

  // ---- settings ------------------------------------------------------------------------

  const NUMERIC = [
    ["temperature", "temperature", 0, 2],
    ["top-p", "top_p", 0.01, 1],
    ["max-tokens", "max_tokens", 1, 1e7],
  ];

  function bindSettings() {
    $("system-prompt").value = state.settings.system;
    $("system-prompt").addEventListener("input", (e) => {
      state.settings.system = e.target.value;
      localStorage.setItem(KEYS.settings, JSON.stringify(state.settings));
    });
    for (const [id, field, lo, hi] of NUMERIC) {
      const input = $(id);
      input.value = String(state.settings[field]);
      input.addEventListener("change", () => {
        let v = Number(input.value);
        if (input.value === "" || !Number.isFinite(v)) v = DEFAULT_SETTINGS[field];
        v = Math.min(hi, Math.max(lo, field === "max_tokens" ? Math.round(v) : v));
        state.settings[field] = v;
        input.value = String(v);
        localStorage.setItem(KEYS.settings, JSON.stringify(state.settings));
      });
    }
  }

  // ---- wiring --------------------------------------------------------------------------

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send($("input").value);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send($("input").value);
    }
  });
  $("stop").addEventListener("click", () => state.busy && state.busy.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("edit-last").addEventListener("click", editLast);
  $("new-chat").addEventListener("click", () => {
    if (state.busy) return;
    newConversation();
    render();
    $("input").focus();
  });
  $("conversation-list").addEventListener("click", (e) => {
    const button = e.target.closest("button");
    if (!button || state.busy) return;
    if (button.classList.contains("delete-conversation")) {
      state.conversations = state.conversations.filter((c) => c.id !== button.dataset.id);
      if (state.currentId === button.dataset.id) state.currentId = state.conversations.length ? state.conversations[0].id : null;
      if (!state.currentId) localStorage.removeItem(KEYS.current);
    } else {
      state.currentId = button.dataset.id;
    }
    save();
    render();
  });
  $("messages").addEventListener("click", (e) => {
    const button = e.target.closest("button");
    if (!button) return;
    if (button.classList.contains("copy-code")) {
      copyText(button.closest(".code-block").querySelector("code").textContent, button);
    } else if (button.classList.contains("copy-reply")) {
      const conv = current();
      const index = Number(button.closest("article").dataset.index);
      if (conv && conv.messages[index]) copyText(conv.messages[index].content, button);
    }
  });
  $("export").addEventListener("click", exportConversations);
  $("import-file").addEventListener("change", (e) => {
    if (e.target.files.length) importFile(e.target.files[0]);
    e.target.value = "";
  });
  $("key-form").addEventListener("submit", () => answerKey($("key-input").value.trim() || null));
  $("key-dialog").addEventListener("cancel", () => answerKey(null));

  bindSettings();
  render();
  loadModel();
})();
