/* The console's few behaviours, plain JS, no build step:
 * - a form or button with data-confirm asks first; cancelling sends nothing;
 * - a button with data-copy copies the text of the element with that id;
 * - a select with data-autosubmit sends its form when changed, one with data-navigate goes to
 *   the address chosen (no inline handlers: the Content-Security-Policy runs none). */
(function () {
  "use strict";

  document.addEventListener("submit", function (event) {
    const button = event.submitter;
    const question = (button && button.dataset.confirm) || event.target.dataset.confirm;
    if (question && !window.confirm(question)) event.preventDefault();
  });

  document.addEventListener("change", function (event) {
    const select = event.target;
    if (select.matches("select[data-autosubmit]")) select.form.requestSubmit();
    else if (select.matches("select[data-navigate]") && select.value) location.href = select.value;
  });

  function copied(button, text) {
    const before = button.textContent;
    button.textContent = text;
    setTimeout(function () { button.textContent = before; }, 1500);
  }

  document.addEventListener("click", function (event) {
    const button = event.target.closest("button[data-copy]");
    if (!button) return;
    const source = document.getElementById(button.dataset.copy);
    const text = source.textContent.trim();
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(
        function () { copied(button, "Copied"); },
        function () { copied(button, "Select and copy it"); }
      );
      return;
    }
    // plain http on another host than localhost has no clipboard API: select and copy
    const range = document.createRange();
    range.selectNodeContents(source);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    copied(button, document.execCommand("copy") ? "Copied" : "Press Ctrl+C");
  });
})();
