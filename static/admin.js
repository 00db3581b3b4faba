// flask-firm-channel admin console: small behaviours htmx does not cover. Loaded as a file
// (the Content-Security-Policy allows no inline script); it never builds markup from data,
// only text nodes.
(function () {
  "use strict";

  // A failed htmx request (a 403 after the session expired, a server error) says so where
  // its result would have gone, instead of silently doing nothing.
  document.addEventListener("htmx:responseError", function (event) {
    var target = event.detail.target;
    var xhr = event.detail.xhr;
    if (!target || !xhr) {
      return;
    }
    var note = document.createElement("p");
    note.className = "warning";
    note.setAttribute("role", "alert");
    note.textContent = "The request failed (" + xhr.status + "): " +
      (xhr.responseText || xhr.statusText || "no answer").slice(0, 300);
    target.replaceChildren(note);
  });
})();

// The live tail of a channel page: htmx's SSE extension swaps each message in; this keeps
// the list bounded, drops a message seen twice, shows the connection's state, and pauses and
// resumes without loss (a resumed stream starts after the last event id received).
(function () {
  "use strict";
  var MAX_ITEMS = 200;
  // The event a stream sends first when rows right after its cursor were trimmed (sse.py).
  var TRIMMED_EVENT = "firm-channel-history-trimmed";

  function setup() {
    var tail = document.getElementById("tail");
    if (!tail || typeof htmx === "undefined") {
      return;
    }
    var list = document.getElementById("tail-list");
    var status = document.getElementById("tail-status");
    var toggle = document.getElementById("tail-toggle");
    var empty = document.getElementById("tail-empty");
    // The connector as the page rendered it: a resumed stream is a copy with a new URL, so
    // it listens for exactly the events the template names.
    var pristine = document.getElementById("tail-connector").cloneNode(true);
    var received = 0;
    var lastEventId = null;
    var paused = false;

    function say(text) {
      status.textContent = text;
    }

    function connector() {
      return document.getElementById("tail-connector");
    }

    tail.addEventListener("htmx:sseOpen", function () {
      say(received ? "Live · " + received + " new" : "Live");
    });
    tail.addEventListener("htmx:sseError", function () {
      if (!paused) {
        say("Connection lost · reconnecting…");
      }
    });
    // Where the gap is: above the messages received before it, below those that follow.
    function noteTrimmed(data) {
      var oldest = null;
      try {
        oldest = JSON.parse(data).oldest_id;
      } catch (e) {
        // Not the notice sse.py sends: say it without the id.
      }
      var note = document.createElement("li");
      note.className = "tail-note warning";
      note.textContent = "Messages broadcast while this tail was paused or disconnected were " +
        "trimmed before it could show them" +
        (typeof oldest === "number" ? "; it goes on from message " + oldest + ", the oldest kept." : ".");
      list.insertBefore(note, list.firstChild);
      empty.hidden = true;
    }

    tail.addEventListener("htmx:sseMessage", function (event) {
      if (event.detail && event.detail.lastEventId) {
        lastEventId = event.detail.lastEventId;
      }
      if (event.detail && event.detail.type === TRIMMED_EVENT) {
        noteTrimmed(event.detail.data);
        return;
      }
      var items = list.querySelectorAll("li.message");
      if (items.length) {
        var newest = items[0];
        var twin = list.querySelectorAll(
          'li.message[data-message-id="' + newest.getAttribute("data-message-id") + '"]');
        if (twin.length > 1) {
          newest.remove();
          return;
        }
        newest.classList.add("fresh");
      }
      for (var i = MAX_ITEMS; i < items.length; i++) {
        items[i].remove();
      }
      received += 1;
      empty.hidden = true;
      say("Live · " + received + " new");
    });

    toggle.addEventListener("click", function () {
      if (!paused) {
        paused = true;
        var current = connector();
        if (current) {
          htmx.remove(current);
        }
        toggle.textContent = "Resume";
        toggle.setAttribute("aria-pressed", "true");
        say("Paused" + (received ? " · " + received + " received" : ""));
        return;
      }
      paused = false;
      var after = lastEventId || tail.getAttribute("data-after") || "0";
      var url = tail.getAttribute("data-stream") + "?lastEventId=" + encodeURIComponent(after);
      var source = pristine.cloneNode(true);
      source.setAttribute("sse-connect", url);
      empty.parentNode.insertBefore(source, empty);
      htmx.process(source);
      toggle.textContent = "Pause";
      toggle.setAttribute("aria-pressed", "false");
      say("Connecting…");
    });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", setup);
  } else {
    setup();
  }
})();
