// Markdown → DOM for model replies, which are untrusted text. Every piece of text becomes a
// Text node or an element's textContent; no string is ever parsed as HTML, so `<script>` or
// `<img onerror=...>` in a reply shows as those characters. Links keep only http(s) targets.
// Covers what chat models write: fenced code, inline code, headings, lists, quotes, rules,
// bold, italic, links; anything else stays plain text. A fence still open (a reply being
// streamed) renders as code up to the end.
"use strict";

(function () {
  const FENCE = /^\s*(```+|~~~+)\s*([\w+#.-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const BULLET = /^\s*[-*+]\s+(.*)$/;
  const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
  const QUOTE = /^\s*>\s?(.*)$/;
  const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
  // One inline token: `code`, **bold**, __bold__, *italic*, _italic_, [text](http(s) url).
  // Underscores count only outside words (snake_case and __dunder__ names stay text).
  const INLINE = /(`+)([\s\S]+?)\1|\*\*(?=\S)([\s\S]+?)\*\*|(?<!\w)__(?=\S)([\s\S]+?)__(?!\w)|\*(?=\S)([^*]+?)\*|(?<!\w)_(?=\S)([^_]+?)_(?!\w)|\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/;

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function safeHref(url) {
    try {
      const parsed = new URL(url);
      return parsed.protocol === "http:" || parsed.protocol === "https:" ? parsed.href : null;
    } catch (e) {
      return null;
    }
  }

  // Appends `text` to `parent` with inline markup; nested markup inside bold/italic/link text.
  function renderInline(text, parent) {
    // A regex object per call: the recursion below must not move the caller's position.
    const inline = new RegExp(INLINE.source, "g");
    let last = 0;
    for (let m = inline.exec(text); m !== null; m = inline.exec(text)) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      last = inline.lastIndex;
      if (m[1] !== undefined) {
        parent.appendChild(el("code", null, m[2]));
      } else if (m[3] !== undefined || m[4] !== undefined) {
        renderInline(m[3] !== undefined ? m[3] : m[4], parent.appendChild(el("strong")));
      } else if (m[5] !== undefined || m[6] !== undefined) {
        renderInline(m[5] !== undefined ? m[5] : m[6], parent.appendChild(el("em")));
      } else {
        const href = safeHref(m[8]);
        if (href === null) {
          parent.appendChild(document.createTextNode(m[0]));
          continue;
        }
        const a = el("a");
        a.href = href;
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        renderInline(m[7], a);
        parent.appendChild(a);
      }
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  function codeBlock(lang, lines) {
    const wrap = el("div", "code-block");
    const bar = el("div", "code-bar");
    bar.appendChild(el("span", "code-lang", lang || "code"));
    const copy = el("button", "copy-code", "copy");
    copy.type = "button";
    bar.appendChild(copy);
    wrap.appendChild(bar);
    const pre = el("pre");
    const code = el("code", lang ? "language-" + lang : null, lines.join("\n"));
    pre.appendChild(code);
    wrap.appendChild(pre);
    return wrap;
  }

  // Lines of one paragraph keep their line breaks: models use single newlines on purpose.
  function paragraph(lines) {
    const p = el("p");
    lines.forEach((line, i) => {
      if (i > 0) p.appendChild(el("br"));
      renderInline(line, p);
    });
    return p;
  }

  function renderMarkdown(text, container) {
    container.replaceChildren();
    const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
    let para = [];
    let list = null; // {node, ordered}
    let quote = null; // lines of the quote being collected
    const flush = () => {
      if (para.length) container.appendChild(paragraph(para));
      para = [];
      list = null;
      if (quote) {
        const q = el("blockquote");
        renderMarkdown(quote.join("\n"), q);
        container.appendChild(q);
        quote = null;
      }
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const q = QUOTE.exec(line);
      if (q) {
        if (!quote) {
          flush();
          quote = [];
        }
        quote.push(q[1]);
        continue;
      }
      if (quote) flush();
      const fence = FENCE.exec(line);
      if (fence) {
        flush();
        const body = [];
        const close = new RegExp("^\\s*" + fence[1][0] + "{" + fence[1].length + ",}\\s*$");
        for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
        // Still open (streaming): the text's final newline is not a line of code yet.
        if (i >= lines.length && body.length && body[body.length - 1] === "") body.pop();
        container.appendChild(codeBlock(fence[2], body));
        continue;
      }
      if (!line.trim()) {
        flush();
        continue;
      }
      if (RULE.test(line)) {
        flush();
        container.appendChild(el("hr"));
        continue;
      }
      const h = HEADING.exec(line);
      if (h) {
        flush();
        const heading = el("h" + Math.min(h[1].length + 2, 6), "md-heading");
        renderInline(h[2], heading);
        container.appendChild(heading);
        continue;
      }
      const bullet = BULLET.exec(line);
      const numbered = bullet ? null : NUMBERED.exec(line);
      if (bullet || numbered) {
        const ordered = Boolean(numbered);
        if (para.length || !list || list.ordered !== ordered) {
          flush();
          list = { node: el(ordered ? "ol" : "ul"), ordered };
          if (ordered && numbered[1] !== "1") list.node.start = Number(numbered[1]);
          container.appendChild(list.node);
        }
        const item = el("li");
        renderInline(bullet ? bullet[1] : numbered[2], item);
        list.node.appendChild(item);
        continue;
      }
      if (list && /^\s{2,}\S/.test(line)) {
        // A continuation line of the last list item.
        const item = list.node.lastChild;
        item.appendChild(el("br"));
        renderInline(line.trim(), item);
        continue;
      }
      list = null;
      para.push(line);
    }
    flush();
    return container;
  }

  window.pagellmMarkdown = { renderMarkdown, renderInline };
})();
