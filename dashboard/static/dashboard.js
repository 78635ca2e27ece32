// The dashboard page: renders the collector's snapshot, pushed every second over /events.
// Plain DOM and <canvas>, no libraries: the page must work on a host with no internet access.
"use strict";

const HISTORY = 300; // points kept per chart (five minutes at one snapshot a second)
const MIN_SPAN = 60; // the x axis spans at least this many points, so a fresh page is not a sliver
const STALE_MS = 5000; // the dashboard sends a new snapshot every second; none for this long is a hang
const series = {
  latency: [
    { label: "partial p50", color: "#60a5fa", values: [] },
    { label: "partial p95", color: "#1d4ed8", values: [] },
    { label: "final p50", color: "#f59e0b", values: [] },
    { label: "final p95", color: "#b45309", values: [] },
  ],
  throughput: [
    { label: "partial", color: "#2563eb", values: [] },
    { label: "final", color: "#d97706", values: [] },
  ],
};

const $ = (selector) => document.querySelector(selector);

function number(value, digits = 0) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? `${(value * 1000).toFixed(value < 0.01 ? 2 : 0)} ms` : `${value.toFixed(2)} s`;
}

function percent(ratio) {
  return ratio === null || ratio === undefined ? "–" : `${(100 * ratio).toFixed(0)} %`;
}

function bytes(value) {
  if (value === null || value === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (value >= 1024 && i < units.length - 1) { value /= 1024; i++; }
  return `${value.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function duration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function setMetric(name, text) {
  const el = document.querySelector(`[data-metric="${name}"]`);
  if (el) el.textContent = text;
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function fillTable(table, items, fill) {
  const body = $(table).tBodies[0];
  body.replaceChildren();
  for (const item of items) fill(body.insertRow(), item);
}

function push(list, value) {
  list.push(value === undefined ? null : value);
  if (list.length > HISTORY) list.shift();
}

function render(s) {
  $("#instance").textContent = s.instance;
  const warnings = [s.supervisor_error && `supervisord: ${s.supervisor_error}`, s.state_error && `dashboard: ${s.state_error}`]
    .filter(Boolean);
  $("#warnings").hidden = !warnings.length;
  $("#warnings").textContent = warnings.join(" · ");
  $("#updated").textContent = `updated ${new Date(s.time * 1000).toLocaleTimeString()}`;

  setMetric("streams-realtime", number(s.streams.realtime || 0));
  setMetric("streams-batch", number(s.streams.batch || 0));
  setMetric("realtime-cap", s.admission.realtime_cap ? ` (cap ${s.admission.realtime_cap})` : "");
  setMetric("admission-wait", seconds(s.admission.wait_s));
  setMetric("admission-busy", percent(s.admission.busy));
  setMetric("admission-share", percent(s.admission.stream_share));
  setMetric("opens-waiting", number(s.admission.opens_waiting ?? 0));  // a dashboard before held opens has none
  setMetric("queued-realtime", number(s.queued.realtime || 0));
  setMetric("queued-batch", number(s.queued.batch || 0));
  setMetric("inflight", number(s.inflight));
  setMetric("jobs-per-s", number(s.throughput.jobs_per_s, 1));
  setMetric("jobs-total", number(s.totals.jobs));
  setMetric("batch-mean", number(s.batch.mean, 2));
  setMetric("partial-p95", seconds(s.latency.partial.p95));
  setMetric("final-p95", seconds(s.latency.final.p95));
  setMetric("to-worker-p95", seconds(s.latency.to_worker.p95));
  setMetric("to-ingest-p95", seconds(s.latency.to_ingest.p95));
  setMetric("window", number(s.window_s));
  setMetric("rings-used", number(s.rings.used));
  setMetric("rings-total", number(s.rings.total));
  $("#rings-bar").style.width = s.rings.total ? `${(100 * s.rings.used) / s.rings.total}%` : "0";
  const restarts = Object.entries(s.restarts).map(([program, n]) => `${program} ${n}`);
  $("#restarts").textContent = restarts.length ? restarts.join(", ") : "none";

  fillTable("#processes", s.processes, (row, p) => {
    row.dataset.process = p.name;
    cell(row, p.name);
    cell(row, p.state, `state-${p.state}`).title = p.why ?? "";  // FATAL: why supervisord gave up on it
    cell(row, p.pid ?? "–");
    cell(row, duration(p.uptime_s));
    cell(row, number(p.cpu_percent, 1));
    cell(row, bytes(p.rss_bytes));
    cell(row, number(p.threads));
    cell(row, number(p.open_fds));
    cell(row, number(p.restarts));
    cell(row, p.last_seen_s === null || p.last_seen_s === undefined ? "–" : `${p.last_seen_s.toFixed(1)} s ago`);
  });
  fillTable("#workers", s.workers, (row, w) => {
    row.dataset.worker = w.name;
    cell(row, w.name);
    cell(row, percent(w.busy_ratio));
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.appendChild(document.createElement("div")).style.width = `${100 * (w.busy_ratio || 0)}%`;
    row.insertCell().appendChild(bar);
  });
  $("#gpus-section").hidden = !s.gpus;
  fillTable("#gpus", s.gpus || [], (row, g) => {
    cell(row, g.gpu);
    cell(row, `${number(g.utilization_percent)} %`);
    cell(row, `${bytes(g.memory_used_bytes)} / ${bytes(g.memory_total_bytes)}`);
  });
  fillTable("#errors", s.recent_errors.slice(0, 20), (row, e) => {
    cell(row, new Date(e.time * 1000).toLocaleTimeString());
    cell(row, e.process);
    cell(row, e.kind);
    cell(row, e.code);
    cell(row, number(e.count));
  });
  $("#no-errors").hidden = s.recent_errors.length > 0;

  const [pp50, pp95, fp50, fp95] = series.latency;
  push(pp50.values, s.latency.partial.p50);
  push(pp95.values, s.latency.partial.p95);
  push(fp50.values, s.latency.final.p50);
  push(fp95.values, s.latency.final.p95);
  push(series.throughput[0].values, s.throughput.by_kind.partial || 0);
  push(series.throughput[1].values, s.throughput.by_kind.final || 0);
  drawChart($("#latency-chart"), series.latency, seconds);
  drawChart($("#throughput-chart"), series.throughput, (v) => number(v, v < 10 ? 1 : 0));
}

// A line chart of `lines` (each { label, color, values }) sharing one y axis from zero.
function drawChart(canvas, lines, format) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== width * ratio || canvas.height !== height * ratio) {
    canvas.width = width * ratio;
    canvas.height = height * ratio;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const left = 64, right = 8, top = 22, bottom = 8;
  const plotW = width - left - right, plotH = height - top - bottom;
  const all = lines.flatMap((l) => l.values).filter((v) => v !== null);
  const max = Math.max(...all, 0) * 1.1 || 1;
  const span = Math.max(MIN_SPAN, ...lines.map((l) => l.values.length)) - 1;

  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const y = top + plotH - (plotH * i) / 4;
    ctx.strokeStyle = "#e3e6eb";
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + plotW, y); ctx.stroke();
    ctx.fillStyle = "#6b7280";
    ctx.textAlign = "right";
    ctx.fillText(format((max * i) / 4), left - 6, y);
  }
  let legendX = left;
  ctx.textAlign = "left";
  for (const line of lines) {
    ctx.fillStyle = line.color;
    ctx.fillRect(legendX, 6, 10, 10);
    ctx.fillStyle = "#1d2330";
    ctx.fillText(line.label, legendX + 14, 11);
    legendX += ctx.measureText(line.label).width + 30;

    ctx.strokeStyle = line.color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    line.values.forEach((v, i) => {
      if (v === null) { drawing = false; return; }
      const x = left + plotW - ((line.values.length - 1 - i) * plotW) / span;
      const y = top + plotH - (v / max) * plotH;
      if (drawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      drawing = true;
    });
    ctx.stroke();
  }
}

function connect() {
  const badge = $("#connection");
  const show = (text, state) => { badge.textContent = text; badge.className = `badge ${state}`; };
  let events, opened, shownTime = null, fresh = Date.now();
  const open = () => {
    opened = Date.now();
    events = new EventSource("/events");
    events.onmessage = (e) => {
      try {
        const s = JSON.parse(e.data);
        if (s.time !== shownTime) { shownTime = s.time; fresh = Date.now(); } // new, if not readable: not stale
        render(s);
        if (Date.now() - fresh < STALE_MS) show("live", "live");
      } catch (err) { // a snapshot this page cannot read: said, not left looking live
        show(`unreadable snapshot: ${err.message}`, "lost");
      }
    };
    events.onerror = () => show("reconnecting", "lost");
  };
  open();
  // A dashboard that hangs, or a tunnel to it that dropped, closes no connection, so EventSource
  // would wait for ever: without a new snapshot for STALE_MS the page says so and connects again.
  setInterval(() => {
    const now = Date.now();
    if (now - fresh < STALE_MS) return;
    show(`stale: no new snapshot for ${Math.round((now - fresh) / 1000)} s, reconnecting`, "lost");
    if (now - opened >= STALE_MS) { events.close(); open(); }
  }, 1000);
}

connect();
