// Model text as DOM nodes: fenced code blocks, headings, lists, quotes, rules, paragraphs, and inline
// code, bold and italic. Model output is untrusted, so every piece of its text becomes a text node
// (append of a string, textContent): markup in a reply shows as the characters it is made of.

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^\s*(#{1,6})\s+(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
// `code`, **bold** or __bold__, *italic* or _italic_ (not the underscores inside snake_case words)
const INLINE = /(`+)([^`][\s\S]*?)\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|\*(?=[^\s*])([\s\S]*?[^\s*])\*|(?<![\p{L}\p{N}])_(?=[^\s_])([\s\S]*?[^\s_])_(?![\p{L}\p{N}])/u;

// A new element with a class and a text, set as text.
export function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || BULLET.test(line) ||
    NUMBERED.test(line) || QUOTE.test(line);
}

export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (!line.trim()) {
      i++;
    } else if ((match = FENCE.exec(line))) {
      const fence = match[1];
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence); i++) body.push(lines[i]);
      i++; // the closing fence; a block still streaming runs to the end of the text
      fragment.append(codeBlock(body.join("\n"), match[2]));
    } else if ((match = HEADING.exec(line))) {
      // a reply's # is a section of the reply, not of the page: h3 and smaller
      const heading = element(`h${Math.min(match[1].length + 2, 6)}`);
      inline(match[2], heading);
      fragment.append(heading);
      i++;
    } else if (RULE.test(line)) {
      fragment.append(element("hr"));
      i++;
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      const numbered = NUMBERED.exec(line);
      const list = element(numbered ? "ol" : "ul");
      if (numbered) list.start = Number(numbered[1]);
      const pattern = numbered ? NUMBERED : BULLET;
      for (; i < lines.length && (match = pattern.exec(lines[i])); i++) {
        const item = element("li");
        inline(match[match.length - 1], item);
        list.append(item);
      }
      fragment.append(list);
    } else if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && (match = QUOTE.exec(lines[i])); i++) quoted.push(match[1]);
      const quote = element("blockquote");
      quote.append(renderMarkdown(quoted.join("\n")));
      fragment.append(quote);
    } else {
      const paragraph = [line];
      for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) paragraph.push(lines[i]);
      const node = element("p");
      inline(paragraph.join("\n"), node);
      fragment.append(node);
    }
  }
  return fragment;
}

function inline(text, parent) {
  while (text) {
    const match = INLINE.exec(text);
    if (!match) {
      parent.append(text);
      return;
    }
    parent.append(text.slice(0, match.index));
    if (match[1]) {
      parent.append(element("code", null, match[2]));
    } else {
      const strong = match[3] ?? match[4];
      const node = element(strong !== undefined ? "strong" : "em");
      inline(strong ?? match[5] ?? match[6], node);
      parent.append(node);
    }
    text = text.slice(match.index + match[0].length);
  }
}

function codeBlock(code, language) {
  const block = element("div", "code-block");
  const bar = element("div", "code-bar");
  bar.append(element("span", "code-language", language || "code"));
  const copy = element("button", "copy-code", "Copy");
  copy.type = "button";
  copy.setAttribute("aria-label", "Copy the code");
  bar.append(copy);
  const pre = element("pre");
  pre.append(element("code", null, code));
  block.append(bar, pre);
  return block;
}

// Copies text: the Clipboard API where the page is a secure context (localhost, HTTPS), otherwise a
// selected textarea and execCommand, which browsers still honour on plain HTTP (a server on a LAN).
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = element("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.className = "offscreen";
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}
