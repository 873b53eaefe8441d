// The page as text for a language model: one line per visible element that can be acted on or that carries
// text, in document order. Elements that can be acted on get a number, kept in a `data-agentrl-id` attribute,
// so an element keeps its number for as long as the page lives (BrowserGym's `bid`s work the same way).
// Called as `(rootSelector) => {...}`; returns {lines, elements}.
(rootSelector) => {
  const ATTR = "data-agentrl-id";
  const root = (rootSelector && document.querySelector(rootSelector)) || document.body;
  if (!root) return { lines: [], elements: [] };
  if (window.__agentrlNextId === undefined) window.__agentrlNextId = 1;

  const INPUT_ROLES = { checkbox: "checkbox", radio: "radio", button: "button", submit: "button", reset: "button",
                        image: "button", range: "slider", number: "spinbutton", search: "searchbox" };
  const ACTIONABLE = new Set(["link", "button", "checkbox", "radio", "textbox", "searchbox", "spinbutton", "slider",
                              "combobox", "listbox", "option", "tab", "menuitem", "treeitem", "switch", "clickable"]);
  const clean = (s, n = 100) => {
    s = (s || "").replace(/\s+/g, " ").trim();
    return s.length > n ? s.slice(0, n - 1) + "…" : s;
  };
  const roleOf = (el) => {
    const explicit = el.getAttribute("role");
    if (explicit) return explicit;
    const tag = el.tagName.toLowerCase();
    if (tag === "a" && el.hasAttribute("href")) return "link";
    if (tag === "button") return "button";
    if (tag === "textarea") return "textbox";
    if (tag === "select") return el.multiple ? "listbox" : "combobox";
    if (tag === "input") {
      const type = (el.getAttribute("type") || "text").toLowerCase();
      if (type === "hidden") return null;
      return INPUT_ROLES[type] || "textbox";
    }
    if (/^h[1-6]$/.test(tag)) return "heading";
    if (tag === "img") return "img";
    if (el.isContentEditable && el.parentElement && !el.parentElement.isContentEditable) return "textbox";
    if (el.hasAttribute("onclick") || (el.tabIndex >= 0 && el.hasAttribute("tabindex"))) return "clickable";
    // Scripts attach click handlers that the DOM does not show; a pointer cursor set on this very element
    // (not inherited) is the page's own sign that it reacts to clicks.
    const style = getComputedStyle(el);
    if (style.cursor === "pointer" && (!el.parentElement || getComputedStyle(el.parentElement).cursor !== "pointer"))
      return "clickable";
    return null;
  };
  const visible = (el) => {
    const style = getComputedStyle(el);
    if (style.display === "none" || style.visibility === "hidden" || style.opacity === "0") return false;
    const box = el.getBoundingClientRect();
    return box.width > 0 && box.height > 0;
  };
  const labelOf = (el) => {
    const aria = el.getAttribute("aria-label");
    if (aria) return aria;
    const by = el.getAttribute("aria-labelledby");
    if (by) return by.split(/\s+/).map((id) => document.getElementById(id)?.innerText || "").join(" ");
    if (el.labels && el.labels.length) return Array.from(el.labels).map((l) => l.innerText).join(" ");
    return "";
  };
  const nameOf = (el, role) => {
    const label = labelOf(el);
    if (label) return label;
    if (["textbox", "searchbox", "spinbutton", "combobox", "listbox", "slider"].includes(role))
      return el.getAttribute("placeholder") || el.getAttribute("title") || el.getAttribute("name") || "";
    if (role === "checkbox" || role === "radio")  // unlabelled: the text right after it is its label
      return el.nextSibling ? el.nextSibling.textContent : (el.parentElement?.innerText || "");
    if (role === "img") return el.getAttribute("alt") || el.getAttribute("title") || "";
    if (el.tagName === "INPUT") return el.value || el.getAttribute("title") || "";
    return el.innerText || el.getAttribute("title") || el.getAttribute("alt") || "";
  };
  const stateOf = (el, role) => {
    const parts = [];
    if (["textbox", "searchbox", "spinbutton", "slider"].includes(role) && "value" in el)
      parts.push(`value=${JSON.stringify(clean(el.value, 200))}`);
    if (role === "combobox" || role === "listbox") {
      if (el.tagName === "SELECT") {
        const chosen = Array.from(el.selectedOptions).map((o) => JSON.stringify(clean(o.text)));
        parts.push(`value=${chosen.join(",") || '""'}`);
        parts.push("options: " + Array.from(el.options).map((o) => JSON.stringify(clean(o.text))).join(" | "));
      } else if ("value" in el) parts.push(`value=${JSON.stringify(clean(el.value, 200))}`);
    }
    if ((role === "checkbox" || role === "radio" || role === "switch") && (el.checked || el.getAttribute("aria-checked") === "true"))
      parts.push("checked");
    if (el.getAttribute("aria-selected") === "true") parts.push("selected");
    const expanded = el.getAttribute("aria-expanded");
    if (expanded !== null) parts.push(expanded === "true" ? "expanded" : "collapsed");
    if (el.tagName === "TEXTAREA") parts.push("multiline");
    if (el.disabled) parts.push("disabled");
    if (document.activeElement === el) parts.push("focused");
    return parts;
  };

  const lines = [], elements = [];
  const consumed = new Set();  // text nodes already shown as an element's name
  // Text runs through inline elements (`Enter <b>Bob</b> here`) make one line, up to the next block or element.
  let run = null;
  const blockOf = (el) => {
    while (el.parentElement && getComputedStyle(el).display.startsWith("inline")) el = el.parentElement;
    return el;
  };
  const addText = (node) => {
    const block = blockOf(node.parentElement);
    if (run && run.block === block) { run.text += node.textContent; return; }
    flush();
    run = { block, text: node.textContent };
  };
  const flush = () => {
    if (run) { const text = clean(run.text, 300); if (text) lines.push(text); }
    run = null;
  };
  const walk = (node, insideActionable) => {
    for (const child of node.childNodes) {
      if (child.nodeType === Node.TEXT_NODE) {
        // Text inside an actionable element is already its name.
        if (child.textContent.trim() && !insideActionable && !consumed.has(child) && child.parentElement &&
            visible(child.parentElement)) addText(child);
        continue;
      }
      if (child.nodeType !== Node.ELEMENT_NODE) continue;
      const tag = child.tagName.toLowerCase();
      if (["script", "style", "noscript", "template", "option"].includes(tag) || !visible(child)) continue;
      const role = roleOf(child);
      if (role && (ACTIONABLE.has(role) || role === "heading" || role === "img")) {
        let id = child.getAttribute(ATTR);
        if (!id && ACTIONABLE.has(role)) { id = String(window.__agentrlNextId++); child.setAttribute(ATTR, id); }
        flush();
        const name = clean(nameOf(child, role));
        if ((role === "checkbox" || role === "radio") && !labelOf(child) && child.nextSibling)
          consumed.add(child.nextSibling);
        for (const label of child.labels || [])  // a wrapping <label>'s text is the name
          if (label.contains(child)) label.childNodes.forEach((n) => n.nodeType === Node.TEXT_NODE && consumed.add(n));
        const state = stateOf(child, role);
        const shown = ACTIONABLE.has(role) ? `[${id}] ` : "";
        lines.push(`${shown}${role}${name ? " " + JSON.stringify(name) : ""}${state.length ? " " + state.join(" ") : ""}`);
        if (ACTIONABLE.has(role)) elements.push({ id: Number(id), role, name, tag, state });
        if (tag === "select" || tag === "textarea") continue;
        // Its text is its name; actionable elements inside it (a tree node's children) still get lines.
        walk(child, true);
        continue;
      }
      walk(child, insideActionable);
    }
  };
  walk(root, false);
  flush();
  return { lines, elements };
}
