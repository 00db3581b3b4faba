// The room page, live: one EventSource on the room's stream. The browser resumes it by
// itself after a dropped connection (sending Last-Event-ID); when the server refuses it
// (503 past the stream cap) we reconnect here, passing the last id as a query parameter.
(function () {
  "use strict";
  var chat = document.getElementById("chat");
  var list = document.getElementById("messages");
  var statusEl = document.getElementById("status");
  var streamWorker = document.getElementById("stream-worker");
  var seen = new Set(JSON.parse(chat.dataset.seen));
  var lastEventId = chat.dataset.cursor;
  var source = null;

  function setStatus(text, cls) {
    statusEl.textContent = text;
    statusEl.className = "status " + cls;
  }

  // A line of the room: a chat message, or anything else broadcast on the room's channel
  // (author null), shown as plain text. Each is keyed by its broadcast's id.
  function add(m) {
    if (seen.has(m.event_id)) return;  // already rendered with the page
    seen.add(m.event_id);
    document.getElementById("empty").hidden = true;
    var li = document.createElement("li");
    li.className = m.author === null ? "new plain" : "new";
    li.dataset.eventId = m.event_id;
    var author = document.createElement("span");
    author.className = "author";
    author.textContent = m.author === null ? "broadcast" : m.author;
    var text = document.createElement("span");
    text.className = "text";
    text.textContent = m.text;
    var via = document.createElement("span");
    via.className = "via";
    via.textContent = (m.author === null
      ? "plain text on " + chat.dataset.channel + ", not posted from this page"
      : m.posted_by === null ? "broadcast on " + chat.dataset.channel
      : "stored by worker " + m.posted_by) + " · delivered live by worker " + m.delivered_by;
    li.append(author, " ", text, via);
    list.append(li);
    li.scrollIntoView({ block: "nearest" });
  }

  // The server sends each line as JSON; anything else (a stream without the example's
  // payload hook) is shown as the plain text it is, rather than lost to a parse error.
  function lineOf(event) {
    try {
      var m = JSON.parse(event.data);
      if (m && typeof m === "object" && typeof m.event_id === "number") return m;
    } catch (err) { /* not JSON: plain text */ }
    return { event_id: "raw:" + event.lastEventId, author: null, text: event.data, delivered_by: "?" };
  }

  function connect() {
    var url = chat.dataset.events + "?lastEventId=" + encodeURIComponent(lastEventId);
    source = new EventSource(url);
    source.onopen = function () { setStatus("live", "live"); };
    source.addEventListener(chat.dataset.channel, function (event) {
      lastEventId = event.lastEventId;
      var m = lineOf(event);
      streamWorker.textContent = "(delivered by worker " + m.delivered_by + ")";
      add(m);
    });
    source.addEventListener("firm-channel-history-trimmed", function () {
      var note = document.createElement("li");
      note.className = "notice";
      note.textContent = "Some older messages were already cleaned up and cannot be shown.";
      list.append(note);
    });
    source.onerror = function () {
      if (source.readyState === EventSource.CLOSED) {
        setStatus("reconnecting…", "down");
        setTimeout(connect, 2000);
      } else {
        setStatus("reconnecting…", "down");
      }
    };
  }

  document.getElementById("post").addEventListener("submit", function (event) {
    event.preventDefault();
    var form = event.target;
    var body = new FormData(form);
    fetch(form.action, { method: "POST", body: body, headers: { Accept: "application/json" } })
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        form.elements.text.value = "";
      })
      .catch(function (err) { setStatus("could not send: " + err.message, "down"); });
  });

  connect();
})();
