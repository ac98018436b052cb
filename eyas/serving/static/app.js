// eyas chat page: streams /v1/chat/completions and marks drafted-and-accepted tokens.
//
// Each streamed content chunk carries `eyas: {token_ids, num_accepted, pieces, drafted, step}`
// (see eyas/serving/app.py): one decoder step's tokens, which of them were drafted and accepted,
// and each token's text. The chunk's text can differ from its pieces (text held back for stop
// strings or incomplete UTF-8); the chunk's text is then shown as one span for the step.
"use strict";

const $ = (sel) => document.querySelector(sel);
const MAX_RUNS = 10;
const state = { model: null, messages: [], runs: [], busy: false, abort: null, runNo: 0 };

// ---- server calls --------------------------------------------------------------------------

class ApiFailure extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function errorOf(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error) return body.error.message || JSON.stringify(body.error);
  } catch (_) { /* not JSON: show the raw body */ }
  return text || response.statusText;
}

// fetch() with the server's API key (eyas serve --api-key): asked for once when a request gets 401,
// kept for this tab only (sessionStorage), and sent as `Authorization: Bearer KEY`.
async function api(path, init = {}) {
  for (let attempt = 0; ; attempt++) {
    const key = sessionStorage.getItem("eyas-api-key");
    const headers = { ...(init.headers || {}), ...(key ? { Authorization: `Bearer ${key}` } : {}) };
    const r = await fetch(path, { ...init, headers });
    if (r.status !== 401 || attempt > 0) return r;
    const given = window.prompt("This server needs an API key (eyas serve --api-key):");
    if (!given) return r;
    sessionStorage.setItem("eyas-api-key", given.trim());
  }
}

async function loadModel() {
  try {
    const r = await api("/v1/models");
    if (!r.ok) throw new ApiFailure(r.status, await errorOf(r));
    state.model = (await r.json()).data[0].id;
    $("#model").textContent = state.model;
    $("#status-dot").className = "dot ok";
  } catch (e) {
    $("#model").textContent = "unavailable";
    $("#status-dot").className = "dot bad";
    showBanner(`Could not load the model list: ${describe(e)}`);
  }
}

// Server-sent events from a fetch() body: yields each `data:` payload parsed as JSON.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf = (buf + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function requestBody(speculate) {
  return {
    model: state.model,
    messages: state.messages,
    stream: true,
    max_tokens: parseInt($("#max-tokens").value, 10) || 1,
    temperature: parseFloat($("#temperature").value),
    speculate,
  };
}

async function send() {
  const text = $("#prompt").value.trim();
  if (!text || state.busy) return;
  hideBanner();
  $("#prompt").value = "";
  state.messages.push({ role: "user", content: text });
  addUserMessage(text);
  const view = new Answer($("#speculate").checked);
  setBusy(true);
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(view.speculate)),
      signal: state.abort.signal,
    });
    if (!r.ok) throw new ApiFailure(r.status, await errorOf(r));
    for await (const ev of sseEvents(r)) {
      if (ev.error) throw new ApiFailure(null, ev.error.message);
      const choice = ev.choices && ev.choices[0];
      if (!choice) continue;
      if (choice.delta && choice.delta.content) view.add(choice.delta.content, ev.eyas);
      if (choice.finish_reason) view.finish(choice.finish_reason, ev.eyas);
    }
    if (!view.done) view.finish("abort", null);
    state.messages.push({ role: "assistant", content: view.text });
    addRun(view);
  } catch (e) {
    state.messages.pop(); // the failed turn leaves the history, so the next message is sent cleanly
    view.fail(e);
  } finally {
    setBusy(false);
  }
}

// ---- one streamed answer -------------------------------------------------------------------

class Answer {
  constructor(speculate) {
    this.speculate = speculate;
    this.text = "";
    this.tokens = this.accepted = this.steps = 0;
    this.t0 = performance.now();
    this.tFirst = this.tLast = null;
    this.firstTokens = 0; // tokens of the first chunk (the prefill's), left out of tokens/s
    this.done = false;
    this.el = element("div", "msg assistant");
    this.el.dataset.state = "streaming";
    this.el.dataset.speculate = speculate ? "on" : "off";
    const head = element("div", "who", "assistant");
    head.append(element("span", `badge ${speculate ? "on" : "off"}`, speculate ? "speculative" : "plain"));
    this.body = element("div", "body tokens");
    this.foot = element("div", "foot", "waiting for the first token…");
    this.el.append(head, this.body, this.foot);
    appendToLog(this.el);
    showStats(this, null);
  }

  add(content, info) {
    const now = performance.now();
    if (this.tFirst === null) {
      this.tFirst = now;
      this.firstTokens = info ? info.token_ids.length : 1;
    }
    this.tLast = now;
    this.text += content;
    if (info) {
      this.tokens += info.token_ids.length;
      this.accepted += info.num_accepted;
      this.steps = Math.max(this.steps, info.step);
    }
    this.body.append(stepSpan(content, info));
    keepScrolled();
    this.foot.textContent = summary(this.live(), "streaming");
    showStats(this, null);
  }

  // Live numbers: tau = 1 + accepted / verification steps (vLLM's definition; step 0 is prefill).
  live() {
    const secs = this.tFirst === null ? 0 : (this.tLast - this.tFirst) / 1000;
    const decoded = this.tokens - this.firstTokens;
    return {
      tokens: this.tokens,
      tps: secs > 0 && decoded > 0 ? decoded / secs : null,
      tau: this.steps > 0 ? 1 + this.accepted / this.steps : null,
      ttft: this.tFirst === null ? null : (this.tFirst - this.t0) / 1000,
    };
  }

  finish(reason, stats) {
    this.done = true;
    this.tLast = performance.now();
    if (stats) {
      this.final = stats;
      this.tokens = stats.token_ids.length;
      this.accepted = stats.accepted;
      this.steps = stats.steps;
    }
    const live = this.live();
    if (stats) live.tau = stats.mean_accepted_length;
    this.result = live;
    this.el.dataset.state = "done";
    this.foot.textContent = summary(live, reason === "length" ? "stopped at max tokens" : reason);
    showStats(this, stats);
  }

  fail(e) {
    this.done = true;
    this.el.dataset.state = "error";
    this.el.classList.add("error");
    this.foot.textContent = "";
    this.body.append(element("div", "error-box", describe(e)));
    keepScrolled();
  }
}

function describe(e) {
  if (e.name === "AbortError") return "Stopped.";
  if (e instanceof ApiFailure) return e.status ? `Error ${e.status}: ${e.message}` : `Error: ${e.message}`;
  return `Error: ${e.message || e}`;
}

function summary(live, tail) {
  const parts = [`${live.tokens} tokens`];
  if (live.tps !== null) parts.push(`${live.tps.toFixed(1)} tok/s`);
  if (live.tau !== null) parts.push(`τ ${live.tau.toFixed(2)}`);
  if (live.ttft !== null) parts.push(`first token ${(live.ttft * 1000).toFixed(0)} ms`);
  return `${parts.join(" · ")} · ${tail}`;
}

// One verification step: its accepted drafts highlighted, the target's token plain.
function stepSpan(content, info) {
  const step = element("span", "step");
  if (!info) {
    step.append(element("span", "tok tgt", content));
    return step;
  }
  const n = info.token_ids.length, k = info.num_accepted;
  Object.assign(step.dataset, { step: info.step, tokens: n, accepted: k });
  step.classList.add(info.step % 2 ? "odd" : "even");
  if (info.pieces && info.pieces.join("") === content) {
    info.pieces.forEach((piece, i) => {
      if (piece) step.append(element("span", info.drafted[i] ? "tok acc" : "tok tgt", piece));
    });
  } else { // text and tokens do not line up: mark the whole chunk
    step.append(element("span", k === 0 ? "tok tgt" : k === n ? "tok acc" : "tok mix", content));
  }
  return step;
}

function tooltipText(tok) {
  const step = tok.closest(".step");
  const own = tok.classList.contains("acc") ? "drafted & accepted"
    : tok.classList.contains("mix") ? "part drafted" : "from the target";
  if (!step || step.dataset.step === undefined) return `This token: ${own}.`;
  const s = +step.dataset.step, n = +step.dataset.tokens, k = +step.dataset.accepted;
  if (s === 0) return "Prefill: the first token, from the target.";
  const drafts = `${k} drafted token${k === 1 ? "" : "s"} accepted`;
  return `Step ${s}: ${drafts} + ${n - k} from the target. This token: ${own}.`;
}

// ---- stats panel and run table -------------------------------------------------------------

function fmt(x, digits) {
  return x === null || x === undefined || Number.isNaN(x) ? "–" : x.toFixed(digits);
}

function showStats(answer, stats) {
  const live = answer.result || answer.live();
  $("#stats-label").textContent = answer.done ? (answer.speculate ? "last answer" : "last answer, plain")
    : "streaming…";
  $("#stat-tps").textContent = fmt(live.tps, 1);
  $("#stat-tau").textContent = fmt(live.tau, 2);
  $("#stat-tokens").textContent = live.tokens;
  $("#stat-steps").textContent = answer.steps;
  $("#stat-ttft").textContent = live.ttft === null ? "–" : `${(live.ttft * 1000).toFixed(0)} ms`;
  $("#stat-accepted").textContent = answer.accepted;
  $("#stat-drafted").textContent = stats ? stats.drafted : "–";
  $("#stat-prompt").textContent = stats && stats.prompt_tokens !== undefined
    ? `${stats.prompt_tokens} (${stats.cached_tokens} reused)` : "–";
  $("#stat-rate").textContent = stats && stats.drafted
    ? `${((100 * stats.accepted) / stats.drafted).toFixed(0)} %` : "–";
  if (stats || !answer.done) drawHistogram(stats);
}

// accepted_per_position[i]: steps whose draft token i+1 was accepted; bar = share of all steps.
function drawHistogram(stats) {
  const box = $("#histogram");
  box.replaceChildren();
  const counts = stats ? stats.accepted_per_position || [] : [];
  if (!stats) return box.append(element("span", "muted", "when the answer is complete"));
  if (!stats.drafted || !counts.length) return box.append(element("span", "muted", "no drafts (speculation off)"));
  counts.forEach((c, i) => {
    const share = stats.steps ? c / stats.steps : 0;
    const bar = element("div", "bar");
    bar.title = `draft position ${i + 1}: accepted in ${c} of ${stats.steps} steps`;
    const fill = element("div", "fill");
    fill.style.height = `${Math.max(2, share * 100)}%`;
    bar.append(element("span", "val", `${Math.round(share * 100)}%`), fill, element("span", "pos", `${i + 1}`));
    box.append(bar);
  });
}

function addRun(answer) {
  const r = answer.result;
  state.runs.unshift({ no: ++state.runNo, spec: answer.speculate, tokens: r.tokens, tps: r.tps, tau: r.tau });
  state.runs.length = Math.min(state.runs.length, MAX_RUNS);
  drawRuns();
}

function drawRuns() {
  const plain = state.runs.filter((r) => !r.spec && r.tps);
  const base = plain.length ? plain.reduce((a, r) => a + r.tps, 0) / plain.length : null;
  $("#runs").replaceChildren(...state.runs.map((r) => {
    const tr = element("tr", r.spec ? "on" : "off");
    const speedup = base && r.tps ? `${(r.tps / base).toFixed(2)}×` : "–";
    [r.no, r.spec ? "on" : "off", r.tokens, fmt(r.tps, 1), fmt(r.tau, 2), speedup]
      .forEach((v) => tr.append(element("td", "", String(v))));
    return tr;
  }));
}

// ---- page plumbing -------------------------------------------------------------------------

function element(tag, cls, text) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text !== undefined) el.textContent = text;
  return el;
}

function appendToLog(el) {
  const empty = $("#empty");
  if (empty) empty.remove();
  $("#log").append(el);
  keepScrolled();
}

function keepScrolled() {
  const log = $("#log");
  log.scrollTop = log.scrollHeight;
}

function addUserMessage(text) {
  const msg = element("div", "msg user");
  msg.append(element("div", "who", "you"), element("div", "body", text));
  appendToLog(msg);
}

function setBusy(busy) {
  state.busy = busy;
  state.abort = busy ? new AbortController() : null;
  $("#send").disabled = busy;
  $("#stop").hidden = !busy;
}

function showBanner(text) {
  $("#banner").textContent = text;
  $("#banner").hidden = false;
}

function hideBanner() {
  $("#banner").hidden = true;
}

function moveTooltip(ev) {
  const tip = $("#tooltip");
  const tok = ev.target.closest && ev.target.closest(".tokens .tok");
  document.querySelectorAll(".step.hover").forEach((s) => s.classList.remove("hover"));
  if (!tok) return void (tip.hidden = true);
  const step = tok.closest(".step");
  if (step) step.classList.add("hover");
  tip.textContent = tooltipText(tok);
  tip.hidden = false;
  const x = Math.min(ev.clientX + 12, window.innerWidth - tip.offsetWidth - 8);
  tip.style.left = `${x}px`;
  tip.style.top = `${ev.clientY + 16}px`;
}

function wire() {
  $("#composer").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  $("#prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
  });
  $("#stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("#speculate").addEventListener("change", (ev) => {
    $("#spec-state").textContent = ev.target.checked ? "on" : "off";
  });
  $("#temperature").addEventListener("input", (ev) => {
    $("#temp-out").textContent = parseFloat(ev.target.value).toFixed(2);
  });
  $("#reset").addEventListener("click", () => {
    if (state.busy) state.abort.abort();
    state.messages = [];
    $("#log").replaceChildren();
    hideBanner();
  });
  $("#clear-runs").addEventListener("click", () => { state.runs = []; drawRuns(); });
  $("#log").addEventListener("mousemove", moveTooltip);
  $("#log").addEventListener("mouseleave", () => { $("#tooltip").hidden = true; });
}

wire();
loadModel();
