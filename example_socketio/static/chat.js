// The Socket.IO rooms page: WebSocket only (no long-polling), so any worker can hold a socket.
// Everything from the server is shown with textContent: a message is text, never markup.
(function () {
  "use strict";
  var list = document.getElementById("messages");
  var status = document.getElementById("status");
  var socketWorker = document.getElementById("socket-worker");
  var form = document.getElementById("say");
  var room = "lobby";
  var myWorker = null;
  var socket = io({ transports: ["websocket"] });

  function line(parts, cls) {
    var li = document.createElement("li");
    if (cls) li.className = cls;
    parts.forEach(function (part) {
      var span = document.createElement("span");
      span.className = part[0];
      span.textContent = part[1];
      li.appendChild(span);
      li.appendChild(document.createTextNode(" "));
    });
    list.appendChild(li);
    return li;
  }

  function join(name) {
    socket.emit("join", name, function (answer) {
      if (!answer || !answer.ok) return;
      room = answer.room;
      document.querySelectorAll("#rooms button").forEach(function (b) {
        b.setAttribute("aria-pressed", String(b.dataset.room === room));
      });
      line([["notice", "joined #" + room]], "notice");
    });
  }

  socket.on("connect", function () {
    status.textContent = "connected";
    status.className = "status live";
    join(room);
  });
  socket.on("disconnect", function () {
    status.textContent = "reconnecting…";
    status.className = "status down";
  });
  socket.on("hello", function (body) {
    myWorker = body.worker;
    socketWorker.textContent = "(held by worker " + myWorker + ")";
  });
  socket.on("said", function (m) {
    var where = m.room ? "#" + m.room : "every room";
    var origin = m.shell ? "sent from a shell" : "said on worker " + m.via;
    var via = origin + " · delivered by worker " + myWorker +
      (String(m.via) === String(myWorker) ? "" : " (through the database)");
    line([["author", m.author], ["text", m.text], ["via", where + " · " + via]], "new");
  });

  document.getElementById("rooms").addEventListener("click", function (e) {
    var target = e.target.closest("button[data-room]");
    if (target) join(target.dataset.room);
  });
  form.addEventListener("submit", function (e) {
    e.preventDefault();
    var text = form.elements.text.value;
    socket.emit("say", { room: room, text: text, author: form.elements.author.value }, function (answer) {
      if (answer && answer.ok) form.elements.text.value = "";
    });
  });
})();
