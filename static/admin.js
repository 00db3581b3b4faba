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
