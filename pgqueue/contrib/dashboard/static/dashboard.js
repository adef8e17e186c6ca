// pgqueue dashboard: the token, the actions, the live fragments and the lease bars.
// Plain JavaScript, nothing vendored. Every time shown comes from the database's clock:
// a bar starts from the seconds left the server read, and only the time since then is
// measured here (performance.now(), a monotonic clock).
(() => {
  "use strict";
  const KEY = "pgqueue-dashboard-token";
  const POLL_MS = 3000; // fragments are fetched again this often, notification or not
  const readOnly = document.body.dataset.readOnly === "1";

  // The token: from the #token= fragment of the address printed at start (never sent to
  // a server), kept in this tab's sessionStorage, or typed in.
  const hash = location.hash.match(/[#&]token=([^&]+)/);
  if (hash) {
    sessionStorage.setItem(KEY, decodeURIComponent(hash[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  const token = () => sessionStorage.getItem(KEY);
  const state = document.getElementById("token-state");
  function showToken() {
    if (!state) return;
    if (token()) {
      state.textContent = "actions on";
      state.classList.add("ok");
      return;
    }
    state.innerHTML = "";
    const form = document.createElement("form");
    form.id = "token-form";
    const input = document.createElement("input");
    input.type = "password";
    input.placeholder = "token (printed at start)";
    input.setAttribute("aria-label", "dashboard token");
    const use = document.createElement("button");
    use.textContent = "use";
    form.append(input, use);
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      if (input.value.trim()) sessionStorage.setItem(KEY, input.value.trim());
      showToken();
    });
    state.append(form);
  }
  showToken();

  const said = document.getElementById("said");
  function say(text, bad) {
    said.textContent = text || "";
    said.classList.toggle("bad", !!bad);
  }

  // Actions: a POST with the token in a header (never a cookie), then a fresh look.
  document.addEventListener("click", async (event) => {
    const button = event.target.closest("button[data-action]");
    if (!button || readOnly) return;
    if (button.dataset.confirm && !window.confirm(button.dataset.confirm)) return;
    if (!token()) {
      say("actions need the dashboard's token: type it in at the top right", true);
      return;
    }
    button.disabled = true;
    try {
      const response = await fetch(button.dataset.action, {
        method: "POST",
        headers: { Authorization: "Bearer " + token(), Accept: "application/json" },
      });
      const body = await response.json().catch(() => ({}));
      say(response.ok ? body.message : body.error || response.statusText, !response.ok);
      if (response.status === 401) {
        sessionStorage.removeItem(KEY);
        showToken();
      }
    } catch (error) {
      say("the dashboard cannot be reached: " + error, true);
    } finally {
      button.disabled = false;
    }
    refresh();
  });

  // Live fragments: fetched every POLL_MS, and at once when the server hears a NOTIFY.
  const live = document.querySelector("#live[data-fragment]");
  let busy = false;
  async function refresh() {
    if (!live || busy) return;
    busy = true;
    try {
      const response = await fetch(live.dataset.fragment, { headers: { Accept: "text/html" } });
      if (response.ok) {
        live.innerHTML = await response.text();
        measure();
      }
    } catch (error) {
      // the next poll tries again
    } finally {
      busy = false;
    }
  }
  if (live) {
    setInterval(refresh, POLL_MS);
    if (window.EventSource) {
      const events = new EventSource("api/events");
      events.addEventListener("change", refresh);
    }
  }

  // Lease bars: full width is the most lease left seen for this claim (id:fence); the
  // bar shrinks as time passes since the fragment came, red once the lease ran out.
  const most = new Map();
  let received = performance.now();
  function measure() {
    received = performance.now();
    for (const bar of document.querySelectorAll(".lease[data-left]")) {
      const left = Number(bar.dataset.left);
      most.set(bar.dataset.claim, Math.max(most.get(bar.dataset.claim) || 0, left, 0.001));
    }
  }
  function draw() {
    const passed = (performance.now() - received) / 1000;
    for (const bar of document.querySelectorAll(".lease[data-left]")) {
      const left = Number(bar.dataset.left) - passed;
      const full = most.get(bar.dataset.claim) || 1;
      bar.querySelector(".fill").style.width = (Math.max(0, left) / full) * 100 + "%";
      bar.querySelector(".left").textContent =
        left >= 0 ? left.toFixed(1) + " s left" : "ran out " + (-left).toFixed(1) + " s ago";
      bar.classList.toggle("out", left < 0);
    }
    requestAnimationFrame(draw);
  }
  measure();
  requestAnimationFrame(draw);
})();
