// The chat page: conversations kept in this browser, replies streamed from /v1/chat/completions with
// LSE's own fields shown (reasoning, stop_reason, lse_context, timings, lse_warnings), the model's
// thinking levels and sampling defaults from /v1/models, and what runs where from /v1/lse/status.
// Every text that comes from the model or the server is set as textContent (render.js for replies).

import { ApiError, apiKey, getJSON, postJSON, streamJSON } from "./api.js";
import { copyText, element, renderMarkdown } from "./render.js";

const STORAGE = { conversations: "lse.conversations", current: "lse.current", settings: "lse.settings",
  model: "lse.model" };
// The sampling fields the page offers, and the generation_defaults entry that prefills each.
const SAMPLING = [
  { field: "temperature", label: "Temperature", step: "0.05", min: "0" },
  { field: "top_k", label: "Top-k", step: "1", min: "-1" },
  { field: "top_p", label: "Top-p", step: "0.01", min: "0", max: "1" },
  { field: "min_p", label: "Min-p", step: "0.01", min: "0", max: "1" },
  { field: "repetition_penalty", label: "Repetition penalty", step: "0.05", min: "0" },
  { field: "presence_penalty", label: "Presence penalty", step: "0.1" },
  { field: "max_tokens", label: "Max tokens", step: "1", min: "1", defaultField: "max_new_tokens",
    none: "no limit" },
  { field: "seed", label: "Seed", step: "1", min: "0", defaultField: null, none: "random" },
];
const STOP_REASONS = {
  stop_token: "the model ended its turn",
  stop_sequence: "a stop string",
  max_tokens: "the token limit",
  context_full: "the context is full",
  cancelled: "stopped",
};
const CONTEXT_WARN = 0.75; // the meter turns amber here and red at CONTEXT_FULL, with a line saying so
const CONTEXT_FULL = 0.9;
const STATUS_REFRESH_MS = 5000;

const $ = (selector) => document.querySelector(selector);

function button(text, className, label) {
  const node = element("button", className, text);
  node.type = "button";
  if (label) node.setAttribute("aria-label", label);
  return node;
}

function stored(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

const state = {
  model: null, // the /v1/models entry
  conversations: stored(STORAGE.conversations, []),
  currentId: localStorage.getItem(STORAGE.current),
  running: null, // {controller, reply} while a reply streams
  settings: { sampling: {}, level: null }, // what the user chose for this model
  status: null, // the last /v1/lse/status
};

// ---- conversations ----

function current() {
  let conversation = state.conversations.find((c) => c.id === state.currentId);
  if (!conversation) conversation = newConversation();
  return conversation;
}

function newConversation() {
  const conversation = { id: crypto.randomUUID(), title: "New chat", messages: [], updated: Date.now() };
  state.conversations.unshift(conversation);
  state.currentId = conversation.id;
  save();
  return conversation;
}

function save() {
  localStorage.setItem(STORAGE.conversations, JSON.stringify(state.conversations));
  localStorage.setItem(STORAGE.current, state.currentId);
}

function touch(conversation) {
  const first = conversation.messages.find((m) => m.role === "user");
  conversation.title = first ? first.content.slice(0, 60) || "New chat" : "New chat";
  conversation.updated = Date.now();
  state.conversations.sort((a, b) => b.updated - a.updated);
  save();
}

function selectConversation(id) {
  stop();
  state.currentId = id;
  save();
  render();
  closeOverlays();
}

function deleteConversation(id) {
  if (state.currentId === id) stop();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = state.conversations[0]?.id ?? null;
  save();
  render();
}

function renderConversationList() {
  const list = $("#conversation-list");
  list.replaceChildren();
  for (const conversation of state.conversations) {
    const item = element("li");
    const open = button(conversation.title, "conversation-title");
    if (conversation.id === state.currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => selectConversation(conversation.id));
    const remove = button("×", "delete-conversation", `Delete the chat “${conversation.title}”`);
    remove.addEventListener("click", () => deleteConversation(conversation.id));
    item.append(open, remove);
    list.append(item);
  }
}

// ---- messages ----

function render() {
  const conversation = current();
  const box = $("#messages");
  box.replaceChildren();
  conversation.messages.forEach((message, index) => box.append(messageView(conversation, message, index)));
  if (!conversation.messages.length && state.model) {
    box.append(element("p", "empty", `Ask ${state.model.id} something.`));
  }
  renderConversationList();
  renderContext();
  renderReplyWarnings();
}

function messageView(conversation, message, index) {
  const view = element("article", `message ${message.role}`);
  view.dataset.index = index;
  view.append(element("div", "role", message.role === "user" ? "You" : message.model ?? "Model"));
  if (message.role === "assistant") {
    const reasoning = element("details", "reasoning");
    reasoning.append(element("summary"), element("div", "reasoning-text"));
    view.append(reasoning);
  }
  view.append(element("div", "content"));
  if (message.role === "assistant") view.append(element("div", "meta"));
  view.append(actions(conversation, message, index));
  fill(view, message);
  return view;
}

// Writes a message's text and, for a reply, its reasoning, state and figures into its view.
function fill(view, message) {
  const content = view.querySelector(".content");
  content.replaceChildren(message.role === "assistant" ? renderMarkdown(message.content) : message.content);
  if (message.role !== "assistant") return;
  view.dataset.state = message.state;
  if (message.stop_reason) view.dataset.stopReason = message.stop_reason;
  const reasoning = view.querySelector(".reasoning");
  reasoning.hidden = !message.reasoning;
  reasoning.querySelector("summary").textContent =
    message.state === "streaming" && !message.content ? "Thinking…" : `Reasoning (${message.reasoning.length} characters)`;
  reasoning.querySelector(".reasoning-text").textContent = message.reasoning;
  view.querySelector(".meta").replaceChildren(...metaLines(message));
}

function metaLines(message) {
  if (message.state === "streaming") return [element("span", "streaming", "writing…")];
  const lines = [];
  if (message.error) {
    const code = message.error.code ? ` (${message.error.code}${message.error.param ? `, ${message.error.param}` : ""})` : "";
    lines.push(element("p", "error", `Error: ${message.error.message}${code}`));
  }
  const figures = [];
  const { timings, usage } = message;
  if (timings) {
    figures.push(`${timings.predicted_n} tokens`, `${timings.predicted_per_second.toFixed(1)} tok/s`,
      `first token after ${Math.round(timings.prompt_ms)} ms`);
  }
  if (usage) {
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    figures.push(`prompt ${usage.prompt_tokens} tokens${cached ? ` (${cached} cached)` : ""}`);
  }
  if (message.level) figures.push(`thinking: ${message.level}`);
  if (message.ranOn?.length) figures.push(`ran on ${message.ranOn.join(", ")}`);
  if (figures.length) lines.push(element("span", "figures", figures.join(" · ")));
  if (message.stop_reason) {
    const reason = element("span", "stop-reason", `ended: ${STOP_REASONS[message.stop_reason] ?? message.stop_reason}`);
    reason.append(" ", element("code", null, message.stop_reason));
    lines.push(reason);
  }
  lines.push(...(message.lse_warnings ?? []).map(warningLine));
  return lines;
}

function actions(conversation, message, index) {
  const bar = element("div", "actions");
  const copy = button("Copy", "copy-message", message.role === "user" ? "Copy the message" : "Copy the reply");
  copy.addEventListener("click", () => copied(copy, message.content));
  bar.append(copy);
  if (message.role === "user") {
    const edit = button("Edit", "edit", "Edit and resend the message");
    edit.addEventListener("click", () => startEdit(conversation, index));
    bar.append(edit);
  } else if (index === conversation.messages.length - 1) {
    const again = button("Regenerate", "regenerate", "Regenerate the reply");
    again.addEventListener("click", () => regenerate(conversation));
    bar.append(again);
  }
  return bar;
}

async function copied(control, text) {
  try {
    await copyText(text);
    control.textContent = "Copied";
  } catch {
    control.textContent = "Copy failed";
  }
  setTimeout(() => { control.textContent = "Copy"; }, 1500);
}

function startEdit(conversation, index) {
  if (state.running) return;
  const view = $(`#messages [data-index="${index}"]`);
  const editor = element("textarea", "editor");
  editor.value = conversation.messages[index].content;
  editor.setAttribute("aria-label", "Edit the message");
  const send = button("Send", "edit-send");
  const cancel = button("Cancel", "edit-cancel");
  const submit = () => {
    conversation.messages.splice(index); // the message and everything after it
    conversation.messages.push({ role: "user", content: editor.value });
    generate(conversation);
  };
  send.addEventListener("click", submit);
  cancel.addEventListener("click", render);
  editor.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      submit();
    } else if (event.key === "Escape") {
      render();
    }
  });
  const bar = element("div", "actions");
  bar.append(send, cancel);
  view.querySelector(".content").replaceChildren(editor);
  view.querySelector(".actions").replaceWith(bar);
  editor.focus();
}

function regenerate(conversation) {
  if (state.running) return;
  conversation.messages.pop();
  generate(conversation);
}

// ---- a reply ----

function send() {
  const prompt = $("#prompt");
  const text = prompt.value;
  if (!text.trim() || state.running || !state.model) return;
  prompt.value = "";
  const conversation = current();
  conversation.messages.push({ role: "user", content: text });
  generate(conversation);
}

async function generate(conversation) {
  const history = conversation.messages.filter((m) => !m.error).map((m) => ({ role: m.role, content: m.content }));
  const body = requestBody(history);
  const reply = { role: "assistant", content: "", reasoning: "", state: "streaming", model: state.model.id,
    level: body.reasoning_effort ?? null, ranOn: planDevices() };
  conversation.messages.push(reply);
  touch(conversation);
  render();
  const view = $("#messages").lastElementChild;
  view.scrollIntoView({ block: "end" });
  const controller = new AbortController();
  state.running = { controller, reply };
  showRunning(true);
  let frame = 0;
  const box = $("#messages");
  const redraw = () => {
    frame = 0;
    // follow the reply unless the user scrolled up to read
    const following = box.scrollTop + box.clientHeight >= box.scrollHeight - 40;
    fill(view, reply);
    if (following) view.scrollIntoView({ block: "end" });
  };
  try {
    await streamJSON("v1/chat/completions", body, (chunk) => {
      const choice = chunk.choices?.[0];
      if (choice) {
        reply.content += choice.delta?.content ?? "";
        reply.reasoning += choice.delta?.reasoning_content ?? "";
        if (choice.stop_reason) reply.stop_reason = choice.stop_reason;
      }
      for (const field of ["lse_context", "timings", "lse_warnings", "usage"]) {
        if (chunk[field]) reply[field] = chunk[field];
      }
      frame ||= requestAnimationFrame(redraw);
    }, controller.signal);
  } catch (error) {
    if (error.name === "AbortError") {
      // the server saw the connection close and ended the sequence with this stop_reason
      reply.stop_reason = "cancelled";
    } else {
      reply.error = error instanceof ApiError ? error.error : { message: String(error) };
      reply.error.message ??= error.message;
      if (reply.error.lse_context) reply.lse_context = reply.error.lse_context;
      if (error.status === 401) askForKey(error.message);
    }
  } finally {
    cancelAnimationFrame(frame);
    reply.state = reply.error ? "error" : "done";
    state.running = null;
    showRunning(false);
    touch(conversation);
    if (conversation.id === state.currentId) render();
    refreshStatus();
  }
}

function requestBody(messages) {
  // the usage chunk tells the whole prompt and how much of it the KV cache already held
  const body = { model: state.model.id, messages, stream: true, stream_options: { include_usage: true },
    ...chosenSampling() };
  const level = chosenLevel();
  if (level) body.reasoning_effort = level;
  return body;
}

function stop() {
  state.running?.controller.abort();
}

function showRunning(running) {
  $("#send").hidden = running;
  $("#stop").hidden = !running;
  if (running) $("#stop").focus();
  else $("#prompt").focus();
}

// ---- the context meter ----

function renderContext() {
  if (!state.model) return;
  const messages = current().messages;
  const last = [...messages].reverse().find((m) => m.lse_context);
  const length = state.model.context_length;
  const used = last?.lse_context.tokens_used ?? 0;
  const remaining = last?.lse_context.tokens_remaining ?? length;
  const meter = $("#context-meter");
  Object.assign(meter, { max: length, low: CONTEXT_WARN * length, high: CONTEXT_FULL * length, value: used });
  meter.dataset.used = used;
  $("#context-text").textContent = `${used} of ${length} tokens used · ${remaining} left`;
  const ended = messages.at(-1);
  let warning = "";
  if (ended?.stop_reason === "context_full" || ended?.error?.code === "context_full") {
    warning = "The context is full: the last reply was cut there (context_full). Start a new chat, or edit an " +
      "earlier message to shorten this one.";
  } else if (used >= CONTEXT_WARN * length) {
    warning = `The context is ${Math.round((100 * used) / length)}% full; a new chat soon gives replies room.`;
  }
  const line = $("#context-warning");
  line.textContent = warning;
  line.hidden = !warning;
  $("#context").classList.toggle("filling", used >= CONTEXT_WARN * length);
}

// ---- the model: thinking levels and sampling defaults ----

function setUpModel() {
  const model = state.model;
  $("#model-name").textContent = `${model.id} · ${model.context_length} tokens of context`;
  state.settings = { sampling: {}, level: null, ...stored(STORAGE.settings, {})[model.id] };
  const thinking = model.thinking;
  const picker = $("#thinking-picker");
  picker.hidden = !thinking.supported;
  const select = $("#thinking-level");
  select.replaceChildren(...thinking.levels.map((level) => {
    const option = element("option", null, level.default ? `${level.id} (default)` : level.id);
    option.value = level.id;
    if (level.instruction) option.title = level.instruction;
    return option;
  }));
  select.value = thinking.levels.some((l) => l.id === state.settings.level) ? state.settings.level
    : thinking.default_level ?? "";
  renderSampling();
  $("#send").disabled = false;
}

function chosenLevel() {
  return state.model.thinking.supported ? $("#thinking-level").value || null : null;
}

function defaultOf(spec) {
  const defaults = state.model.generation_defaults;
  if (spec.defaultField === null) return { value: null, source: null };
  const name = spec.defaultField ?? spec.field;
  return { value: defaults[name] ?? null, source: defaults.sources?.[name] ?? null };
}

function renderSampling() {
  const box = $("#sampling");
  box.replaceChildren();
  for (const spec of SAMPLING) {
    const { value, source } = defaultOf(spec);
    const row = element("label", "sampling-row");
    const input = element("input");
    Object.assign(input, { type: "number", step: spec.step, name: spec.field });
    if (spec.min !== undefined) input.min = spec.min;
    if (spec.max !== undefined) input.max = spec.max;
    input.placeholder = spec.none ?? "";
    const chosen = state.settings.sampling[spec.field];
    input.value = chosen ?? value ?? "";
    const origin = element("span", "source");
    const showOrigin = () => {
      const changed = state.settings.sampling[spec.field] !== undefined;
      origin.textContent = changed ? "set here" : source ? `default from ${source}` : "";
      row.classList.toggle("changed", changed);
    };
    input.addEventListener("input", () => {
      const number = input.value === "" ? null : Number(input.value);
      if (number === value || (number === null && value === null)) delete state.settings.sampling[spec.field];
      else state.settings.sampling[spec.field] = number;
      saveSettings();
      showOrigin();
    });
    showOrigin();
    row.append(element("span", "sampling-label", spec.label), input, origin);
    box.append(row);
  }
}

// The fields the user changed; the rest the server fills from the model's files, as its sources say.
function chosenSampling() {
  return Object.fromEntries(Object.entries(state.settings.sampling).filter(([, value]) => value !== null));
}

function saveSettings() {
  const all = stored(STORAGE.settings, {});
  all[state.model.id] = { ...state.settings, level: $("#thinking-level").value || null };
  localStorage.setItem(STORAGE.settings, JSON.stringify(all));
}

// ---- devices ----

// Where a fused group runs: its device, "cpu:0 (CPU fallback)" when no pool device has a kernel for
// it, "refused" when fallback is disabled.
function placedOn(placement) {
  const device = placement.device ?? "refused";
  return placement.cpu_fallback ? `${device} (CPU fallback)` : device;
}

function planDevices() {
  return [...new Set((state.status?.placements ?? []).map(placedOn))];
}

async function refreshStatus() {
  try {
    state.status = await getJSON(`v1/lse/status?model=${encodeURIComponent(state.model?.id ?? "")}`);
  } catch (error) {
    state.status = null;
    $("#devices").replaceChildren(element("p", "error", `Status unavailable: ${error.message}`));
    return;
  }
  renderStatus(state.status);
}

function renderStatus(status) {
  const box = $("#devices");
  const planOpen = box.querySelector(".plan")?.open ?? false; // a refresh keeps the table as the user left it
  box.replaceChildren();
  const pool = element("ul", "device-list");
  for (const device of status.devices) {
    const item = element("li", "device");
    item.dataset.device = device.name;
    item.append(element("strong", null, device.name), ` ${device.kind} · ${device.description}`);
    pool.append(item);
  }
  box.append(element("h3", null, "Pool"), pool);

  const byDevice = new Map();
  for (const placement of status.placements) {
    const where = placedOn(placement);
    byDevice.set(where, (byDevice.get(where) ?? 0) + 1);
  }
  const plan = element("details", "plan");
  plan.open = planOpen;
  const summary = [...byDevice].map(([name, n]) => `${n} on ${name}`).join(", ");
  plan.append(element("summary", null, `Plan: ${status.placements.length} fused groups (${summary})`));
  const table = element("table", "placements");
  const head = element("tr");
  for (const title of ["Group", "Layer", "Ops", "Device"]) head.append(element("th", null, title));
  table.append(head);
  for (const placement of status.placements) {
    const row = element("tr");
    row.dataset.device = placement.device ?? "";
    row.append(element("td", null, placement.group), element("td", null, placement.layer < 0 ? "" : placement.layer),
      element("td", null, placement.ops.join(", ")), element("td", null, placedOn(placement)));
    if (placement.cpu_fallback) row.title = placement.cpu_fallback;
    table.append(row);
  }
  plan.append(table);
  box.append(plan);

  const engine = status.engine;
  const fallback = engine.cpu_fallback;
  box.append(element("p", "engine",
    `${engine.running} running, ${engine.waiting} waiting, ${engine.free_slots} of ${engine.slots} KV slots free`));
  const fallbackLine = element("p", "cpu-fallback",
    `CPU fallback: ${fallback.allowed ? "allowed" : "refused (--no-cpu-fallback)"}, ${fallback.total} so far`);
  box.append(fallbackLine);
  if (fallback.events.length) {
    const events = element("ul", "fallback-events");
    for (const event of fallback.events) events.append(element("li", null, `×${event.count} ${event.cause}`));
    box.append(events);
  }
  for (const warning of [...status.startup_warnings, ...status.declined]) box.append(element("p", "warning", warning));
  box.append(element("div", "reply-warnings"));
  renderReplyWarnings();
}

// The last reply's lse_warnings, beside the server-wide counters.
function renderReplyWarnings() {
  const box = $("#devices .reply-warnings");
  if (!box) return;
  const last = current().messages.findLast((m) => m.role === "assistant" && m.state !== "streaming");
  const warnings = last?.lse_warnings ?? [];
  box.replaceChildren();
  if (!last) return;
  box.append(element("h3", null, "Last reply"));
  if (!warnings.length) box.append(element("p", null, "no lse_warnings"));
  box.append(...warnings.map(warningLine));
}

// An lse_warnings entry: a CPU fallback's cause and how often this reply ran it, or another warning.
function warningLine(warning) {
  const count = warning.count ? ` ×${warning.count}` : "";
  return element("p", "warning", `${warning.type}${count}: ${warning.cause}`);
}

// ---- the API key ----

function askForKey(reason) {
  $("#key-reason").textContent = apiKey.get()
    ? `The server refused the stored key: ${reason}` : "This server was started with --api-key.";
  $("#key-input").value = "";
  const dialog = $("#key-dialog");
  if (!dialog.open) dialog.showModal();
}

// ---- the model set: several models behind one server, each loaded when asked for ----

// A model's entry once it is loaded: before its first load the server knows no thinking levels or defaults.
async function opened(model) {
  if (model.state === "loaded") return model;
  showBanner(`Loading ${model.id}…`);
  return postJSON(`v1/lse/models/${encodeURIComponent(model.id)}/load`, {});
}

function showModels(models) {
  const picker = $("#model-choice");
  picker.hidden = models.length < 2;
  picker.replaceChildren(...models.map((m) => {
    const option = element("option", null, m.state === "failed" ? `${m.id} (failed)` : m.id);
    option.value = m.id;
    if (m.reason) option.title = m.reason;
    return option;
  }));
  picker.value = state.model.id;
}

async function chooseModel(id) {
  stop();
  try {
    const models = (await getJSON("v1/models")).data;
    state.model = await opened(models.find((m) => m.id === id));
    localStorage.setItem(STORAGE.model, id);
    showModels(models);
  } catch (error) {
    showBanner(`${id}: ${error.message}`);
    $("#model-choice").value = state.model.id;
    return;
  }
  showBanner("");
  await refreshStatus();
  setUpModel();
  render();
}

// ---- start ----

function showBanner(text) {
  const banner = $("#banner");
  banner.textContent = text;
  banner.hidden = !text;
}

async function connect() {
  try {
    const models = (await getJSON("v1/models")).data;
    const kept = localStorage.getItem(STORAGE.model);
    state.model = await opened(models.find((m) => m.id === kept) ?? models[0]);
    showModels(models);
  } catch (error) {
    if (error.status === 401) {
      showBanner("");
      askForKey(error.message);
    } else {
      const loading = error.status === 503;
      showBanner(loading ? "The model is loading…" : `Cannot reach the server: ${error.message}`);
      setTimeout(connect, loading ? 1000 : 5000);
    }
    return;
  }
  showBanner("");
  await refreshStatus(); // before the first reply, which records the devices the plan runs on
  setUpModel();
  render();
}

function closeOverlays() {
  for (const id of ["conversations", "panel"]) {
    document.getElementById(id).classList.remove("open");
    document.querySelector(`[aria-controls="${id}"]`).setAttribute("aria-expanded", "false");
  }
}

function toggleOverlay(id) {
  const panel = document.getElementById(id);
  const open = !panel.classList.contains("open");
  closeOverlays();
  panel.classList.toggle("open", open);
  document.querySelector(`[aria-controls="${id}"]`).setAttribute("aria-expanded", String(open));
  if (open) panel.querySelector("button, input, select")?.focus();
}

function wire() {
  $("#model-choice").addEventListener("change", (event) => chooseModel(event.target.value));
  $("#composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("#prompt").addEventListener("keydown", (event) => {
    // Enter sends, Shift+Enter is a new line; an IME's Enter picks a candidate
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.running) {
      event.preventDefault();
      stop();
    } else if (event.key === "Escape") {
      closeOverlays();
    }
  });
  $("#stop").addEventListener("click", stop);
  window.addEventListener("pagehide", () => {
    if (state.running) Object.assign(state.running.reply, { state: "done", stop_reason: "cancelled" });
    save(); // the text streamed so far
  });
  $("#new-conversation").addEventListener("click", () => {
    stop();
    newConversation();
    render();
    closeOverlays();
    $("#prompt").focus();
  });
  $("#thinking-level").addEventListener("change", saveSettings);
  $("#reset-sampling").addEventListener("click", () => {
    state.settings.sampling = {};
    saveSettings();
    renderSampling();
  });
  $("#refresh-status").addEventListener("click", refreshStatus);
  $("#toggle-conversations").addEventListener("click", () => toggleOverlay("conversations"));
  $("#toggle-panel").addEventListener("click", () => toggleOverlay("panel"));
  $("#messages").addEventListener("click", (event) => {
    const copy = event.target.closest(".copy-code");
    if (copy) copied(copy, copy.closest(".code-block").querySelector("code").textContent);
  });
  $("#key-dialog").addEventListener("cancel", () => {
    showBanner("This server needs an API key: reload the page to enter one.");
  });
  $("#key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    apiKey.set($("#key-input").value);
    $("#key-dialog").close();
    connect();
  });
}

// A reply still streaming when the page went away without its pagehide: closing the page closed its
// connection, so the server cancelled it.
for (const message of state.conversations.flatMap((c) => c.messages)) {
  if (message.state === "streaming") Object.assign(message, { state: "done", stop_reason: "cancelled" });
}
wire();
render();
connect();
// the load, KV slots and fallback counters move with every request, this page's or another client's
setInterval(() => {
  if (state.model && document.visibilityState === "visible") refreshStatus();
}, STATUS_REFRESH_MS);
