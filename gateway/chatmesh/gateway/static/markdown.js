// Safe Markdown rendering for replies: the text is never parsed as HTML. Blocks (code fences, headings, lists,
// paragraphs) and inlines (code, bold, italic, links) become DOM nodes whose text is set with textContent.
// Links render only for http(s) URLs (the edge has already reduced links to hosts off its allowlist to text);
// images are never rendered, `![alt](url)` stays literal text.
"use strict";

const Markdown = (() => {
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|(!?)\[([^\]]*)\]\(([^)\s]+)\)/g;

  function inline(parent, text) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.append(text.slice(last, m.index));
      if (m[1]) {
        const code = document.createElement("code");
        code.textContent = m[2];
        parent.append(code);
      } else if (m[3] !== undefined) {
        const b = document.createElement("strong");
        inline(b, m[3]);
        parent.append(b);
      } else if (m[4] !== undefined) {
        const i = document.createElement("em");
        inline(i, m[4]);
        parent.append(i);
      } else if (m[5] === "" && /^https?:\/\//i.test(m[7])) {
        const a = document.createElement("a");
        a.href = m[7];
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        a.textContent = m[6];
        parent.append(a);
      } else {
        parent.append(m[0]);
      }
      last = m.index + m[0].length;
    }
    if (last < text.length) parent.append(text.slice(last));
  }

  function render(container, source) {
    container.replaceChildren();
    const lines = source.split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(/^\s*```(.*)$/);
      if (fence) {
        const body = [];
        i++;
        while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) body.push(lines[i++]);
        i++;
        const pre = document.createElement("pre");
        const code = document.createElement("code");
        code.textContent = body.join("\n");
        pre.append(code);
        container.append(pre);
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      if (heading) {
        const h = document.createElement("h" + Math.min(6, heading[1].length + 2));
        inline(h, heading[2]);
        container.append(h);
        i++;
        continue;
      }
      const item = /^\s*(?:[-*+]|\d+[.)])\s+/;
      if (item.test(line)) {
        const ordered = /^\s*\d/.test(line);
        const list = document.createElement(ordered ? "ol" : "ul");
        while (i < lines.length && item.test(lines[i])) {
          const li = document.createElement("li");
          inline(li, lines[i].replace(item, ""));
          list.append(li);
          i++;
        }
        container.append(list);
        continue;
      }
      if (line.trim() === "") { i++; continue; }
      const para = [];
      while (i < lines.length && lines[i].trim() !== "" && !/^\s*```/.test(lines[i]) && !/^#{1,6}\s/.test(lines[i])
             && !item.test(lines[i])) {
        para.push(lines[i++]);
      }
      const p = document.createElement("p");
      inline(p, para.join("\n"));
      container.append(p);
    }
  }

  return { render };
})();
