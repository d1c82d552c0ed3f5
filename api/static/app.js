// lorafleet dashboard: polls the REST API every POLL_MS and draws the adapter table,
// per-adapter curves and the fleet view. Every request carries the API token
// (Authorization: Bearer), taken once from `#token=...` or the login form and kept in
// this tab's sessionStorage. The DOM carries data-* attributes with what is shown
// (adapter names, steps, point counts; Tinker models, their states and steps) so a headless
// browser test can read it.
"use strict";
(() => {
  const POLL_MS = 2000;
  // A page of the table (GET /v1/adapters?limit=&offset=&q=): the page, not the fleet, is fetched,
  // so the dashboard stays usable with thousands of adapters; curves are drawn for the first
  // CURVE_SERIES adapters of the page (one metrics request each).
  const PAGE_SIZE = 50;
  const CURVE_SERIES = 10;
  const view = { offset: 0, q: "" };
  // The Tinker models' table pages the same way (GET /v1/tinker/models); it is shown when the service
  // serves the Tinker API. Its curve: the loss of each optimizer step of the page's first CURVE_SERIES models.
  const tinkerView = { offset: 0, q: "" };
  const TOKEN_KEY = "lorafleet.token";
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"];
  const PART_COLORS = { collect: "#5b8def", train: "#27865b", publish: "#e0a030", checkpoint: "#9467bd" };
  // The curves: one chart each, one series per adapter, x = the adapter's step.
  const CURVES = [
    { key: "reward", title: "reward (mean)", value: (s) => s.reward_mean },
    { key: "loss", title: "loss", value: (s) => s.loss },
    { key: "grad_norm", title: "gradient norm (before clipping)", value: (s) => s.metrics.grad_norm },
    { key: "learning_rate", title: "learning rate", value: (s) => s.learning_rate },
    { key: "kl", title: "KL to the base (k3)", value: (s) => s.metrics.kl_mean },
    // Trained tokens per second of wall clock between the adapter's consecutive steps.
    { key: "tokens_per_s", title: "tokens / s", value: (s, prev) =>
        prev && s.metrics.tokens != null && s.recorded_at > prev.recorded_at ? s.metrics.tokens / (s.recorded_at - prev.recorded_at) : null },
    { key: "staleness", title: "staleness (versions behind)", value: (s) => s.staleness_mean },
  ];

  class Unauthorized extends Error {}

  const $ = (sel) => document.querySelector(sel);
  const charts = {}; // key -> {plot, names}
  const colorOf = {}; // adapter name -> color, stable while the page lives
  let polls = 0;
  let timer = null;

  function takeTokenFromFragment() {
    // #token=...&q=...&offset=... (scripted use): the token is kept in this tab, the view is taken once.
    const m = location.hash.match(/(?:^#|&)token=([^&]*)/);
    const q = location.hash.match(/(?:^#|&)q=([^&]*)/);
    const offset = location.hash.match(/(?:^#|&)offset=(\d+)/);
    if (q) { view.q = decodeURIComponent(q[1]); $("#search").value = view.q; }
    if (offset) view.offset = Number(offset[1]);
    if (m) {
      sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search); // keep it out of the address bar
    }
  }

  async function api(path) {
    const token = sessionStorage.getItem(TOKEN_KEY);
    const response = await fetch(path, { headers: token ? { Authorization: "Bearer " + token } : {}, cache: "no-store" });
    if (response.status === 401) throw new Unauthorized("the API token was refused");
    if (!response.ok) {
      let detail = response.statusText;
      try { detail = (await response.json()).detail || detail; } catch (e) { /* not JSON */ }
      throw new Error(`${path}: ${response.status} ${detail}`);
    }
    return response.json();
  }

  const fmt = (x, digits = 3) => (x == null || !isFinite(x) ? "-" : Math.abs(x) > 0 && Math.abs(x) < 1e-3 ? x.toExponential(2) : x.toFixed(digits));

  // Axis ticks: fewer decimals as numbers grow, so labels fit the axis.
  const tick = (v) => (v == null ? "" : Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 10 ? v.toFixed(1) : fmt(v, 3));

  function color(name) {
    if (!(name in colorOf)) colorOf[name] = COLORS[Object.keys(colorOf).length % COLORS.length];
    return colorOf[name];
  }

  function cell(field, text, html) {
    const td = document.createElement("td");
    td.dataset.field = field;
    if (html) td.innerHTML = html; else td.textContent = text;
    return td;
  }

  function renderTable(adapters) {
    const body = $("#adapters tbody");
    body.replaceChildren(...adapters.map((a) => {
      const tr = document.createElement("tr");
      tr.dataset.adapter = a.name;
      tr.dataset.state = a.state;
      tr.dataset.step = a.step;
      const m = a.last_metrics || {};
      const name = document.createElement("span");
      name.textContent = a.name;
      const first = cell("name", "", `<span class="swatch" style="background:${color(a.name)}"></span>`);
      first.appendChild(name);
      const where = a.slot != null ? `slot ${a.slot}` : a.queue_position != null ? `queue #${a.queue_position}` : "-";
      tr.append(
        first,
        cell("state", a.state),
        cell("step", a.total_steps != null ? `${a.step} / ${a.total_steps}` : String(a.step)),
        cell("samples", String(a.samples_trained)),
        cell("reward", fmt(a.last_reward)),
        cell("loss", fmt(a.last_loss, 4)),
        cell("staleness", fmt(m.staleness_mean, 2)),
        cell("learning_rate", fmt(m.learning_rate, 5)),
        cell("slot", where),
      );
      if (a.failure_reason) tr.title = a.failure_reason;
      return tr;
    }));
  }

  function chartWidth(el) { return Math.max(380, Math.floor(el.clientWidth || 430)); }

  // One uPlot per key; rebuilt when the set of series changes, else given new data.
  function draw(key, title, names, data, seriesColors, container) {
    let el = container.querySelector(`[data-chart="${key}"]`);
    if (!el) {
      el = document.createElement("div");
      el.className = "chart";
      el.dataset.chart = key;
      container.appendChild(el);
    }
    const points = data.slice(1).reduce((n, ys) => n + ys.filter((y) => y != null).length, 0);
    el.dataset.series = names.join(",");
    el.dataset.points = points;
    const old = charts[key];
    if (old && old.names.join(",") === names.join(",")) {
      old.plot.setData(data);
      old.note.hidden = points > 0;
      return;
    }
    if (old) old.plot.destroy();
    el.replaceChildren();
    const note = document.createElement("div");
    note.className = "empty";
    note.textContent = key === "round_time" ? "no training round recorded yet"
      : key === "tinker_loss" ? "no model has taken an optimizer step yet" : "no step has reported this metric yet";
    note.hidden = points > 0;
    const opts = {
      title, width: chartWidth(el), height: 220,
      scales: { x: { time: false } },
      series: [{ label: key === "round_time" ? "round" : key === "tinker_loss" ? "model step" : "step" },
        ...names.map((n, i) => ({ label: n, stroke: seriesColors[i], width: 2, spanGaps: true, points: { size: 4 } }))],
      axes: [{}, { size: 70, values: (u, vals) => vals.map(tick) }],
      legend: { live: true },
    };
    charts[key] = { plot: new uPlot(opts, data, el), names: names.slice(), note };
    el.appendChild(note);
  }

  function renderCurves(series) {
    const names = Object.keys(series).sort();
    const container = $("#charts");
    const steps = [...new Set(names.flatMap((n) => series[n].map((s) => s.step)))].sort((a, b) => a - b);
    for (const curve of CURVES) {
      const ys = names.map((n) => {
        const byStep = new Map();
        series[n].forEach((s, i) => byStep.set(s.step, curve.value(s, series[n][i - 1])));
        return steps.map((x) => { const y = byStep.get(x); return y == null || !isFinite(y) ? null : y; });
      });
      draw(curve.key, curve.title, names, [steps, ...ys], names.map(color), container);
    }
  }

  // A Tinker model's state: where it is (resident in its slot, waiting with its place, or evicted and where).
  function tinkerWhere(m) {
    if (m.slot != null) return `slot ${m.slot}`;
    if (m.queue_position != null) return `${m.residency} #${m.queue_position}`;
    return m.residency === "evicted" ? `evicted (${m.where})` : m.residency;
  }

  function renderTinker(list) {
    $("#tinker").hidden = !list.tinker_api;
    if (!list.tinker_api) return;
    renderPagerOf("tinker", tinkerView, list.total, list.models.length);
    $("#tinker-models tbody").replaceChildren(...list.models.map((m) => {
      const tr = document.createElement("tr");
      tr.dataset.model = m.model_id;
      tr.dataset.owner = m.owner;
      tr.dataset.state = m.residency;
      tr.dataset.step = m.step;
      tr.dataset.slot = m.slot == null ? "" : m.slot;
      tr.dataset.queue = m.queue_position == null ? "" : m.queue_position;
      const name = document.createElement("span");
      name.textContent = m.model_id;
      const first = cell("name", "", `<span class="swatch" style="background:${color("tinker:" + m.model_id)}"></span>`);
      first.appendChild(name);
      tr.append(first, cell("owner", m.owner), cell("state", tinkerWhere(m)), cell("step", String(m.step)),
        cell("tokens", String(m.tokens_trained)), cell("loss", fmt(m.last_loss, 4)), cell("samples", String(m.sample_calls)),
        cell("rank", String(m.rank)));
      if (m.waiting_reason) tr.title = m.waiting_reason;
      return tr;
    }));
    const curved = list.models.slice(0, CURVE_SERIES);
    const steps = [...new Set(curved.flatMap((m) => m.loss_curve.map((p) => p.step)))].sort((a, b) => a - b);
    const ys = curved.map((m) => {
      const byStep = new Map(m.loss_curve.map((p) => [p.step, p.loss]));
      return steps.map((x) => (byStep.has(x) ? byStep.get(x) : null));
    });
    draw("tinker_loss", "Tinker loss per optimizer step (sum of loss:sum)", curved.map((m) => m.model_id), [steps, ...ys],
      curved.map((m) => color("tinker:" + m.model_id)), $("#tinker .charts"));
  }

  function renderFleet(stats) {
    for (const el of document.querySelectorAll("[data-kpi]")) {
      const v = stats[el.dataset.kpi];
      el.textContent = Number.isInteger(v) ? String(v) : fmt(v, 1);
    }
    const split = $("#split");
    split.replaceChildren(...Object.entries(stats.fractions).filter(([, f]) => f > 0).map(([part, f]) => {
      const d = document.createElement("div");
      d.dataset.part = part;
      d.dataset.fraction = f.toFixed(4);
      d.style.width = `${(100 * f).toFixed(2)}%`;
      d.style.background = PART_COLORS[part] || "#888";
      d.textContent = `${part} ${(100 * f).toFixed(0)}%`;
      d.title = `${part}: ${stats.seconds[part].toFixed(1)} s`;
      return d;
    }));
    const first = stats.rounds - stats.recent.length + 1;
    const parts = Object.keys(PART_COLORS);
    const data = [stats.recent.map((_, i) => first + i), ...parts.map((p) => stats.recent.map((r) => r[`${p}_s`]))];
    draw("round_time", "round time by part (s)", parts, data, parts.map((p) => PART_COLORS[p]), $("#fleet .charts"));
  }

  function setStatus(text, state) {
    const el = $("#status");
    el.textContent = text;
    el.dataset.state = state;
    el.dataset.polls = polls;
  }

  async function poll() {
    try {
      const query = new URLSearchParams({ limit: PAGE_SIZE, offset: view.offset });
      if (view.q) query.set("q", view.q);
      const tinkerQuery = new URLSearchParams({ limit: PAGE_SIZE, offset: tinkerView.offset });
      if (tinkerView.q) tinkerQuery.set("q", tinkerView.q);
      const [list, stats, models] = await Promise.all([api(`v1/adapters?${query}`), api("v1/fleet/stats"),
        api(`v1/tinker/models?${tinkerQuery}`)]);
      if (!models.models.length && tinkerView.offset > 0 && models.total > 0) {  // the page emptied (models unloaded): go back
        tinkerView.offset = Math.max(0, Math.floor((models.total - 1) / PAGE_SIZE) * PAGE_SIZE);
        return poll();
      }
      const adapters = list.adapters;
      if (!adapters.length && view.offset > 0 && list.total > 0) {  // the page emptied (runs ended): go back
        view.offset = Math.max(0, Math.floor((list.total - 1) / PAGE_SIZE) * PAGE_SIZE);
        return poll();
      }
      renderPagerOf("", view, list.total, adapters.length);
      const curved = adapters.slice(0, CURVE_SERIES);
      const metrics = await Promise.all(curved.map((a) => api(`v1/adapters/${encodeURIComponent(a.name)}/metrics`)));
      const series = Object.fromEntries(metrics.map((m) => [m.name, m.steps]));
      $("#login").hidden = true;
      $("#main").hidden = false;
      renderTable(adapters);
      renderCurves(series);
      renderFleet(stats);
      renderTinker(models);
      polls += 1;
      const tinkerNote = models.tinker_api ? ` · ${models.total} Tinker model(s)` : "";
      setStatus(`${list.total} adapter(s)${tinkerNote} · updated ${new Date().toLocaleTimeString()}`, "ok");
    } catch (e) {
      if (e instanceof Unauthorized) {
        stop();
        const hadToken = sessionStorage.getItem(TOKEN_KEY) !== null;
        sessionStorage.removeItem(TOKEN_KEY);
        $("#main").hidden = true;
        $("#login").hidden = false;
        $("#login-error").textContent = hadToken ? e.message : "";
        setStatus("API token needed", "login");
        return;
      }
      setStatus(`error: ${e.message} (retrying)`, "error");
    }
  }

  // The pager of a table: ids `${prefix}page`, `${prefix}prev`, `${prefix}next` ("" for the adapters, "tinker-" for the models).
  function renderPagerOf(prefix, v, total, shown) {
    const p = prefix ? `${prefix}-` : "";
    const el = $(`#${p}page`);
    el.dataset.offset = v.offset;
    el.dataset.total = total;
    el.textContent = total ? `${v.offset + 1}-${v.offset + shown} of ${total}` : "none";
    $(`#${p}prev`).disabled = v.offset === 0;
    $(`#${p}next`).disabled = v.offset + shown >= total;
  }

  // A table's pager and search box (ids as renderPagerOf's): they move its view and poll at once.
  function wirePager(prefix, v, search) {
    const p = prefix ? `${prefix}-` : "";
    const goTo = (offset) => { v.offset = Math.max(0, offset); poll(); };
    $(`#${p}prev`).addEventListener("click", () => goTo(v.offset - PAGE_SIZE));
    $(`#${p}next`).addEventListener("click", () => goTo(v.offset + PAGE_SIZE));
    let searchTimer = null;
    $(search).addEventListener("input", (ev) => {
      clearTimeout(searchTimer);
      searchTimer = setTimeout(() => { v.q = ev.target.value.trim(); goTo(0); }, 250);
    });
  }
  wirePager("", view, "#search");
  wirePager("tinker", tinkerView, "#tinker-search");

  function start() { stop(); poll(); timer = setInterval(poll, POLL_MS); }
  function stop() { if (timer !== null) clearInterval(timer); timer = null; }

  $("#login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("#token").value);
    $("#token").value = "";
    start();
  });
  $("#forget").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); location.reload(); });

  takeTokenFromFragment();
  start();
})();
