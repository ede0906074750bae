// firstlight playground: streams a chat answer from /v1/chat/completions with fetch and a
// stream reader, times it in the browser beside the server's own breakdown (the usage
// chunk's "firstlight" object), and polls /status every second for the service panel.
// Stop aborts the fetch: the server sees the client leave and aborts the request.
"use strict";

const KEY_STORAGE = "firstlight.apiKey";
const POLL_MS = 1000;
const MODELS_ERROR = "models: ";
const $ = (id) => document.getElementById(id);

const conversation = []; // [{role, content}] sent with each prompt
let controller = null; // the AbortController of the answer in flight

// -- formatting ------------------------------------------------------------------------

function ms(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const value = seconds * 1000;
  return value < 10 ? `${value.toFixed(2)} ms` : value < 1000 ? `${value.toFixed(1)} ms`
    : `${(value / 1000).toFixed(2)} s`;
}

function quantile(sorted, q) {
  if (!sorted.length) return null;
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
}

function setText(id, text) { $(id).textContent = text; }

// -- the API, as any client sees it ----------------------------------------------------

function headers(json) {
  const out = {};
  if (json) out["Content-Type"] = "application/json";
  const key = $("api-key").value.trim();
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

// The message an error response carries (OpenAI schema; a 429's names its Retry-After),
// else its status line.
async function errorMessage(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON: keep the status line */ }
  return message;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

async function loadModels() {
  const select = $("model");
  try {
    const response = await fetch("/v1/models", { headers: headers(false) });
    if (!response.ok) throw new Error(await errorMessage(response));
    const body = await response.json();
    const current = select.value;
    select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
    if (body.data.some((m) => m.id === current)) select.value = current;
    if ($("error").textContent.startsWith(MODELS_ERROR)) showError(""); // e.g. a key now given
  } catch (error) {
    showError(`${MODELS_ERROR}${error.message}`);
  }
}

// SSE events of a response body, each with the time its bytes were read.
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    const at = performance.now();
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!frame.startsWith("data: ")) continue; // keepalive comment
      const data = frame.slice(6);
      if (data === "[DONE]") return;
      yield { at, event: JSON.parse(data) };
    }
  }
}

// -- one answer's timing -----------------------------------------------------------------

class AnswerTiming {
  constructor(start) {
    this.start = start;
    this.first = null;
    this.last = null;
    this.chunks = 0;
    this.gaps = []; // seconds between reads that brought new text
  }

  token(at) {
    if (this.first === null) this.first = at;
    else if (at > this.last) this.gaps.push((at - this.last) / 1000);
    this.last = at;
    this.chunks += 1;
  }

  render(usage) {
    const tokens = usage ? usage.completion_tokens : this.chunks;
    const sorted = [...this.gaps].sort((a, b) => a - b);
    setText("b-ttft", this.first === null ? "–" : ms((this.first - this.start) / 1000));
    setText("b-decode", this.first === null ? "–" : ms((this.last - this.first) / 1000));
    setText("b-e2e", this.last === null ? "–" : ms((this.last - this.start) / 1000));
    setText("b-tokens", String(tokens));
    const span = (this.last - this.first) / 1000;
    setText("b-tps", tokens > 1 && span > 0 ? ((tokens - 1) / span).toFixed(0) : "–");
    setText("b-itl50", ms(quantile(sorted, 0.5)));
    setText("b-itl99", ms(quantile(sorted, 0.99)));
    drawChart(this.gaps, quantile(sorted, 0.5));
  }
}

function renderServer(breakdown, usage) {
  const b = breakdown || {};
  setText("s-queue", ms(b.queue_s));
  setText("s-prefill", ms(b.prefill_s));
  setText("s-ttft", ms(b.ttft_s));
  setText("s-decode", ms(b.decode_s));
  setText("s-e2e", ms(b.e2e_s));
  setText("s-tokens", usage ? String(usage.completion_tokens) : "–");
  // speculative decoding: the row shows only for an answer that carried drafts
  const drafted = b.draft_tokens;
  const hasSpec = Number.isInteger(drafted) && drafted > 0 && Number.isInteger(b.accepted_tokens);
  $("spec-row").hidden = !hasSpec;
  if (hasSpec) {
    const rate = ((100 * b.accepted_tokens) / drafted).toFixed(0);
    setText("s-accept", `${b.accepted_tokens}/${drafted} (${rate}%)`);
  }
}

function resetTiming() {
  for (const id of ["b-ttft", "b-decode", "b-e2e", "b-tokens", "b-tps", "b-itl50", "b-itl99"]) setText(id, "–");
  renderServer(null, null);
  drawChart([], null);
}

// The ITL strip chart: one bar per gap, newest on the right, scaled to the larger of the
// tallest visible gap and 4× the median, so one stall does not flatten the rest.
function drawChart(gaps, median) {
  const canvas = $("itl-chart");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width;
  const height = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(width * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const bar = 3;
  const visible = gaps.slice(-Math.floor(width / bar));
  if (!visible.length) return;
  const top = Math.max(...visible, (median || 0) * 4) * 1.1;
  g.fillStyle = "#f5b942";
  visible.forEach((gap, i) => {
    const h = Math.max(1, Math.min(height, (gap / top) * height));
    g.fillRect(i * bar, height - h, bar - 1, h);
  });
  if (median) {
    const y = height - (median / top) * height;
    g.strokeStyle = "#8a99a8";
    g.setLineDash([4, 3]);
    g.beginPath();
    g.moveTo(0, y);
    g.lineTo(width, y);
    g.stroke();
    g.setLineDash([]);
  }
  const label = `${(top * 1000).toFixed(1)} ms`;
  g.font = "11px system-ui, sans-serif";
  g.fillStyle = "rgba(15, 20, 25, 0.85)";
  g.fillRect(width - g.measureText(label).width - 8, 0, g.measureText(label).width + 8, 15);
  g.fillStyle = "#8a99a8";
  g.textAlign = "right";
  g.fillText(label, width - 4, 11);
  g.textAlign = "left";
}

// -- the chat --------------------------------------------------------------------------

function addMessage(role, text) {
  const hint = document.querySelector("#messages .hint");
  if (hint) hint.remove();
  const box = document.createElement("div");
  box.className = `message ${role}`;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  box.append(body);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function note(box, text) {
  const line = document.createElement("span");
  line.className = "note";
  line.textContent = text;
  box.append(line);
}

function requestBody() {
  const body = {
    model: $("model").value,
    messages: conversation,
    stream: true,
    stream_options: { include_usage: true },
    service_tier: $("tier").value,
  };
  const temperature = $("temperature").value.trim();
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value.trim();
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  if ($("ignore-eos").checked) body.ignore_eos = true;
  return body;
}

async function send(prompt) {
  showError("");
  resetTiming();
  conversation.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const box = addMessage("assistant", "");
  box.classList.add("streaming");
  const text = box.querySelector(".text");
  controller = new AbortController();
  setBusy(true);
  const timing = new AnswerTiming(performance.now());
  let answer = "";
  let finish = null;
  let usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(true),
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    let pending = false; // one repaint per animation frame, however fast tokens come
    for await (const { at, event } of sseEvents(response.body)) {
      if (event.error) throw new Error(event.error.message);
      for (const choice of event.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          timing.token(at);
          answer += piece;
          text.textContent = answer;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (event.usage) {
        usage = event.usage;
        renderServer(event.firstlight, usage);
      }
      if (!pending) {
        pending = true;
        requestAnimationFrame(() => {
          pending = false;
          timing.render(usage);
          box.scrollIntoView({ block: "end" });
        });
      }
    }
    note(box, finish ? `finish: ${finish}` : "stream ended");
  } catch (error) {
    if (error.name === "AbortError") {
      note(box, "stopped");
    } else {
      showError(error.message);
      note(box, "failed");
    }
  } finally {
    timing.render(usage);
    box.classList.remove("streaming");
    if (answer) conversation.push({ role: "assistant", content: answer });
    else conversation.pop(); // nothing came back: the prompt can be sent again
    controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// -- the service panel -----------------------------------------------------------------

function renderStatus(s) {
  for (const [cls, suffix] of [["interactive", "i"], ["bulk", "b"]]) {
    setText(`svc-run-${suffix}`, String(s.running[cls] ?? 0));
    setText(`svc-wait-${suffix}`, String(s.waiting[cls] ?? 0));
    const ttft = s.ttft[cls] || {};
    setText(`svc-p50-${suffix}`, ms(ttft.p50_s));
    setText(`svc-p95-${suffix}`, ms(ttft.p95_s));
  }
  const span = s.ttft.interactive && s.ttft.interactive.window_s;
  setText("svc-window", span ? `TTFT over the last ${Math.round(span)} s` : "TTFT since start");
  const usage = s.kv_usage;
  setText("svc-kv", usage === null ? "–" : `${(usage * 100).toFixed(1)}%`);
  $("svc-kv-bar").style.width = `${(usage || 0) * 100}%`;
  $("svc-engines").replaceChildren(...s.engines.map((e) => {
    const item = document.createElement("li");
    const name = document.createElement("span");
    name.textContent = e.name;
    const load = document.createElement("span");
    load.textContent = `${e.running} running · ${e.waiting} waiting · KV ${(e.kv_usage * 100).toFixed(1)}%`;
    item.append(name, load);
    return item;
  }));
  setText("svc-finished", String(s.finished));
  setText("svc-cancelled", String(s.cancelled));
  setText("svc-errors", String(s.errors));
  const state = $("svc-state");
  state.textContent = `${s.engines.length} replica${s.engines.length === 1 ? "" : "s"}`;
  state.className = "state ok";
}

async function pollStatus() {
  const state = $("svc-state");
  try {
    const response = await fetch("/status", { headers: headers(false), cache: "no-store" });
    if (!response.ok) throw new Error(await errorMessage(response));
    renderStatus(await response.json());
  } catch (error) {
    state.textContent = error.message;
    state.className = "state down";
  } finally {
    setTimeout(pollStatus, POLL_MS);
  }
}

// -- wiring ----------------------------------------------------------------------------

function init() {
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORAGE) || "";
  key.addEventListener("change", () => {
    const value = key.value.trim();
    if (value) sessionStorage.setItem(KEY_STORAGE, value);
    else sessionStorage.removeItem(KEY_STORAGE);
    loadModels();
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const prompt = $("prompt").value.trim() || $("prompt").placeholder;
    $("prompt").value = "";
    if (!controller) send(prompt);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("clear").addEventListener("click", () => {
    conversation.length = 0;
    $("messages").replaceChildren();
    showError("");
    resetTiming();
  });
  $("options").addEventListener("submit", (event) => event.preventDefault());
  resetTiming();
  loadModels();
  pollStatus();
}

init();
