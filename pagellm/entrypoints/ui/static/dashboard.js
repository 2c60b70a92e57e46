// The live dashboard: polls the server's Prometheus text at /metrics every second (or
// ?interval=MS), turns it into per-engine series (gauges as they are; counters as rates;
// histograms as percentiles over the last RATE_WINDOW_S) and draws them on <canvas>.
// Everything plotted is also in window.pagellmDashboard.series[metric][engine] = [[t_ms, v]]
// (v null where undefined: no traffic), and each chart's latest values in its data-latest.
"use strict";

(function () {
  const params = new URLSearchParams(location.search);
  const INTERVAL_MS = Math.max(250, Number(params.get("interval")) || 1000);
  const RATE_WINDOW_S = 10; // prefix hit rate and latency percentiles look this far back
  const KEEP_S = 960; // longest window (15 min) plus slack
  const PREFIX = "pagellm:";
  // A counter of engine restarts, plotted as markers when the server exports it.
  const RESTART_COUNTER = "pagellm:engine_restarts_total";
  const COLORS = ["#2f6fdb", "#e0832f", "#2a9d5b", "#b4469b", "#7a5af5", "#c23a2b", "#1b9aaa", "#8a6d3b"];
  const MARKER_COLORS = { preemption: "#e08a00", restart: "#c23a2b" };
  const DASHES = [[], [6, 3], [2, 3]];

  const CHARTS = [
    { id: "requests", title: "Requests running / waiting", unit: "", metrics: [["running", "running"], ["waiting", "waiting"]], integer: true },
    { id: "kv", title: "KV cache usage", unit: "%", metrics: [["kv_cache_usage_perc", "usage"]], yCap: 100 },
    { id: "prefix", title: `Prefix cache hit rate (last ${RATE_WINDOW_S} s)`, unit: "%", metrics: [["prefix_cache_hit_rate_perc", "hit rate"]], yMax: 100 },
    { id: "spec", title: `Speculative proposals accepted (last ${RATE_WINDOW_S} s)`, unit: "%", metrics: [["spec_acceptance_perc", "accepted"]], yMax: 100 },
    { id: "prompt", title: "Prompt tokens/s", unit: "", metrics: [["prompt_tokens_per_s", "prompt"]] },
    { id: "generation", title: "Generation tokens/s", unit: "", metrics: [["generation_tokens_per_s", "generation"]] },
    { id: "ttft", title: `Time to first token (last ${RATE_WINDOW_S} s)`, unit: "s", metrics: [["ttft_p50", "p50"], ["ttft_p90", "p90"], ["ttft_p99", "p99"]] },
    { id: "tpot", title: `Time per output token (last ${RATE_WINDOW_S} s)`, unit: "s", metrics: [["tpot_p50", "p50"], ["tpot_p90", "p90"], ["tpot_p99", "p99"]] },
  ];

  const dash = {
    intervalMs: INTERVAL_MS,
    polls: 0,
    lastError: null,
    engines: [],
    series: {}, // metric -> engine -> [[t_ms, value | null]]
    markers: [], // {t, kind: "preemption" | "restart", engine, count}
    snapshots: [],
  };
  window.pagellmDashboard = dash;
  for (const chart of CHARTS) for (const [metric] of chart.metrics) dash.series[metric] = {};

  // ---- Prometheus text → snapshot ------------------------------------------------------

  const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

  function parseMetrics(text) {
    const samples = [];
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const m = SAMPLE.exec(line);
      if (!m) continue;
      const labels = {};
      if (m[2]) for (const l of m[2].matchAll(LABEL)) labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
      samples.push({ name: m[1], labels, value: Number(m[3]) });
    }
    return samples;
  }

  function emptyEngine() {
    return { running: 0, waiting: 0, kv: 0, prompt: 0, generation: 0, prefixQueries: 0, prefixHits: 0, specDrafted: 0, specAccepted: 0, preemptions: 0, restarts: 0, ttft: {}, tpot: {}, finished: {} };
  }

  // One poll's numbers per engine label; counters absent so far read as 0 (they appear at
  // their first increment).
  function snapshot(samples, t) {
    const engines = {};
    let model = null;
    const eng = (labels) => {
      const e = labels.engine === undefined ? "0" : labels.engine;
      if (!engines[e]) engines[e] = emptyEngine();
      return engines[e];
    };
    const bucket = (hist, labels, value) => {
      const le = labels.le === "+Inf" ? Infinity : Number(labels.le);
      hist[le] = (hist[le] || 0) + value;
    };
    for (const { name, labels, value } of samples) {
      if (!name.startsWith(PREFIX)) continue;
      if (labels.model_name && model === null) model = labels.model_name;
      const short = name.slice(PREFIX.length);
      switch (short) {
        case "num_requests_running": eng(labels).running = value; break;
        case "num_requests_waiting": eng(labels).waiting = value; break;
        case "kv_cache_usage_perc": eng(labels).kv = value; break;
        case "prompt_tokens_total": eng(labels).prompt = value; break;
        case "generation_tokens_total": eng(labels).generation = value; break;
        case "prefix_cache_queries_total": eng(labels).prefixQueries = value; break;
        case "prefix_cache_hits_total": eng(labels).prefixHits = value; break;
        case "num_preemptions_total": eng(labels).preemptions = value; break;
        case "spec_decode_num_draft_tokens_total": eng(labels).specDrafted = value; break;
        case "spec_decode_num_accepted_tokens_total": eng(labels).specAccepted = value; break;
        case "time_to_first_token_seconds_bucket": bucket(eng(labels).ttft, labels, value); break;
        case "inter_token_latency_seconds_bucket": bucket(eng(labels).tpot, labels, value); break;
        case "request_success_total": {
          const f = eng(labels).finished;
          f[labels.finished_reason] = (f[labels.finished_reason] || 0) + value;
          break;
        }
        default:
          if (name === RESTART_COUNTER) eng(labels).restarts = value;
      }
    }
    return { t, model, engines };
  }

  // ---- derived values ------------------------------------------------------------------

  // The q-quantile of the observations between two cumulative histograms (le -> count),
  // interpolated linearly inside its bucket; null when nothing was observed.
  function quantile(q, now, before) {
    const bounds = Object.keys(now).map(Number).sort((a, b) => a - b);
    const delta = (le) => (now[le] || 0) - ((before && before[le]) || 0);
    const total = delta(Infinity);
    if (!(total > 0)) return null;
    const rank = q * total;
    let lower = 0;
    let below = 0;
    for (const le of bounds) {
      const count = delta(le);
      if (count >= rank) {
        if (le === Infinity) return lower; // beyond the last finite bucket
        const inBucket = count - below;
        return inBucket > 0 ? lower + ((le - lower) * (rank - below)) / inBucket : le;
      }
      lower = le;
      below = count;
    }
    return null;
  }

  // The snapshot closest to `seconds` before the newest (the oldest one when there is
  // less history), so windowed values use what the page has seen.
  function lookBack(seconds) {
    const target = dash.snapshots[dash.snapshots.length - 1].t - seconds * 1000;
    let found = dash.snapshots[0];
    for (const s of dash.snapshots) {
      if (s.t > target) break;
      found = s;
    }
    return found;
  }

  function push(metric, engine, t, value) {
    const byEngine = dash.series[metric];
    if (!byEngine[engine]) byEngine[engine] = [];
    byEngine[engine].push([t, value === null || Number.isFinite(value) ? value : null]);
  }

  function addMarker(t, kind, engine, count) {
    dash.markers.push({ t, kind, engine, count });
  }

  // A counter that went down means the server (and its counters) started again.
  function counterReset(cur, prev) {
    return ["prompt", "generation", "prefixQueries", "preemptions"].some((k) => cur[k] < prev[k]);
  }

  function ingest(snap) {
    const prevSnap = dash.snapshots[dash.snapshots.length - 1] || null;
    dash.snapshots.push(snap);
    const old = lookBack(RATE_WINDOW_S);
    const t = snap.t;
    for (const [engine, cur] of Object.entries(snap.engines)) {
      const prev = prevSnap && prevSnap.engines[engine];
      const before = old !== snap ? old.engines[engine] : undefined;
      const reset = Boolean(prev && counterReset(cur, prev));
      if (reset) addMarker(t, "restart", engine, 1);
      else if (prev && cur.restarts > prev.restarts) addMarker(t, "restart", engine, cur.restarts - prev.restarts);
      if (prev && !reset && cur.preemptions > prev.preemptions) addMarker(t, "preemption", engine, cur.preemptions - prev.preemptions);
      push("running", engine, t, cur.running);
      push("waiting", engine, t, cur.waiting);
      push("kv_cache_usage_perc", engine, t, cur.kv * 100);
      const dt = prevSnap ? (t - prevSnap.t) / 1000 : 0;
      const rate = (k) => (prev && !reset && dt > 0 ? (cur[k] - prev[k]) / dt : null);
      push("prompt_tokens_per_s", engine, t, rate("prompt"));
      push("generation_tokens_per_s", engine, t, rate("generation"));
      const usable = before && !counterReset(cur, before) ? before : null;
      const queries = cur.prefixQueries - (usable ? usable.prefixQueries : 0);
      const hits = cur.prefixHits - (usable ? usable.prefixHits : 0);
      push("prefix_cache_hit_rate_perc", engine, t, usable && queries > 0 ? (100 * hits) / queries : null);
      const drafted = cur.specDrafted - (usable ? usable.specDrafted : 0);
      const accepted = cur.specAccepted - (usable ? usable.specAccepted : 0);
      push("spec_acceptance_perc", engine, t, usable && drafted > 0 ? (100 * accepted) / drafted : null);
      for (const q of [50, 90, 99]) {
        push(`ttft_p${q}`, engine, t, usable ? quantile(q / 100, cur.ttft, usable.ttft) : null);
        push(`tpot_p${q}`, engine, t, usable ? quantile(q / 100, cur.tpot, usable.tpot) : null);
      }
    }
    trim(t - KEEP_S * 1000);
    dash.engines = Object.keys(snap.engines).sort((a, b) => Number(a) - Number(b));
  }

  function trim(oldest) {
    while (dash.snapshots.length > 2 && dash.snapshots[0].t < oldest) dash.snapshots.shift();
    for (const byEngine of Object.values(dash.series)) {
      for (const points of Object.values(byEngine)) {
        let drop = 0;
        while (drop < points.length && points[drop][0] < oldest) drop++;
        if (drop) points.splice(0, drop);
      }
    }
    dash.markers = dash.markers.filter((m) => m.t >= oldest);
  }

  // ---- drawing -------------------------------------------------------------------------

  function niceStep(range, ticks) {
    const raw = range / ticks;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
    return 10 * mag;
  }

  function formatValue(v, unit) {
    if (v === null || v === undefined) return "–";
    if (unit === "s") return v < 1 ? `${(v * 1000).toFixed(v < 0.01 ? 1 : 0)} ms` : `${v.toFixed(2)} s`;
    if (unit === "%") return `${v.toFixed(1)}%`;
    if (Math.abs(v) >= 100 || Number.isInteger(v)) return v.toFixed(0);
    return String(Number(v.toFixed(Math.abs(v) < 1 ? 2 : 1)));
  }

  function chartSeries(chart) {
    const many = dash.engines.length > 1;
    const out = [];
    chart.metrics.forEach(([metric, label], mi) => {
      dash.engines.forEach((engine, ei) => {
        out.push({
          name: many ? `${label} · engine ${engine}` : label,
          points: dash.series[metric][engine] || [],
          color: COLORS[(many ? ei : mi) % COLORS.length],
          dash: many ? DASHES[mi % DASHES.length] : [],
        });
      });
    });
    return out;
  }

  function css(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }

  function drawChart(chart, card) {
    const canvas = card.querySelector("canvas");
    const dpr = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
      canvas.width = Math.round(width * dpr);
      canvas.height = Math.round(height * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const pad = { left: 54, right: 10, top: 8, bottom: 20 };
    const plotW = width - pad.left - pad.right;
    const plotH = height - pad.top - pad.bottom;
    const now = Date.now();
    const windowMs = Number(document.getElementById("window").value) * 1000;
    const x0 = now - windowMs;
    const series = chartSeries(chart);
    let top = 0;
    for (const s of series) for (const [t, v] of s.points) if (t >= x0 && v !== null && v > top) top = v;
    // The axis follows the data (at least 4 requests / 10% / 1 unit), up to yCap; yMax fixes it.
    const floor = chart.integer ? 4 : chart.unit === "%" ? 10 : 1;
    const yMax = chart.yMax || Math.min(chart.yCap || Infinity, Math.max(floor, top * 1.15));
    const step = niceStep(yMax, 4);
    const X = (t) => pad.left + ((t - x0) / windowMs) * plotW;
    const Y = (v) => pad.top + plotH - (Math.min(v, yMax) / yMax) * plotH;
    const text = css("--muted");
    const grid = css("--border");
    ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1;
    ctx.fillStyle = text;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let v = 0; v <= yMax + 1e-9; v += chart.integer ? Math.max(1, Math.round(step)) : step) {
      ctx.strokeStyle = grid;
      ctx.beginPath();
      ctx.moveTo(pad.left, Y(v));
      ctx.lineTo(pad.left + plotW, Y(v));
      ctx.stroke();
      ctx.fillText(formatValue(v, chart.unit), pad.left - 6, Y(v));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const minutes = windowMs / 60000;
    const tickMs = minutes <= 1 ? 15000 : minutes <= 5 ? 60000 : 180000;
    for (let ago = 0; ago <= windowMs; ago += tickMs) {
      const label = ago === 0 ? "now" : ago < 60000 ? `-${ago / 1000}s` : `-${ago / 60000}m`;
      ctx.fillText(label, Math.min(Math.max(X(now - ago), pad.left + 12), pad.left + plotW - 12), pad.top + plotH + 5);
    }
    for (const m of dash.markers) {
      if (m.t < x0) continue;
      ctx.strokeStyle = MARKER_COLORS[m.kind];
      ctx.setLineDash(m.kind === "restart" ? [] : [3, 3]);
      ctx.beginPath();
      ctx.moveTo(X(m.t), pad.top);
      ctx.lineTo(X(m.t), pad.top + plotH);
      ctx.stroke();
    }
    ctx.lineWidth = 1.8;
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.setLineDash(s.dash);
      ctx.beginPath();
      let drawing = false;
      for (const [t, v] of s.points) {
        if (t < x0 || v === null) {
          drawing = false;
          continue;
        }
        if (drawing) ctx.lineTo(X(t), Y(v));
        else ctx.moveTo(X(t), Y(v));
        drawing = true;
      }
      ctx.stroke();
    }
    ctx.setLineDash([]);
    const latest = {};
    const legend = card.querySelector(".legend");
    legend.replaceChildren();
    for (const s of series) {
      const last = s.points.length ? s.points[s.points.length - 1][1] : null;
      latest[s.name] = last;
      const item = document.createElement("span");
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = s.color;
      item.append(swatch, `${s.name}: ${formatValue(last, chart.unit)}`);
      legend.appendChild(item);
    }
    card.dataset.latest = JSON.stringify(latest);
  }

  function buildCharts() {
    const root = document.getElementById("charts");
    for (const chart of CHARTS) {
      const card = document.createElement("figure");
      card.className = "chart";
      card.id = `chart-${chart.id}`;
      card.style.margin = "0";
      const title = document.createElement("h2");
      title.textContent = chart.title;
      const canvas = document.createElement("canvas");
      canvas.setAttribute("role", "img");
      canvas.setAttribute("aria-label", chart.title);
      const legend = document.createElement("figcaption");
      legend.className = "legend";
      card.append(title, canvas, legend);
      root.appendChild(card);
    }
  }

  function drawTiles(snap) {
    const engines = Object.values(snap.engines);
    const sum = (f) => engines.reduce((a, e) => a + f(e), 0);
    const lastOf = (metric) => {
      let total = null;
      for (const points of Object.values(dash.series[metric])) {
        const v = points.length ? points[points.length - 1][1] : null;
        if (v !== null) total = (total || 0) + v;
      }
      return total;
    };
    const finished = (reason) => sum((e) => (reason ? e.finished[reason] || 0 : Object.values(e.finished).reduce((a, b) => a + b, 0)));
    const tiles = [
      ["running", "Running", sum((e) => e.running).toFixed(0)],
      ["waiting", "Waiting", sum((e) => e.waiting).toFixed(0)],
      ["kv", "KV cache (max)", formatValue(Math.max(0, ...engines.map((e) => e.kv * 100)), "%")],
      ["generation", "Generation tok/s", formatValue(lastOf("generation_tokens_per_s"), "")],
      ["prompt", "Prompt tok/s", formatValue(lastOf("prompt_tokens_per_s"), "")],
      ["finished", "Finished requests", finished(null).toFixed(0)],
      ["aborted", "Aborted", finished("abort").toFixed(0)],
      ["preemptions", "Preemptions", sum((e) => e.preemptions).toFixed(0)],
    ];
    const root = document.getElementById("tiles");
    root.replaceChildren();
    for (const [id, label, value] of tiles) {
      const tile = document.createElement("div");
      tile.className = "tile";
      tile.id = `tile-${id}`;
      const l = document.createElement("div");
      l.className = "label";
      l.textContent = label;
      const v = document.createElement("div");
      v.className = "value";
      v.textContent = value;
      tile.append(l, v);
      root.appendChild(tile);
    }
  }

  function redraw() {
    const last = dash.snapshots[dash.snapshots.length - 1];
    if (last) drawTiles(last);
    for (const chart of CHARTS) drawChart(chart, document.getElementById(`chart-${chart.id}`));
  }

  // ---- polling -------------------------------------------------------------------------

  function setStatus(text, isError) {
    const status = document.getElementById("status");
    status.textContent = text;
    status.className = isError ? "error" : "";
  }

  async function poll() {
    try {
      const resp = await fetch("/metrics", { cache: "no-store" });
      if (!resp.ok) throw new Error(`/metrics answered HTTP ${resp.status}`);
      const snap = snapshot(parseMetrics(await resp.text()), Date.now());
      if (Object.keys(snap.engines).length === 0) {
        setStatus("The server exports no engine metrics (started with --disable-log-stats?): nothing to plot.", true);
      } else {
        ingest(snap);
        dash.polls += 1;
        dash.lastError = null;
        const engines = dash.engines.length;
        document.getElementById("model-name").textContent = snap.model || "";
        setStatus(`${engines} engine${engines === 1 ? "" : "s"} · every ${INTERVAL_MS / 1000} s · updated ${new Date(snap.t).toLocaleTimeString()}`, false);
      }
    } catch (e) {
      dash.lastError = e.message;
      setStatus(`Cannot read /metrics: ${e.message}`, true);
    }
    redraw();
    setTimeout(poll, INTERVAL_MS);
  }

  dash.quantile = quantile; // pure helpers, for tests and the console
  dash.parseMetrics = parseMetrics;
  buildCharts();
  document.getElementById("window").addEventListener("change", redraw);
  window.addEventListener("resize", redraw);
  poll();
})();
