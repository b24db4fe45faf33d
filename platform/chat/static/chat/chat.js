/* The chat page: sidebar (search, rename, delete), settings, and the conversation over the
 * WebSocket protocol documented in chat/consumers.py. Plain JS, no build step. */
(function () {
  "use strict";

  const $ = function (id) { return document.getElementById(id); };
  const state = JSON.parse($("chat-state").textContent || "null");
  const csrfToken = document.querySelector("input[name=csrfmiddlewaretoken]").value;
  const PENDING_KEY = "chat:pending";
  const UNTITLED = "New conversation";  // what the page shows for a conversation without a title

  const thread = $("thread");
  const input = $("input");
  const composer = $("composer");
  const sendButton = $("send");
  const stopButton = $("stop");
  const banner = $("banner");

  let socket = null;
  let reconnectDelay = 500;
  let isGenerating = false;
  let streaming = null; // {id, text, el, body, frame}
  let pending = null; // a send or an edit the server has not answered yet (isLost: socket closed)
  let retryTimer = null;
  let isSavingSettings = false;

  // the organization picker sends its form when changed (no inline handler: the page's
  // Content-Security-Policy runs none)
  const tenantSelect = $("tenant-select");
  if (tenantSelect) {
    tenantSelect.addEventListener("change", function () { tenantSelect.form.requestSubmit(); });
  }

  // --- small helpers -------------------------------------------------------------------------

  function post(url, data) {
    const body = new URLSearchParams(data || {});
    return fetch(url, {
      method: "POST",
      headers: { "X-CSRFToken": csrfToken, Accept: "application/json" },
      body: body,
      credentials: "same-origin",
    });
  }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function autosize() {
    input.style.height = "auto";
    input.style.height = Math.min(input.scrollHeight, 240) + "px";
  }

  function scrollToEnd(force) {
    const nearEnd = thread.scrollHeight - thread.scrollTop - thread.clientHeight < 120;
    if (force || nearEnd) thread.scrollTop = thread.scrollHeight;
  }

  // --- banner (errors, quota refusals) --------------------------------------------------------

  // A refusal's text ends "Please try again in 12s." (or 1m30s, 4d12h); the banner counts
  // down instead, and nothing else shows a second, frozen countdown.
  const COUNTDOWN = /\s*Please try again in (?:\d+(?:ms|[dhms]))+\.?$/;

  function withoutCountdown(message) {
    return (message || "").replace(COUNTDOWN, "");
  }

  // A wait as the server writes it (tenants.quotas.format_wait): 12s, 1m30s, 1h1m, 4d12h.
  function formatWait(seconds) {
    const minutes = Math.floor(seconds / 60), hours = Math.floor(minutes / 60);
    const days = Math.floor(hours / 24);
    if (days) return days + "d" + (hours % 24) + "h";
    if (hours) return hours + "h" + (minutes % 60) + "m";
    return minutes ? minutes + "m" + (seconds % 60) + "s" : seconds + "s";
  }

  function showBanner(message, retryAfter, onRetry) {
    clearInterval(retryTimer);
    const wasNearEnd = thread.scrollHeight - thread.scrollTop - thread.clientHeight < 120;
    banner.hidden = false;
    if (wasNearEnd) thread.scrollTop = thread.scrollHeight;
    const text = $("banner-text");
    const retry = $("banner-retry");
    retry.hidden = true;
    text.textContent = message;
    if (retryAfter) {
      let left = retryAfter;
      const tick = function () {
        if (left > 0) {
          text.textContent = withoutCountdown(message) + " You can retry in " + formatWait(left) + ".";
          left -= 1;
          return;
        }
        clearInterval(retryTimer);
        text.textContent = withoutCountdown(message) + " You can retry now.";
        if (onRetry) {
          retry.hidden = false;
          retry.onclick = function () { hideBanner(); onRetry(); };
        }
      };
      tick();
      retryTimer = setInterval(tick, 1000);
    }
  }

  function hideBanner() {
    clearInterval(retryTimer);
    banner.hidden = true;
  }

  $("banner-close").addEventListener("click", hideBanner);

  // --- messages ---------------------------------------------------------------------------------

  function messageNode(message) {
    const node = el("article", "message " + message.role);
    node.dataset.id = message.id;
    node.dataset.role = message.role;
    const avatar = el("div", "avatar", message.role === "user" ? "You" : "AI");
    const bubble = el("div", "bubble");
    const body = el("div", "body");
    bubble.append(body);
    const meta = el("div", "meta");
    bubble.append(meta);
    node.append(avatar, bubble);
    fillMessage(node, message);
    return node;
  }

  function fillMessage(node, message) {
    const body = node.querySelector(".body");
    const meta = node.querySelector(".meta");
    // an edit open here ends when the message changed elsewhere: the new text replaces its area
    node.classList.remove("editing");
    node.dataset.status = message.status;
    node.dataset.content = message.content;
    if (message.role === "user") {
      body.textContent = message.content; // shown as typed: user text never becomes HTML
    } else {
      ChatMarkdown.render(body, message.content);
      if (!message.content && message.status === "streaming") body.append(typingDots());
    }
    meta.replaceChildren();
    if (message.status === "stopped") meta.append(el("span", "badge stopped", "Stopped"));
    if (message.status === "error") {
      meta.append(el("span", "badge error",
        withoutCountdown(message.error_message) || "The reply failed."));
    }
    if (message.status !== "streaming") meta.append(...actions(node, message));
  }

  function typingDots() {
    const dots = el("span", "typing");
    dots.append(el("i"), el("i"), el("i"));
    return dots;
  }

  function actions(node, message) {
    const buttons = [];
    if (message.content) {
      const copy = el("button", "action copy-reply", "Copy");
      copy.type = "button";
      copy.addEventListener("click", function () {
        ChatMarkdown.copyText(node.dataset.content, copy);
      });
      buttons.push(copy);
    }
    if (message.role === "user") {
      const edit = el("button", "action edit", "Edit");
      edit.type = "button";
      edit.addEventListener("click", function () { startEdit(node); });
      buttons.push(edit);
    } else {
      const regenerate = el("button", "action regenerate", "Regenerate");
      regenerate.type = "button";
      regenerate.addEventListener("click", function () { send({ type: "regenerate" }); });
      buttons.push(regenerate);
    }
    return buttons;
  }

  function refreshActions() {
    // Regenerate only on the last reply.
    const replies = thread.querySelectorAll(".message.assistant");
    replies.forEach(function (node, index) {
      const button = node.querySelector(".regenerate");
      if (button) button.hidden = index !== replies.length - 1;
    });
    thread.querySelectorAll(".message .edit").forEach(function (b) { b.disabled = isGenerating; });
    thread.querySelectorAll(".message .regenerate").forEach(function (b) {
      b.disabled = isGenerating;
    });
  }

  function startEdit(node) {
    if (isGenerating || node.classList.contains("editing")) return;
    node.classList.add("editing");
    const body = node.querySelector(".body");
    const original = node.dataset.content;
    const area = el("textarea", "edit-area");
    area.value = original;
    const save = el("button", "primary small", "Save & send");
    save.type = "button";
    const cancel = el("button", "ghost small", "Cancel");
    cancel.type = "button";
    const row = el("div", "edit-row");
    row.append(cancel, save);
    body.replaceChildren(area, row);
    area.focus();
    const finish = function () {  // the message as saved (changed elsewhere meanwhile, maybe)
      node.classList.remove("editing");
      body.textContent = node.dataset.content;
    };
    cancel.addEventListener("click", finish);
    save.addEventListener("click", function () {
      const content = area.value;
      if (!content.trim()) return;
      node.classList.remove("editing");
      body.textContent = content;
      // shown at once, but the server's "message" frame confirms it; a refusal restores it
      if (send({ type: "edit", message_id: Number(node.dataset.id), content: content })) {
        pending = { kind: "edit", id: Number(node.dataset.id), restore: finish };
      } else {
        finish();
      }
    });
    area.addEventListener("keydown", function (event) {
      if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); save.click(); }
      if (event.key === "Escape") finish();
    });
  }

  function appendMessage(message) {
    $("empty-state").hidden = true;
    const existing = thread.querySelector('.message[data-id="' + message.id + '"]');
    if (existing) {
      fillMessage(existing, message);
      return existing;
    }
    const node = messageNode(message);
    thread.append(node);
    return node;
  }

  function removeAfter(id) {
    thread.querySelectorAll(".message").forEach(function (node) {
      if (Number(node.dataset.id) > id) node.remove();
    });
  }

  // --- streaming --------------------------------------------------------------------------------

  function setGenerating(value) {
    isGenerating = value;
    sendButton.hidden = value;
    stopButton.hidden = !value;
    document.body.classList.toggle("generating", value);
    refreshActions();
  }

  function scheduleRender() {
    if (!streaming || streaming.frame) return;
    streaming.frame = requestAnimationFrame(function () {
      if (!streaming) return;
      streaming.frame = 0;
      ChatMarkdown.render(streaming.body, streaming.text);
      streaming.body.append(el("span", "cursor"));
      scrollToEnd(false);
    });
  }

  // The conversation as saved (after each connect, and when a reply that another window
  // generated ended unheard of): the thread is brought in line without redrawing what is the
  // same, and a reply being generated shows as such, its text so far arriving as tokens.
  function applySync(frame) {
    if (pending && pending.kind === "send") settleSend(frame.messages);
    const ids = new Set(frame.messages.map(function (message) { return message.id; }));
    thread.querySelectorAll(".message").forEach(function (node) {
      if (!ids.has(Number(node.dataset.id))) node.remove();
    });
    frame.messages.forEach(function (message) {
      const node = thread.querySelector('.message[data-id="' + message.id + '"]');
      if (!node) {
        // in id order, before the first message shown that came later
        const later = Array.prototype.find.call(thread.querySelectorAll(".message"), function (other) {
          return Number(other.dataset.id) > message.id;
        });
        thread.insertBefore(messageNode(message), later || null);
        return;
      }
      if (streaming && streaming.id === message.id && message.status === "streaming") return;
      if (node.dataset.status !== message.status || node.dataset.content !== message.content) {
        fillMessage(node, message);
      }
    });
    $("empty-state").hidden = frame.messages.length > 0;
    if (frame.generating === null) {
      endStreaming();
    } else if (!streaming || streaming.id !== frame.generating) {
      const node = thread.querySelector('.message[data-id="' + frame.generating + '"]');
      if (node) {
        streaming = { id: frame.generating, text: "", node: node, body: node.querySelector(".body"), frame: 0 };
        setGenerating(true);
      }
    }
    applySettings(frame.settings, false);
    refreshActions();
  }

  // A send whose "message" frame has not come, against the messages a sync holds: saved if one
  // of them is a user message with its text that is not shown yet (as its own frame would, that
  // empties the composer); not saved if its socket closed (the text stays there to send again).
  function settleSend(messages) {
    const isSaved = messages.some(function (message) {
      return message.role === "user" && message.content === pending.content &&
        !thread.querySelector('.message[data-id="' + message.id + '"]');
    });
    if (isSaved) clearComposer(pending.content);
    if (isSaved || pending.isLost) pending = null;
  }

  function clearComposer(content) {
    if (input.value !== content) return;  // written on since: kept
    input.value = "";
    autosize();
  }

  // A reply that another window generated ended: shown as it was saved.
  function applyRelayedDone(frame) {
    const message = frame.message;
    if (streaming && streaming.id === message.id) endStreaming();
    const node = thread.querySelector('.message[data-id="' + message.id + '"]');
    if (node) fillMessage(node, message);
    refreshActions();
    scrollToEnd(false);
  }

  function onFrame(frame) {
    switch (frame.type) {
      case "sync":
        applySync(frame);
        break;
      case "message":
        if (frame.relayed) {
          // another window's: this window's own send or edit is still waiting for its answer
        } else if (pending && pending.kind === "send" && frame.message.role === "user") {
          clearComposer(pending.content);
          pending = null;
        } else if (pending && pending.kind === "edit" && frame.message.id === pending.id) {
          pending = null;
        }
        appendMessage(frame.message);
        scrollToEnd(true);
        break;
      case "start": {
        if (!frame.relayed) hideBanner();
        removeAfter(frame.after_id);
        const node = appendMessage({
          id: frame.message_id, role: "assistant", content: "", status: "streaming",
        });
        streaming = { id: frame.message_id, text: "", node: node, body: node.querySelector(".body"), frame: 0 };
        setGenerating(true);
        scrollToEnd(true);
        break;
      }
      case "token":
        if (streaming) {
          streaming.text += frame.text;
          scheduleRender();
        }
        break;
      case "done":
        if (frame.relayed) applyRelayedDone(frame);
        else finishStreaming({ status: frame.status, error_message: "" });
        break;
      case "error":
        if (pending && pending.kind === "edit") pending.restore();  // not saved: as it was
        pending = null;
        if (frame.message_id !== undefined && streaming && streaming.id === frame.message_id) {
          finishStreaming({ status: "error", error_message: frame.message });
        }
        showBanner(frame.message, frame.retry_after, frame.message_id !== undefined ? function () {
          send({ type: "regenerate" });
        } : null);
        break;
      case "settings":
        applySettings(frame.settings, !frame.relayed);
        break;
      default:
        break;
    }
  }

  function finishStreaming(result) {
    if (!streaming) { setGenerating(false); return; }
    fillMessage(streaming.node, {
      id: streaming.id, role: "assistant", content: streaming.text,
      status: result.status, error_message: result.error_message,
    });
    endStreaming();
    scrollToEnd(false);
  }

  // No reply shows as being written any more (its node is left as it is).
  function endStreaming() {
    if (streaming && streaming.frame) cancelAnimationFrame(streaming.frame);
    streaming = null;
    setGenerating(false);
  }

  // --- the socket -------------------------------------------------------------------------------

  function setConnection(text, className) {
    const badge = $("connection");
    if (!badge) return;
    badge.textContent = text;
    badge.className = "connection " + (className || "");
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(scheme + "://" + location.host + "/ws/chat/" + state.conversation_id + "/");
    let opened = false;
    socket.addEventListener("open", function () {
      opened = true;
      reconnectDelay = 500;
      setConnection("", "online");
      document.body.dataset.socket = "open";
      send({ type: "sync" });  // what changed since the page was drawn, or the socket lost
      const pending = sessionStorage.getItem(PENDING_KEY + ":" + state.conversation_id);
      if (pending) {
        sessionStorage.removeItem(PENDING_KEY + ":" + state.conversation_id);
        send({ type: "send", content: pending });
      }
    });
    socket.addEventListener("message", function (event) {
      try { onFrame(JSON.parse(event.data)); } catch (e) { console.error(e); }
    });
    socket.addEventListener("close", function (event) {
      document.body.dataset.socket = "closed";
      if (streaming) finishStreaming({ status: "stopped", error_message: "" });
      // what the server may not have read: an edit shows the message as saved until the next
      // sync shows it edited, if it was; a send stays pending until that sync settles it
      if (pending && pending.kind === "edit") {
        pending.restore();
        pending = null;
      }
      if (pending) pending.isLost = true;
      if (event.code === 4401) {
        setConnection("Signed out", "offline");
        showBanner("Your session has ended. Reload the page to sign in again.");
        return;
      }
      if (event.code === 4403) {
        setConnection("No access", "offline");
        showBanner("You no longer have access to this conversation.");
        return;
      }
      if (event.code === 4404) {
        setConnection("Deleted", "offline");
        showBanner("This conversation was deleted.");
        return;
      }
      setConnection(opened ? "Reconnecting…" : "Connecting…", "offline");
      setTimeout(connect, reconnectDelay);
      reconnectDelay = Math.min(reconnectDelay * 2, 10000);
    });
  }

  let settingsDue = null;  // settings changed, waiting for a pause (saveSettingSoon)
  let settingsTimer = null;

  function send(frame) {
    if (!socket || socket.readyState !== WebSocket.OPEN) {
      showBanner("Not connected yet; trying again in a moment.");
      return false;
    }
    // settings waiting for a pause go first: a reply asked for now uses them
    if (frame.type !== "settings" && frame.type !== "stop") flushSettings();
    socket.send(JSON.stringify(frame));
    return true;
  }

  // --- composer ---------------------------------------------------------------------------------

  async function submitMessage() {
    const content = input.value;
    // a send not answered yet blocks another: a second Enter or click would send it twice
    if (!content.trim() || isGenerating || pending || composer.dataset.disabled) return;
    if (!state) {
      // No conversation yet: create one, then send from its page.
      pending = { kind: "send", content: content };
      sendButton.disabled = true;
      const picker = $("model-picker");
      const response = await post($("new-form").action, picker ? { model: picker.value } : {})
        .catch(function () { return null; });  // offline: refused, as below
      sendButton.disabled = false;
      if (!response || !response.ok) {
        pending = null;
        const data = response ? await response.json().catch(function () { return {}; }) : {};
        showBanner(data.error || "Could not start a conversation.");
        return;
      }
      const data = await response.json();
      sessionStorage.setItem(PENDING_KEY + ":" + data.id, content);
      location.href = data.url;
      return;
    }
    // the text stays in the composer until the server saved it (its "message" frame): a
    // refusal (busy in another window, too long) leaves it there to send again
    if (send({ type: "send", content: content })) {
      pending = { kind: "send", content: content };
    }
  }

  composer.addEventListener("submit", function (event) {
    event.preventDefault();
    submitMessage();
  });
  input.addEventListener("keydown", function (event) {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      submitMessage();
    }
  });
  input.addEventListener("input", autosize);
  stopButton.addEventListener("click", function () {
    // the reply shown: a stop that crosses its end does not stop the next one
    send({ type: "stop", message_id: streaming ? streaming.id : undefined });
  });

  // --- settings ---------------------------------------------------------------------------------

  // The conversation's settings as saved; only those named change (a rename names the title
  // alone). ``isOwn``: the answer to this window's own settings frame.
  function applySettings(settings, isOwn) {
    const title = $("conversation-title");
    const item = document.querySelector('.conversation-item[data-id="' + state.conversation_id + '"]');
    if (settings.title !== undefined) {  // the empty title too: renamed to none
      if (title && !title.isContentEditable) title.textContent = settings.title || UNTITLED;
      if (item) {
        item.querySelector(".conversation-link").textContent = settings.title || UNTITLED;
        item.dataset.title = settings.title.toLowerCase();
      }
      document.title = (settings.title || UNTITLED) + " · LLM Platform";
    }
    const picker = $("model-picker");
    if (picker && settings.model) picker.value = settings.model;
    // the settings panel too (changed in another window), but not a field being edited here
    const system = $("setting-system");
    if (system && document.activeElement !== system && settings.system_prompt !== undefined) {
      system.value = settings.system_prompt;
    }
    const temperature = $("setting-temperature");
    if (temperature && document.activeElement !== temperature && settings.temperature !== undefined) {
      temperature.value = settings.temperature;
      $("temperature-value").textContent = Number(settings.temperature).toFixed(2);
    }
    const maxTokens = $("setting-max-tokens");
    if (maxTokens && document.activeElement !== maxTokens && settings.max_tokens !== undefined) {
      maxTokens.value = settings.max_tokens === null ? "" : settings.max_tokens;
    }
    if (!isOwn) return;
    const status = $("settings-status");
    if (status && isSavingSettings) status.textContent = "Saved. Changes apply to the next reply.";
    isSavingSettings = false;
  }

  function saveSetting(frame) {
    isSavingSettings = send(Object.assign({ type: "settings" }, frame));
  }

  // A slider or a number stepped with the keyboard fires "change" at every step: the values
  // wait for a pause and go in one frame (a socket's frames are budgeted: 20 at once).
  function saveSettingSoon(frame) {
    settingsDue = Object.assign(settingsDue || {}, frame);
    clearTimeout(settingsTimer);
    settingsTimer = setTimeout(flushSettings, 300);
  }

  function flushSettings() {
    clearTimeout(settingsTimer);
    if (!settingsDue) return;
    const due = settingsDue;
    settingsDue = null;
    saveSetting(due);
  }

  function wireSettings() {
    const panel = $("settings");
    const toggle = $("toggle-settings");
    toggle.addEventListener("click", function () {
      panel.hidden = !panel.hidden;
      toggle.setAttribute("aria-expanded", String(!panel.hidden));
    });
    $("setting-system").addEventListener("change", function (event) {
      saveSetting({ system_prompt: event.target.value });
    });
    const temperature = $("setting-temperature");
    temperature.addEventListener("input", function () {
      $("temperature-value").textContent = Number(temperature.value).toFixed(2);
    });
    temperature.addEventListener("change", function () {
      saveSettingSoon({ temperature: Number(temperature.value) });
    });
    const maxTokens = $("setting-max-tokens");
    maxTokens.addEventListener("change", function () {
      // empty: up to the model's context length (text a number field cannot read reads as
      // empty too, but is bad input)
      if (maxTokens.value === "" && !maxTokens.validity.badInput) {
        return saveSettingSoon({ max_tokens: null });
      }
      // read as the number shown: "1e3" is 1000 and "2.5" no whole number (parseInt: 1 and 2)
      const value = maxTokens.valueAsNumber;
      if (Number.isInteger(value) && value >= 1) return saveSettingSoon({ max_tokens: value });
      showBanner("Max tokens must be a whole number, 1 to " + maxTokens.max + ".");
    });
  }

  // --- model picker and example prompts -------------------------------------------------------

  function wireStart() {
    const picker = $("model-picker");
    // with a conversation the choice is saved for its next reply; without, it is sent when
    // the first message creates the conversation
    if (picker && state) {
      picker.addEventListener("change", function () { saveSetting({ model: picker.value }); });
    }
    document.querySelectorAll("#examples .example").forEach(function (button) {
      button.addEventListener("click", function () {
        input.value = button.textContent;
        autosize();
        submitMessage();
      });
    });
  }

  // --- sidebar ----------------------------------------------------------------------------------

  function wireSidebar() {
    const search = $("search");
    search.addEventListener("input", function () {
      const query = search.value.trim().toLowerCase();
      let shown = 0;
      document.querySelectorAll(".conversation-item").forEach(function (item) {
        const match = !query || item.dataset.title.includes(query);
        item.hidden = !match;
        if (match) shown += 1;
      });
      $("no-match").hidden = shown > 0 || !document.querySelector(".conversation-item");
    });
    document.querySelectorAll(".conversation-item .rename").forEach(function (button) {
      button.addEventListener("click", function () {
        const link = button.parentElement.querySelector(".conversation-link");
        inlineRename(link, button.dataset.url);
      });
    });
    document.querySelectorAll(".delete-form").forEach(function (form) {
      form.addEventListener("submit", function (event) {
        if (!confirm("Delete this conversation? This cannot be undone.")) event.preventDefault();
      });
    });
    const title = $("conversation-title");
    if (title) title.addEventListener("click", function () { inlineRename(title, title.dataset.url); });
    $("toggle-sidebar").addEventListener("click", function () {
      document.body.classList.toggle("sidebar-open");
    });
  }

  function inlineRename(node, url) {
    if (node.dataset.renaming) return;
    node.dataset.renaming = "1";
    const before = node.textContent.trim();
    const field = el("input", "rename-input");
    field.value = before === UNTITLED ? "" : before;
    field.maxLength = 200;
    field.setAttribute("aria-label", "Conversation title");
    node.hidden = true;
    node.after(field);
    field.focus();
    field.select();
    let isDone = false;
    const finish = async function (save) {
      if (isDone) return;
      isDone = true;
      field.remove();
      node.hidden = false;
      delete node.dataset.renaming;
      const title = field.value.trim();
      if (!save || title === before) return;
      const response = await post(url, { title: title });
      if (!response.ok) {
        showBanner("Could not rename the conversation.");
        return;
      }
      const data = await response.json();
      document.querySelectorAll('.conversation-item[data-id="' + data.id + '"] .conversation-link')
        .forEach(function (link) { link.textContent = data.title || UNTITLED; });
      const item = document.querySelector('.conversation-item[data-id="' + data.id + '"]');
      if (item) item.dataset.title = (data.title || "").toLowerCase();
      const header = $("conversation-title");
      if (header && state && state.conversation_id === data.id) {
        header.textContent = data.title || UNTITLED;
      }
    };
    field.addEventListener("keydown", function (event) {
      if (event.key === "Enter") { event.preventDefault(); finish(true); }
      if (event.key === "Escape") finish(false);
    });
    field.addEventListener("blur", function () { finish(true); });
  }

  // --- start ------------------------------------------------------------------------------------

  wireSidebar();
  wireStart();
  if (state) {
    state.messages.forEach(appendMessage);
    refreshActions();
    wireSettings();
    setConnection("Connecting…", "offline");
    connect();
    scrollToEnd(true);
  }
  input.focus();
})();
