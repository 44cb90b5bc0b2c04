// A search's page, live: each probe settled is appended to the probes table as its event arrives,
// the state and progress follow `state` and `end`, and the parts the server draws (header,
// leaderboard, plot, pick) are read again from the page itself, so their rules stay in one place (Python).
// The page reads the same without this script, only not live. Copy buttons copy the snippets.
"use strict";

(function () {
  const body = document.body;
  document.documentElement.classList.add("js");

  // -- copy buttons --------------------------------------------------------------------------
  document.addEventListener("click", function (event) {
    const button = event.target.closest("button[data-copy]");
    if (!button) return;
    const source = document.getElementById(button.dataset.copy);
    if (!source) return;
    const said = function (word) {
      button.textContent = word;
      setTimeout(function () { button.textContent = "Copy"; }, 1500);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(source.textContent).then(function () { said("Copied"); },
                                                             function () { said("Select and copy"); });
      return;
    }
    const range = document.createRange();  // no Clipboard API (plain http beyond localhost)
    range.selectNodeContents(source);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    said(document.execCommand && document.execCommand("copy") ? "Copied" : "Press Ctrl+C");
  });

  // -- live updates ----------------------------------------------------------------------------
  const url = body.dataset.events;
  if (!url || body.dataset.ended === "true" || !window.EventSource) return;

  const rows = document.getElementById("events");
  const status = document.getElementById("live-status");

  function say(text) {
    if (!status) return;
    status.textContent = text || "";
    status.hidden = !text;
  }

  function size(n) {  // autotune.units.format_size
    if (n === null || n === undefined) return "-";
    const units = [["GiB", 1073741824], ["MiB", 1048576], ["KiB", 1024]];
    for (const [unit, scale] of units) {
      if (Math.abs(n) >= scale) return (n / scale).toFixed(2) + " " + unit;
    }
    return Math.trunc(n) + " B";
  }

  function speed(v) {
    return v === null || v === undefined ? "-" : Math.round(v).toLocaleString("en-US");
  }

  function gist(error) {  // the last line, cut (report.error_gist says it better server-side)
    const lines = String(error || "").trim().split("\n");
    const last = lines[lines.length - 1];
    return last.length <= 80 ? last : last.slice(0, 79) + "\u2026";
  }

  function cell(row, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.appendChild(td);
  }

  // The row templates/_probes.html draws, from the same fields of the probe's event. The need is the
  // event's own (need_bytes: peak reserved + context, by autotune.budget's one rule, on the server):
  // shown here, never worked out from the peaks.
  function addProbe(data) {
    if (!rows || rows.querySelector('tr[data-id="' + Number(data.id) + '"]')) return false;
    const row = document.createElement("tr");
    row.dataset.id = String(Number(data.id));
    row.className = "status-" + String(data.status) + " arrived";
    row.title = data.line || "";
    cell(row, data.settled + "/" + data.total, "num");
    cell(row, data.label, "label");
    cell(row, data.status);
    cell(row, speed(data.tokens_per_s), "num");
    cell(row, size(data.need_bytes), "num");
    cell(row, data.best ? "best so far" : data.error ? gist(data.error) : "");
    rows.appendChild(row);
    const progress = document.getElementById("progress");
    if (progress) progress.textContent = data.total ? data.settled + " / " + data.total : data.settled + " settled";
    const bar = document.getElementById("progress-bar");
    if (bar) bar.value = data.settled;
    return true;
  }

  function showState(state) {
    const el = document.getElementById("state");
    if (el) {
      el.textContent = state.state;
      el.className = "state state-" + state.state;
    }
    const reason = document.getElementById("reason");
    if (reason) reason.textContent = state.waiting || state.reason || "";
    // The progress in the server's words (views.progress_text): the confirmation round says itself.
    const progress = document.getElementById("progress");
    if (progress && state.progress) progress.textContent = state.progress;
  }

  // The server's parts of the page, read again (at most one read in flight, one queued).
  let reading = null, again = false;
  function refresh() {
    if (reading) { again = true; return; }
    reading = fetch(window.location.pathname, {cache: "no-store", credentials: "same-origin"})
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (text) {
        if (!text) return;
        const fresh = new DOMParser().parseFromString(text, "text/html");
        for (const id of ["summary", "results", "pick"]) {
          const now = document.getElementById(id), next = fresh.getElementById(id);
          if (now && next) now.replaceWith(document.importNode(next, true));
        }
      })
      .catch(function () { /* the next event reads again */ })
      .finally(function () {
        reading = null;
        if (again) { again = false; refresh(); }
      });
  }
  let pending = null;
  function soon() {
    if (pending) return;
    pending = setTimeout(function () { pending = null; refresh(); }, 400);
  }

  const source = new EventSource(url);
  source.addEventListener("probe", function (event) {
    const data = JSON.parse(event.data);
    say("");
    if (addProbe(data) && data.status === "ok") soon();
  });
  source.addEventListener("state", function (event) {
    showState(JSON.parse(event.data));
    say("");
    soon();
  });
  source.addEventListener("end", function (event) {
    source.close();
    showState(JSON.parse(event.data));
    body.dataset.ended = "true";
    window.autotuneEnded = true;
    refresh();
  });
  source.addEventListener("error", function (event) {
    if (event.data) {  // the service's own `error` event: one line
      try { say(JSON.parse(event.data).error + " (retrying)"); } catch (e) { say("the event stream failed (retrying)"); }
    } else if (source.readyState === EventSource.CLOSED) {
      say("live updates stopped; reload the page to follow the search again.");
    }
  });
})();
