"""The operator dashboard's page: one self-contained HTML document (inline CSS and
JavaScript, no external asset, font or library). It hard-codes no threshold: zones,
intervals and the stale timeout come from the feed (`topicd.http.dashboard`).

Hooks the browser test relies on: `#feed-state` reads `live`, `connecting` or `stale`
(and `body.stale` greys the page); every zoned element carries `data-zone` = `green`,
`amber` or `red`; topic, queue and router rows carry `data-topic`, `data-queue`,
`data-router`; a queue's `.worker` cell reads `worker off` when its worker is off.
"""

from __future__ import annotations

from typing import Final

PAGE: Final = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>topicd dashboard</title>
<link rel="icon" href="data:,">
<style>
:root { --green:#2e7d32; --amber:#e69500; --red:#c62828; --grey:#8a8f98;
  --bg:#f4f5f7; --card:#fff; --ink:#1d2330; --muted:#667085; --line:#e3e6ea; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif;
  background:var(--bg); color:var(--ink); }
header { display:flex; align-items:center; gap:16px; padding:10px 18px; background:#1d2330;
  color:#fff; }
header h1 { font-size:17px; margin:0; font-weight:600; }
header .meta { color:#c8ccd4; font-size:12px; }
.pill { padding:2px 10px; border-radius:999px; font-weight:600; font-size:12px;
  text-transform:uppercase; letter-spacing:.04em; background:var(--grey); color:#fff; }
#feed-state { margin-left:auto; }
main { padding:14px 18px; display:grid; gap:14px;
  grid-template-columns:repeat(auto-fill, minmax(300px, 1fr)); }
section { background:var(--card); border:1px solid var(--line); border-radius:8px;
  padding:12px 14px; min-width:0; }
section.wide { grid-column:1 / -1; }
section h2 { font-size:12px; text-transform:uppercase; letter-spacing:.06em;
  color:var(--muted); margin:0 0 8px; font-weight:600; }
.big { font-size:34px; font-weight:700; font-variant-numeric:tabular-nums; }
.kv { display:grid; grid-template-columns:auto 1fr; gap:2px 12px; font-size:13px; }
.kv dt { color:var(--muted); } .kv dd { margin:0; font-variant-numeric:tabular-nums; }
table { width:100%; border-collapse:collapse; font-size:13px; }
th { text-align:left; color:var(--muted); font-weight:600; border-bottom:1px solid var(--line);
  padding:3px 6px; white-space:nowrap; }
td { padding:3px 6px; border-bottom:1px solid var(--line); font-variant-numeric:tabular-nums;
  white-space:nowrap; overflow:hidden; text-overflow:ellipsis; max-width:260px; }
td.num, th.num { text-align:right; }
.zone { display:inline-block; width:10px; height:10px; border-radius:50%;
  background:var(--grey); margin-right:6px; vertical-align:baseline; }
[data-zone="green"] { --z:var(--green); } [data-zone="amber"] { --z:var(--amber); }
[data-zone="red"] { --z:var(--red); }
.zone[data-zone], .pill[data-zone] { background:var(--z); }
.big[data-zone] { color:var(--z); }
tr[data-zone] td:first-child { border-left:4px solid var(--z); }
.worker-off { color:var(--grey); font-style:italic; }
.empty { color:var(--muted); font-style:italic; }
canvas { width:100%; height:150px; display:block; }
.legend { font-size:12px; color:var(--muted); }
#stale-banner { display:none; background:var(--grey); color:#fff; text-align:center;
  padding:6px; font-weight:600; }
body.stale #stale-banner { display:block; }
body.stale main { filter:grayscale(1); opacity:.55; }
body.stale [data-zone] { --z:var(--grey); }
</style>
</head>
<body class="stale">
<header>
  <h1>topicd</h1>
  <span class="pill" id="status" title="worst zone on the page">&ndash;</span>
  <span class="meta">server time <span id="server-time">&ndash;</span>
    &middot; up <span id="uptime">&ndash;</span> &middot; <span id="phase">&ndash;</span></span>
  <span class="pill" id="feed-state">connecting</span>
</header>
<div id="stale-banner">stale: <span id="stale-why">waiting for the feed</span></div>
<main>
  <section>
    <h2>Pressure</h2>
    <div class="big" id="pressure-value">&ndash;</div>
    <dl class="kv" id="signals"></dl>
  </section>
  <section>
    <h2>Ladder</h2>
    <dl class="kv">
      <dt>coalesce window</dt><dd id="coalesce">&ndash;</dd>
      <dt>commit window</dt><dd id="commit-window">&ndash;</dd>
      <dt>defer</dt><dd id="defer">&ndash;</dd>
      <dt>loop lag</dt><dd id="loop-lag">&ndash;</dd>
      <dt>scheduling latency</dt><dd id="sched-latency">&ndash;</dd>
    </dl>
  </section>
  <section>
    <h2>Throughput</h2>
    <div class="big" id="rate-value">&ndash;</div>
    <dl class="kv">
      <dt>records appended</dt><dd id="appended">&ndash;</dd>
      <dt>SSE connections</dt><dd id="sse">&ndash;</dd>
      <dt>watch sessions</dt><dd id="sessions">&ndash;</dd>
      <dt>client permits in use</dt><dd id="permits">&ndash;</dd>
      <dt>429s answered</dt><dd id="throttled">&ndash;</dd>
    </dl>
  </section>
  <section>
    <h2>WAL breakers</h2>
    <table><thead><tr><th>shard</th><th>state</th><th class="num">trips</th>
      <th class="num">pending</th></tr></thead><tbody id="breakers"></tbody></table>
  </section>
  <section class="wide">
    <h2>Pressure, last minutes</h2>
    <canvas id="chart-pressure" height="150"></canvas>
    <div class="legend" id="legend-pressure"></div>
  </section>
  <section class="wide">
    <h2>Records appended per second, last minutes</h2>
    <canvas id="chart-rate" height="150"></canvas>
  </section>
  <section class="wide">
    <h2>Topics by lag <span class="legend" id="topics-count"></span></h2>
    <table><thead><tr><th>topic</th><th class="num">head seq</th><th class="num">lag</th>
      <th class="num">readers</th><th class="num">lagged streams</th></tr></thead>
      <tbody id="topics"></tbody></table>
  </section>
  <section class="wide">
    <h2>Queues <span class="legend" id="queues-count"></span></h2>
    <table><thead><tr><th>queue</th><th class="num">ready</th><th class="num">in flight</th>
      <th class="num">delayed</th><th class="num">dead-lettered</th><th>level</th>
      <th>worker</th></tr></thead><tbody id="queues"></tbody></table>
  </section>
  <section class="wide">
    <h2>Routers <span class="legend" id="routers-count"></span></h2>
    <table><thead><tr><th>router</th><th>source &rarr; dest</th><th class="num">cursor</th>
      <th class="num">lag</th><th>blocked</th></tr></thead><tbody id="routers"></tbody></table>
  </section>
  <section class="wide">
    <h2>Internal queues</h2>
    <table><thead><tr><th>queue</th><th class="num">depth</th><th class="num">capacity</th>
      <th class="num">fill</th><th class="num">peak</th><th>level</th>
      <th class="num">full</th></tr></thead><tbody id="internal"></tbody></table>
  </section>
</main>
<script>
"use strict";
(function () {
  var $ = function (id) { return document.getElementById(id); };
  var state = { thresholds: null, history: [], span: 0, last: 0, retry: 2000, es: null,
    timer: null };
  var feedUrl = location.pathname.replace(/\\/+$/, "") + "/events";

  function fmt(n, d) {
    if (typeof n !== "number") { return "\\u2013"; }
    return n.toLocaleString("en-US", { maximumFractionDigits: d === undefined ? 0 : d,
      minimumFractionDigits: d === undefined ? 0 : d });
  }
  function dur(ms) {
    var s = Math.floor(ms / 1000), h = Math.floor(s / 3600), m = Math.floor(s / 60) % 60;
    return (h ? h + "h " : "") + (h || m ? m + "m " : "") + (s % 60) + "s";
  }
  function setZone(el, z) { if (z) { el.setAttribute("data-zone", z); } }
  function cell(tr, text, cls) {
    var td = document.createElement("td");
    td.textContent = text;
    if (cls) { td.className = cls; }
    tr.appendChild(td);
    return td;
  }
  function zoned(tr, text, z) {
    var td = cell(tr, "");
    var dot = document.createElement("span");
    dot.className = "zone";
    setZone(dot, z);
    td.appendChild(dot);
    td.appendChild(document.createTextNode(text));
    return td;
  }
  function fill(id, rows, build, empty, cols) {
    var body = $(id);
    body.textContent = "";
    if (!rows.length) {
      var tr = document.createElement("tr");
      var td = cell(tr, empty, "empty");
      td.colSpan = cols;
      body.appendChild(tr);
      return;
    }
    rows.forEach(function (r) {
      var tr = document.createElement("tr");
      build(tr, r);
      body.appendChild(tr);
    });
  }

  function render(s) {
    var t = s.thresholds;
    state.thresholds = t;
    var st = $("status");
    st.textContent = { green: "nominal", amber: "elevated", red: "backpressure" }[s.status];
    setZone(st, s.status);
    $("server-time").textContent = new Date(s.server_time_ms).toLocaleTimeString();
    $("uptime").textContent = dur(s.uptime_ms);
    $("phase").textContent = s.phase;
    var pv = $("pressure-value");
    pv.textContent = fmt(s.pressure.value, 3);
    setZone(pv, s.pressure.zone);
    var sig = $("signals");
    sig.textContent = "";
    Object.keys(s.pressure.signals).forEach(function (k) {
      var dt = document.createElement("dt"), dd = document.createElement("dd");
      dt.textContent = "signal " + k;
      dd.textContent = fmt(s.pressure.signals[k], 3);
      sig.appendChild(dt); sig.appendChild(dd);
    });
    var l = s.ladder;
    $("coalesce").textContent = fmt(l.coalesce_ms, 1) + " ms";
    $("commit-window").textContent = fmt(l.commit_window_ms, 2) + " ms";
    $("defer").textContent = l.defer_active ? "active: low-priority push paused" : "off";
    setZone($("defer"), l.defer_active ? "red" : "green");
    $("loop-lag").textContent = fmt(l.loop_lag_ms, 2) + " ms";
    $("sched-latency").textContent = fmt(l.sched_latency_ms, 2) + " ms";
    $("rate-value").textContent = fmt(s.throughput.records_per_s, 0) + " /s";
    $("appended").textContent = fmt(s.throughput.records_appended);
    $("sse").textContent = fmt(s.connections.sse) + " (" + fmt(s.connections.dashboard_viewers)
      + " dashboard)";
    $("sessions").textContent = fmt(s.connections.watch_sessions);
    $("permits").textContent = fmt(s.connections.client_permits_in_use) + " (+"
      + fmt(s.connections.client_waiters) + " waiting)";
    var thr = 0;
    Object.keys(s.throttled).forEach(function (k) { thr += s.throttled[k]; });
    $("throttled").textContent = fmt(thr);

    fill("breakers", s.breakers, function (tr, b) {
      setZone(tr, b.zone);
      cell(tr, String(b.shard));
      zoned(tr, b.state.replace("_", "-"), b.zone);
      cell(tr, fmt(b.trips), "num");
      cell(tr, fmt(b.pending), "num");
    }, "no WAL (in-memory engine)", 4);
    $("topics-count").textContent = "(" + s.topics.top.length + " read of " + s.topics.count
      + " topics; amber from " + fmt(t.lag.warn) + ", red from " + fmt(t.lag.pause) + ")";
    fill("topics", s.topics.top, function (tr, r) {
      tr.setAttribute("data-topic", r.topic);
      setZone(tr, r.zone);
      zoned(tr, r.topic, r.zone);
      cell(tr, fmt(r.head_seq), "num");
      cell(tr, fmt(r.lag), "num lag");
      cell(tr, fmt(r.readers), "num");
      cell(tr, fmt(r.lagged_connections), "num");
    }, "no topic has a reader", 5);
    $("queues-count").textContent = "(" + s.queues.top.length + " of " + s.queues.count
      + "; in flight amber from " + fmt(t.inflight.warn) + ", red from "
      + fmt(t.inflight.pause) + ")";
    fill("queues", s.queues.top, function (tr, q) {
      tr.setAttribute("data-queue", q.topic);
      setZone(tr, q.zone);
      zoned(tr, q.topic, q.zone);
      cell(tr, fmt(q.ready), "num ready");
      cell(tr, fmt(q.in_flight), "num in-flight");
      cell(tr, fmt(q.delayed), "num");
      cell(tr, fmt(q.dead_lettered), "num");
      cell(tr, q.level);
      var label = { streaming: "streaming (" + q.work_streams + " /work)",
        active: "active", idle: "idle", off: "worker off" }[q.worker];
      cell(tr, q.worker === "off" ? "\\u2014 " + label : label,
        "worker" + (q.worker === "off" ? " worker-off" : ""));
    }, "no queue topics", 7);
    $("routers-count").textContent = "(" + s.routers.top.length + " of " + s.routers.count + ")";
    fill("routers", s.routers.top, function (tr, r) {
      tr.setAttribute("data-router", r.router);
      setZone(tr, r.zone);
      zoned(tr, r.router, r.zone);
      cell(tr, r.source + " \\u2192 " + r.dest);
      cell(tr, fmt(r.cursor), "num");
      cell(tr, fmt(r.lag), "num lag");
      cell(tr, r.blocked ? "dest full" : "");
    }, "no routers", 5);
    fill("internal", s.internal_queues, function (tr, q) {
      setZone(tr, q.zone);
      zoned(tr, q.name, q.zone);
      cell(tr, fmt(q.depth), "num");
      cell(tr, q.capacity ? fmt(q.capacity) : "\\u2013", "num");
      cell(tr, fmt(q.saturation * 100, 1) + " %", "num");
      cell(tr, fmt(q.peak), "num");
      cell(tr, q.level);
      cell(tr, fmt(q.full_total), "num");
    }, "none", 7);
    $("legend-pressure").textContent = "amber from " + fmt(t.pressure.warn, 2) + ", red from "
      + fmt(t.pressure.pause, 2) + "; write 429s at " + fmt(s.pressure.throttle_at, 2);
    draw();
  }

  function chart(canvas, points, yMax, bands) {
    var ratio = window.devicePixelRatio || 1;
    var w = canvas.clientWidth || 600, h = canvas.clientHeight || 150;
    canvas.width = Math.round(w * ratio);
    canvas.height = Math.round(h * ratio);
    var g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, w, h);
    var left = 44, right = 8, top = 8, bottom = 18, pw = w - left - right, ph = h - top - bottom;
    var t = state.thresholds;
    var span = state.span || 60000;
    var tEnd = points.length ? points[points.length - 1][0] : Date.now();
    var tStart = tEnd - span;
    var x = function (ms) { return left + pw * (ms - tStart) / span; };
    var y = function (v) { return top + ph * (1 - Math.min(v, yMax) / yMax); };
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = "#667085";
    g.strokeStyle = "#e3e6ea";
    g.lineWidth = 1;
    [0, 0.5, 1].forEach(function (f) {
      var v = yMax * f;
      g.beginPath(); g.moveTo(left, y(v)); g.lineTo(left + pw, y(v)); g.stroke();
      g.fillText(yMax >= 10 ? fmt(v) : fmt(v, 1), 4, y(v) + 4);
    });
    var mins = Math.round(span / 6000) / 10;
    g.fillText("\u2212" + mins + " min", left, h - 4);
    g.fillText("now", left + pw - 20, h - 4);
    (bands || []).forEach(function (b) {
      g.strokeStyle = b[1];
      g.setLineDash([4, 4]);
      g.beginPath(); g.moveTo(left, y(b[0])); g.lineTo(left + pw, y(b[0])); g.stroke();
      g.setLineDash([]);
    });
    g.strokeStyle = "#1d4ed8";
    g.lineWidth = 2;
    g.beginPath();
    var gap = t ? 3 * t.interval_ms : 3000, prev = null;
    points.forEach(function (p) {
      if (p[0] < tStart) { return; }
      if (prev === null || p[0] - prev > gap) { g.moveTo(x(p[0]), y(p[1])); }
      else { g.lineTo(x(p[0]), y(p[1])); }
      prev = p[0];
    });
    g.stroke();
  }

  function draw() {
    var t = state.thresholds;
    if (!t) { return; }
    var h = state.history;
    chart($("chart-pressure"), h.map(function (p) { return [p[0], p[1]]; }), 1,
      [[t.pressure.warn, "#e69500"], [t.pressure.pause, "#c62828"]]);
    var rates = h.map(function (p) { return [p[0], p[2]]; });
    var top = 10;
    rates.forEach(function (p) { if (p[1] > top) { top = p[1]; } });
    chart($("chart-rate"), rates, top * 1.1);
  }

  function setFeed(text) {
    var el = $("feed-state");
    el.textContent = text;
    document.body.classList.toggle("stale", text !== "live");
  }
  function check() {
    var t = state.thresholds;
    if (!state.es || state.es.readyState !== 1) {
      setFeed(state.last ? "stale" : "connecting");
      $("stale-why").textContent = "the feed is disconnected; reconnecting";
      return;
    }
    if (!t || !state.last) { setFeed("connecting"); return; }
    var age = Date.now() - state.last;
    if (age > t.stale_after_ms) {
      setFeed("stale");
      $("stale-why").textContent = "no snapshot for " + dur(age) + "; numbers are old";
    } else {
      setFeed("live");
    }
  }
  function connect() {
    var es = new EventSource(feedUrl);
    state.es = es;
    es.addEventListener("hello", function (ev) {
      var body = JSON.parse(ev.data);
      state.thresholds = body.thresholds;
      state.span = body.history_span_ms;
      state.history = body.history;
    });
    es.addEventListener("snapshot", function (ev) {
      var s = JSON.parse(ev.data);
      state.last = Date.now();
      var h = state.history;
      if (!h.length || h[h.length - 1][0] < s.point[0]) { h.push(s.point); }
      while (h.length && h[0][0] < s.point[0] - state.span) { h.shift(); }
      render(s);
      check();
    });
    es.onerror = function () {
      check();
      if (es.readyState === 2) {  // refused (an error status): retry by hand
        setTimeout(connect, state.retry);
      }
    };
  }
  connect();
  state.timer = setInterval(check, 250);
  window.addEventListener("resize", draw);
})();
</script>
</body>
</html>
"""
