/* Markdown for chat replies: marked parses, DOMPurify sanitises, so neither a model's output
 * nor a user's text can inject script. Raw HTML in the source is shown as text, never
 * rendered; links (web and mail addresses only) open in a new tab without an opener. */
(function () {
  "use strict";

  function escapeHtml(text) {
    return String(text)
      .replace(/&/g, "&amp;")
      .replace(/</g, "&lt;")
      .replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;")
      .replace(/'/g, "&#39;");
  }

  marked.use({
    gfm: true,
    breaks: true,
    renderer: {
      html(token) {
        return escapeHtml(token.raw !== undefined ? token.raw : token.text);
      },
    },
  });

  DOMPurify.addHook("afterSanitizeAttributes", function (node) {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer nofollow");
    }
  });

  const PURIFY = {
    USE_PROFILES: { html: true },
    // links a model writes lead to the web or to mail only: no other scheme, and no address
    // on this site (a reply could dress one of its pages up as anything)
    ALLOWED_URI_REGEXP: /^(?:https?|mailto):/i,
    FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "iframe", "img"],
    FORBID_ATTR: ["style"],
  };

  function toHtml(text) {
    return DOMPurify.sanitize(marked.parse(text || "", { async: false }), PURIFY);
  }

  function copyText(text, button) {
    const done = function () {
      const label = button.textContent;
      button.textContent = "Copied";
      button.classList.add("copied");
      setTimeout(function () {
        button.textContent = label;
        button.classList.remove("copied");
      }, 1200);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () { fallbackCopy(text); done(); });
    } else {
      fallbackCopy(text);
      done();
    }
  }

  function fallbackCopy(text) {
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    try { document.execCommand("copy"); } catch (e) { /* nothing else to try */ }
    area.remove();
  }

  /* Render ``text`` into ``element``, giving every code block a header and a copy button. */
  function render(element, text) {
    element.innerHTML = toHtml(text);
    element.querySelectorAll("pre > code").forEach(function (code) {
      const pre = code.parentElement;
      const match = /language-([\w+#.-]+)/.exec(code.className || "");
      const bar = document.createElement("div");
      bar.className = "code-bar";
      const lang = document.createElement("span");
      lang.textContent = match ? match[1] : "code";
      const button = document.createElement("button");
      button.type = "button";
      button.className = "copy-code";
      button.textContent = "Copy";
      button.addEventListener("click", function () { copyText(code.textContent, button); });
      bar.append(lang, button);
      const wrap = document.createElement("div");
      wrap.className = "code-block";
      pre.replaceWith(wrap);
      wrap.append(bar, pre);
    });
  }

  window.ChatMarkdown = { render: render, toHtml: toHtml, copyText: copyText };
})();
