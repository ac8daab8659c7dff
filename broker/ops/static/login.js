// The login page's one-time link: /login#code=CODE (`offload login-link`, `offload demo
// --keep`). The fragment never reaches the server, so the code is in no access log; this
// script takes it out of the address bar and the history at once, posts it (the server
// trades it, once, for the session cookie) and opens the dashboard. Without a code it does
// nothing: the form below logs in with the token.
"use strict";

(() => {
  const match = /^#code=([A-Za-z0-9_-]{1,128})$/.exec(window.location.hash);
  if (!match) {
    return;
  }
  history.replaceState(null, "", window.location.pathname + window.location.search);
  const showError = (message) => {
    const error = document.getElementById("login-error");
    error.textContent = message;
    error.hidden = false;
  };
  fetch("/login/once", {
    method: "POST",
    body: new URLSearchParams({ code: match[1] }),
    credentials: "same-origin",
    cache: "no-store",
  })
    .then((response) => {
      if (response.ok) {
        window.location.replace("/");
      } else {
        showError(
          "this login link was used already or has expired: paste the token, or ask for " +
            "a new link (offload login-link)",
        );
      }
    })
    .catch(() => showError("the broker could not be reached: try again"));
})();
