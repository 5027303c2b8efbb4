// The overview's chart (uPlot) and its refresh from /api/overview. The figures
// arrive as JSON data; nothing from the table is ever inserted as markup.
(function () {
  "use strict";
  var holder = document.getElementById("overview-data");
  var chartBox = document.getElementById("flow-chart");
  if (!holder || !chartBox || typeof uPlot === "undefined") { return; }
  var data = JSON.parse(holder.textContent);
  var refresh = parseFloat(holder.getAttribute("data-refresh")) || 5;
  var base = document.body.getAttribute("data-base") || "";

  function age(seconds) {
    if (seconds === null || seconds === undefined) { return "-"; }
    var s = Math.floor(seconds);
    if (s < 60) { return s + "s"; }
    if (s < 3600) { return Math.floor(s / 60) + "m " + (s % 60) + "s"; }
    if (s < 86400) { return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m"; }
    return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
  }

  // The chart's buckets, by start; a refresh brings only the newest ones.
  var flow = { starts: data.flow.starts.slice(), created: data.flow.created.slice(),
               sent: data.flow.sent.slice() };

  function merge(part) {
    for (var i = 0; i < part.starts.length; i++) {
      var at = flow.starts.indexOf(part.starts[i]);
      if (at >= 0) {
        flow.created[at] = part.created[i];
        flow.sent[at] = part.sent[i];
      } else if (!flow.starts.length || part.starts[i] > flow.starts[flow.starts.length - 1]) {
        flow.starts.push(part.starts[i]);
        flow.created.push(part.created[i]);
        flow.sent.push(part.sent[i]);
      }
    }
    var newest = flow.starts[flow.starts.length - 1];
    while (flow.starts.length && flow.starts[0] < newest - data.flow.seconds) {
      flow.starts.shift(); flow.created.shift(); flow.sent.shift();
    }
  }

  function series() { return [flow.starts, flow.created, flow.sent]; }

  var opts = {
    width: Math.max(320, chartBox.clientWidth - 16),
    height: 300,
    scales: { x: { time: true } },
    axes: [{}, { label: "events per " + Math.round(data.flow.bucket_seconds / 60) + " min" }],
    series: [
      {},
      { label: "created (inflow)", stroke: "#2563eb", width: 2, fill: "rgba(37,99,235,0.08)" },
      { label: "sent (outflow)", stroke: "#16a34a", width: 2 }
    ]
  };
  var chart = new uPlot(opts, series(), chartBox);

  window.addEventListener("resize", function () {
    chart.setSize({ width: Math.max(320, chartBox.clientWidth - 16), height: 300 });
  });

  function show(d) {
    var fields = document.querySelectorAll("[data-field]");
    for (var i = 0; i < fields.length; i++) {
      var el = fields[i];
      var value = d[el.getAttribute("data-field")];
      if (el.hasAttribute("data-age")) { el.textContent = age(value); }
      else { el.textContent = String(Math.round(value || 0)); }
    }
    if (d.flow.partial) { merge(d.flow); } else { flow = d.flow; }
    chart.setData(series());
  }

  function poll() {
    var since = flow.starts.length ? flow.starts[flow.starts.length - 1] : null;
    var url = base + "/api/overview?range=" + encodeURIComponent(data.flow.range) +
      (since === null ? "" : "&since=" + encodeURIComponent(String(since)));
    fetch(url, { headers: { "Accept": "application/json" }, credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (d) { if (d) { show(d); } })
      .catch(function () { /* the next refresh tries again */ })
      .then(function () { window.setTimeout(poll, refresh * 1000); });
  }
  window.setTimeout(poll, refresh * 1000);
})();

// The outbox switcher (many outboxes): choosing one goes there, no button needed.
(function () {
  "use strict";
  var choice = document.getElementById("outbox-switch");
  var form = document.getElementById("switcher");
  if (!choice || !form || choice.tagName !== "SELECT") { return; }
  choice.addEventListener("change", function () { form.submit(); });
})();
