// A run's charts: what each optimizer step reported (GET .../metrics, paged by step), one
// point per step, drawn with uPlot and extended every few seconds while the page is open.
"use strict";

(() => {
  const section = document.getElementById("charts");
  const url = section.dataset.metrics;
  const holder = section.querySelector(".charts");
  const POLL_MS = 5000;
  const PAGE = 1000;
  const STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]; // whole steps on the x axis

  const steps = []; // closed steps, oldest first, as the endpoint gives them
  const charts = new Map(); // series name -> {plot, box}

  // The series of a step: its forward_backward metrics, its optimizer's, tokens and time.
  function seriesOf(step) {
    const out = Object.create(null); // names are the tenant's own (custom losses): no prototype to clash with
    for (const [name, value] of Object.entries(step.metrics || {})) out[name] = value;
    for (const [name, value] of Object.entries(step.optim || {})) {
      if (name !== "optimizer_step") out[name] = value;
    }
    out["tokens"] = step.tokens;
    out["step time (s)"] = step.duration_s;
    return out;
  }

  function order(names) {
    // loss first, then the other training metrics, then the optimizer's, then tokens and time
    const rank = (n) => (n.startsWith("loss") ? 0 : n === "tokens" ? 3 : n === "step time (s)" ? 4 : n in { grad_norm: 1, learning_rate: 1 } ? 2 : 1);
    return names.sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
  }

  function draw() {
    document.getElementById("step-count").textContent = String(steps.length);
    document.getElementById("no-steps").hidden = steps.length > 0;
    if (!steps.length) return;
    const xs = steps.map((s) => s.step);
    const table = steps.map(seriesOf);
    const names = order([...new Set(table.flatMap((row) => Object.keys(row)))]);
    const width = Math.max(320, Math.min(560, holder.clientWidth / 2 - 24));
    for (const name of names) {
      const ys = table.map((row) => (Object.hasOwn(row, name) ? row[name] : null));
      let chart = charts.get(name);
      if (!chart) {
        const box = document.createElement("figure");
        box.className = "chart";
        box.dataset.series = name;
        holder.appendChild(box);
        const plot = new uPlot(
          {
            title: name,
            width,
            height: 220,
            scales: { x: { time: false } },
            axes: [{ label: "step", incrs: STEPS }, {}],
            series: [{ label: "step" }, { label: name, stroke: "#2563eb", width: 1.5, points: { show: xs.length < 60 } }],
          },
          [xs, ys],
          box,
        );
        chart = { plot, box };
        charts.set(name, chart);
      } else {
        chart.plot.setData([xs, ys]);
      }
      chart.box.dataset.points = String(ys.filter((y) => y !== null).length);
    }
  }

  async function fetchNew() {
    let after = steps.length ? steps[steps.length - 1].step : -1;
    for (;;) {
      const response = await fetch(`${url}?after=${after}&limit=${PAGE}`, { credentials: "same-origin" });
      if (response.status === 401) {
        window.location.assign(`/console/signin?next=${encodeURIComponent(location.pathname)}`);
        return;
      }
      if (!response.ok) throw new Error(`metrics: HTTP ${response.status}`);
      const page = await response.json();
      steps.push(...page.steps);
      if (page.next_after === null || page.next_after === undefined) return;
      after = page.next_after;
    }
  }

  async function refresh() {
    try {
      await fetchNew();
      draw();
      section.dataset.loaded = "true";
    } catch (error) {
      console.error(error);
    } finally {
      setTimeout(refresh, POLL_MS);
    }
  }

  refresh();
})();
