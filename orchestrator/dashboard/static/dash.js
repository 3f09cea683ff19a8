// dtrun dashboard: sort/filter the runs table, poll the JSON endpoint, redraw numbers and charts.
(function () {
  var D = window.DASH, q = D.token ? "?token=" + encodeURIComponent(D.token) : "";  // dtrun server: a cookie
  function fmt(k, v) {  // mirrors pages.fmt
    if (v === null || v === undefined || v === "") return "\u2014";
    if (k === "spot") return v ? "spot" : "on-demand";
    if (["spent_usd", "budget_usd", "estimate_usd", "quote_usd_per_hour", "booked_usd_per_hour",
         "monthly_usd", "committed_usd", "left_usd"].indexOf(k) >= 0)
      return "$" + Number(v).toFixed(2);
    if (k === "tokens_per_s") return Math.round(Number(v)).toLocaleString("en-US");
    if (k === "loss" || k === "val_loss") return Number(v).toFixed(4);
    if (typeof v === "number" && !Number.isInteger(v)) return String(Number(v.toPrecision(4)));
    return String(v);
  }
  function fill(root, d) {
    root.querySelectorAll("[data-k]").forEach(function (el) {
      var k = el.getAttribute("data-k"); if (k in d) el.textContent = fmt(k, d[k]);
      if (k === "state") el.className = "st " + d.state;
    });
  }
  function get(path, cb) {
    fetch(D.base + path + q).then(function (r) { return r.ok ? r.json() : null; }).then(function (j) {
      if (j) { cb(j); var u = document.getElementById("updated"); if (u) u.textContent = "updated " + new Date().toLocaleTimeString(); }
    }).catch(function () {});
  }
  if (D.page === "team") {
    setInterval(function () {
      get("api/team", function (t) {
        fill(document.getElementById("summary"), t); fill(document.getElementById("month-bar"), t);
        var bar = document.querySelector("#month-bar .bar i"), f = t.budget_frac;
        if (bar) { bar.style.width = (f === null ? 0 : Math.round(f * 100)) + "%"; bar.className = f !== null && f >= 0.9 ? "hot" : ""; }
        t.members.forEach(function (m) { var tr = document.querySelector('#members tr[data-member="' + CSS.escape(m.member) + '"]'); if (tr) fill(tr, m); });
        t.runs.forEach(function (r) { var tr = document.querySelector('#teamruns tr[data-run="' + CSS.escape(r.name) + '"]'); if (tr) fill(tr, r); });
      });
    }, D.poll_ms);
    return;
  }
  if (D.page === "runs") {
    var tb = document.querySelector("#runs tbody"), filt = document.getElementById("filter"), dir = {};
    function applyFilter() {
      var t = filt.value.toLowerCase(), n = 0;
      tb.querySelectorAll("tr").forEach(function (tr) {
        var show = !t || tr.textContent.toLowerCase().indexOf(t) >= 0; tr.style.display = show ? "" : "none"; if (show) n++;
      });
      document.getElementById("count").textContent = n;
    }
    filt.addEventListener("input", applyFilter);
    var last = {};
    document.querySelectorAll("#runs th").forEach(function (th) {
      th.addEventListener("click", function () {
        var k = th.getAttribute("data-sort"); dir[k] = -(dir[k] || -1);
        var rows = Array.prototype.slice.call(tb.querySelectorAll("tr"));
        rows.sort(function (a, b) {
          var x = last[a.getAttribute("data-run")] || {}, y = last[b.getAttribute("data-run")] || {};
          x = x[k]; y = y[k]; if (x === y) return 0; if (x === null || x === undefined) return 1;
          if (y === null || y === undefined) return -1; return (x < y ? -1 : 1) * dir[k];
        });
        rows.forEach(function (r) { tb.appendChild(r); });
      });
    });
    function poll() {
      get("api/runs", function (j) {
        j.runs.forEach(function (r) {
          last[r.name] = r;
          var tr = tb.querySelector('tr[data-run="' + CSS.escape(r.name) + '"]'); if (!tr) return;
          tr.setAttribute("data-state", r.state); fill(tr, r);
          var bar = tr.querySelector(".bar i");
          if (bar) { var f = r.budget_frac; bar.style.width = (f === null ? 0 : Math.round(f * 100)) + "%"; bar.className = f !== null && f >= 0.9 ? "hot" : ""; }
        });
      });
    }
    get("api/runs", function (j) { j.runs.forEach(function (r) { last[r.name] = r; }); });
    setInterval(poll, D.poll_ms);
    return;
  }
  // one run
  var plots = {};
  function plot(id, label, xs, series, extra) {
    var el = document.getElementById(id), data = [xs].concat(series.map(function (s) { return s.ys; }));
    if (plots[id]) { plots[id].setData(data); return; }
    var opts = { width: 420, height: 220, scales: { x: { time: false } },
      series: [{ label: label }].concat(series.map(function (s) { return { label: s.label, stroke: s.color, width: 1.5, spanGaps: true, dash: s.dash }; })) };
    plots[id] = new uPlot(opts, data, el);
  }
  function charts(d) {
    var steps = [], loss = [], tps = [], val = {};
    d.val.forEach(function (v) { val[v.step] = v.val_loss; });
    var all = d.train.map(function (r) { return r.step; }).concat(d.val.map(function (v) { return v.step; }));
    all = all.filter(function (s, i) { return all.indexOf(s) === i; }).sort(function (a, b) { return a - b; });
    var byStep = {}; d.train.forEach(function (r) { byStep[r.step] = r; });
    all.forEach(function (s) { steps.push(s); var r = byStep[s]; loss.push(r ? r.loss : null); tps.push(r ? r.tokens_per_s : null); });
    plot("loss", "step", steps, [{ label: "train", ys: loss, color: "#36c" }, { label: "validation", ys: all.map(function (s) { return s in val ? val[s] : null; }), color: "#d80" }]);
    plot("tps", "step", steps, [{ label: "tokens/s", ys: tps, color: "#2a7" }]);
    var h = d.spend_curve.hours, b = d.budget_usd;
    plot("spend", "hours", h, [{ label: "spent $", ys: d.spend_curve.usd, color: "#c33" }, { label: "budget $", ys: h.map(function () { return b; }), color: "#999", dash: [6, 4] }]);
  }
  function rows(sel, html) { document.querySelector(sel).innerHTML = html; }
  function esc(s) { return String(s === null || s === undefined ? "" : s).replace(/[&<>"]/g, function (c) { return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]; }); }
  function render(d) {
    fill(document.getElementById("facts"), d); fill(document.getElementById("money"), d); charts(d);
    rows("#timeline tbody", d.timeline.map(function (a) {
      return '<tr class="' + esc(a.outcome) + '" data-attempt="' + a.n + '"><td>' + a.n + "</td><td>" + esc(a.provider) + " " + esc(a.offer) + (a.spot ? " (spot)" : "") +
        "</td><td>" + esc(a.state) + "</td><td>" + esc(a.outcome || "\u2014") + "</td><td>" + esc(a.reason) + "</td><td>" + fmt("s", a.start_step) +
        " \u2192 " + fmt("s", a.end_step) + '</td><td data-k="steps_lost">' + fmt("s", a.steps_lost) + "</td></tr>";
    }).join(""));
    rows("#nodes tbody", d.nodes.map(function (n) {
      return "<tr><td>" + n.attempt + "</td><td>" + esc(n.provider) + "</td><td>" + esc(n.name) + "</td><td>" + esc(n.instance_id) +
        "</td><td>" + esc(n.region) + "</td><td>" + esc(n.state) + "</td><td>" + (n.terminated_at ? "terminated" : "live") + "</td></tr>";
    }).join(""));
    var log = document.getElementById("log"), atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    if (log.textContent !== d.log_tail) { log.textContent = d.log_tail; if (atEnd) log.scrollTop = log.scrollHeight; }
    var btn = document.getElementById("stop"); if (btn && !d.stoppable) btn.remove();
  }
  charts(D.data);
  var api = "api/runs/" + encodeURIComponent(D.run);
  var btn = document.getElementById("stop");
  if (btn) btn.addEventListener("click", function () {
    if (!window.confirm("Stop " + D.run + "? (final checkpoint, then terminate: what `dtrun down` does)")) return;
    fetch(D.base + api + "/stop" + q, { method: "POST" }).then(function (r) { return r.json(); }).then(function (j) {
      document.getElementById("stopmsg").textContent = j.message || j.detail || "";
    });
  });
  setInterval(function () { get(api, render); }, D.poll_ms);
})();
