// The run page's curves: fetched from /api/runs/ID/curves (min/max-downsampled on the server),
// drawn with uPlot, zoomed by asking the server for the finer steps of the range, and followed
// live over server-sent events while the run trains. window.ember holds what was drawn.
"use strict";
(function () {
  const box = document.getElementById("charts");
  if (!box || typeof uPlot === "undefined") return;
  const run = box.dataset.run, other = box.dataset.compare, live = box.dataset.live === "true";
  const note = document.getElementById("chart-note");
  const state = window.ember = { charts: {}, drawn: null, curves: null, compare: null, offset: 0, zoom: null };

  function buckets() { return Math.max(100, Math.min(4000, Math.round(box.clientWidth || 1000))); }

  async function fetchCurves(id, fields, range) {
    let url = `/api/runs/${encodeURIComponent(id)}/curves?fields=${fields}&buckets=${buckets()}`;
    if (range) url += `&start=${Math.floor(range[0])}&end=${Math.ceil(range[1])}`;
    const r = await fetch(url, { credentials: "same-origin" });
    if (!r.ok) throw new Error(((await r.json()).error || {}).message || r.statusText);
    return r.json();
  }

  // One x array (steps) for all series: uPlot draws aligned columns, null where a series has no point.
  function align(columns) {
    const xs = Array.from(new Set(columns.flatMap(c => c.steps))).sort((a, b) => a - b);
    const at = new Map(xs.map((x, i) => [x, i]));
    const out = [xs];
    for (const c of columns) {
      const ys = new Array(xs.length).fill(null);
      c.steps.forEach((x, i) => { ys[at.get(x)] = c.values[i]; });
      out.push(ys);
    }
    return out;
  }

  function curve(curves, field) { return curves.curves.find(c => c.field === field) || { steps: [], values: [] }; }

  function lossColumns() {
    const cols = [curve(state.curves, "loss"), curve(state.curves, "eval_loss")];
    if (state.compare) cols.push(curve(state.compare, "loss"));
    return cols;
  }

  // Tick labels with as few significant digits as tell every tick apart: uPlot's own labels
  // round a learning rate of 1e-4 to "0" on every tick.
  function label(v, digits) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    return a < 1e-3 || a >= 1e6 ? v.toExponential(digits - 1) : String(Number(v.toPrecision(digits)));
  }

  function ticks(u, splits) {
    let labels = [];
    for (let digits = 1; digits <= 8; digits++) {
      labels = splits.map(v => label(v, digits));
      if (new Set(labels).size === labels.length) break;
    }
    return labels;
  }

  function options(title, series, height) {
    return {
      title, width: box.clientWidth || 1000, height,
      cursor: { drag: { x: true, y: false, setScale: false } },
      scales: { x: { time: false } },
      axes: [{ label: "step" }, { values: ticks, size: 64 }],
      series: [{ label: "step" }, ...series],
      hooks: { setSelect: [u => { if (u.select.width > 4) zoom([u.posToVal(u.select.left, "x"), u.posToVal(u.select.left + u.select.width, "x")]); u.setSelect({ left: 0, width: 0, top: 0, height: 0 }, false); }] },
    };
  }

  function draw() {
    const lossSeries = [{ label: "loss", stroke: "#2563eb", width: 1.2 },
                        { label: "held-out loss", stroke: "#16a34a", width: 2, spanGaps: true, points: { show: true, size: 6 } }];
    if (state.compare) lossSeries.push({ label: `loss of ${other}`, stroke: "#c2410c", width: 1.2, spanGaps: true });
    const lossData = align(lossColumns());
    const lrData = align([curve(state.curves, "lr")]);
    if (!state.charts.loss) {
      state.charts.loss = new uPlot(options("loss", lossSeries, 300), lossData, document.getElementById("loss-chart"));
      state.charts.lr = new uPlot(options("learning rate", [{ label: "lr", stroke: "#7c3aed", width: 1.2 }], 180),
                                  lrData, document.getElementById("lr-chart"));
      for (const u of Object.values(state.charts)) u.over.addEventListener("dblclick", () => zoom(null));
    } else {
      state.charts.loss.setData(lossData);
      state.charts.lr.setData(lrData);
    }
    const c = state.curves;
    note.textContent = c.points ? `${c.points.toLocaleString()} steps ${state.zoom ? `in ${c.first_step}–${c.last_step}` : ""} drawn as ${lossData[0].length.toLocaleString()} points` +
      (c.lost_steps.length ? `; ${c.lost_steps.length} steps were computed again after a resume` : "") : "no steps yet";
    state.drawn = performance.now();
    box.dataset.drawn = String(++drawCount);
    performance.mark("ember-chart-drawn");
  }
  let drawCount = 0;

  async function zoom(range) {
    state.zoom = range;
    const [mine, theirs] = await Promise.all([fetchCurves(run, "loss,lr,eval_loss", range),
                                              other ? fetchCurves(other, "loss", range) : null]);
    state.curves = mine;
    state.compare = theirs;
    draw();
  }

  function follow() {
    const source = new EventSource(`/api/runs/${encodeURIComponent(run)}/live?offset=${state.offset}`);
    source.addEventListener("steps", e => {
      const steps = JSON.parse(e.data);
      if (state.zoom) return;  // a zoomed view stays as asked; double-click shows everything again
      for (const s of steps) {
        for (const f of ["loss", "lr", "eval_loss"]) {
          if (s[f] === null || s[f] === undefined) continue;
          const c = curve(state.curves, f);
          c.steps.push(s.step); c.values.push(s[f]);
        }
        state.curves.points += 1;
        state.curves.last_step = s.step;
      }
      const step = document.getElementById("run-step");
      if (step && steps.length) step.textContent = steps[steps.length - 1].step;
      draw();
    });
    source.addEventListener("end", () => {
      source.close();
      const badge = document.getElementById("live");
      if (badge) badge.textContent = "finished: reload for the final figures";
    });
  }

  zoom(null).then(() => {
    state.offset = state.curves.offset;
    if (live) follow();
  }).catch(e => { note.textContent = `could not load the curves: ${e.message}`; });
  window.addEventListener("resize", () => {
    for (const u of Object.values(state.charts)) u.setSize({ width: box.clientWidth, height: u.height });
  });
})();
