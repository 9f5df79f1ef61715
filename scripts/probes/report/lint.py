"""The rendered report checked as markdown a person reads.

``problems(markdown)`` lists, with line numbers:

- two statements run together: a sentence's end glued to the next one ("best.**Not confirmed:**",
  "best.Not", "stated.."), outside code, or a labelled statement ("**Tie:** ...") on the line right
  after prose, which markdown joins into the same paragraph;
- an empty table cell where a value is expected (or "None"/"nan" rendered as a value), and a row
  whose cell count differs from its header's; a sub-row (a "↳" check, a "**total**" row, an
  italic "_N more_" row) may leave cells empty;
- a heading not followed by its finding: the first thing under every heading is a sentence of
  prose (not a table, list, figure, code block or "Source:" line);
- a sentence that lists more than MAX_CHANGES_IN_A_SENTENCE changes: a reader cannot take in a
  run-on list; the first screen's table lists them, one a row. The changes are the titles in
  the "change" column of the report's first table and the "### N. title" headings of Apply it.

``glued_by_block_tags(template)`` checks the template itself, on every branch at once: a line of
text that ends in a block tag loses its newline (the report renders with ``trim_blocks``), so the
next text line reached over tag-only lines is glued onto it, whichever branch a render takes.

The report tests render the fixture reports through it; it imports nothing but ``re``.
"""

from __future__ import annotations

import re

# a sentence end glued to the next statement: "best.**Not", "best.Not", "done;**Tie"
RUN_TOGETHER = re.compile(r"[a-z0-9)\]`][.!?;:](\*\*|__)?[A-Z][a-z]")
# "..": a sentence whose text already ended with a full stop (not "38..4096", not "...")
DOUBLE_STOP = re.compile(r"[a-z)\]]\.\.(?=\s|$)")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
EMPTY_VALUES = {"", "None", "nan", "NaN"}  # "none" is a value some tables state (no band)
SUB_ROW = re.compile(r"↳|\*\*total\*\*|^\s*_.*_\s*$")
NOT_A_FINDING = ("|", "-", "*", "!", "```", "#", "Source:", "{", ">")


def _cells(line: str) -> list[str]:
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") else body
    # an escaped pipe (\|) stays inside its cell
    return [c.strip() for c in re.split(r"(?<!\\)\|", body)]


def run_together(lines: list[str]) -> list[str]:
    out, fenced = [], False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        prose = LINK_TARGET.sub("]", CODE_SPAN.sub("``", line))
        for match in DOUBLE_STOP.finditer(prose):
            context = prose[max(0, match.start() - 30) : match.end()]
            out.append(f"line {number}: a sentence ends twice: ...{context}")
        for match in RUN_TOGETHER.finditer(prose):
            words = prose[: match.start() + 1].split()
            token = words[-1] if words else ""
            if "." in token.rstrip(".") or "_" in token:
                continue  # a dotted name (probes.sampler.LengthGroupedSampler), not two sentences
            context = prose[max(0, match.start() - 20) : match.end() + 10]
            out.append(f"line {number}: two statements run together: ...{context}...")
    return out


# a statement of its own ("**Tie:** ...", "**CPU-only replay** ...") starts a line
LABELLED = re.compile(r"^\*\*[^*]+\*\*")


def glued_paragraphs(lines: list[str]) -> list[str]:
    """A labelled statement on the line right after prose: markdown joins the two lines into one
    paragraph, so on the rendered page they run together."""
    out, fenced = [], False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or number == 1 or not LABELLED.match(line):
            continue
        before = lines[number - 2]
        if before.strip() and not before.startswith(("|", "-", "#", "!", "```", "  ")):
            out.append(f"line {number}: {line[:40]!r} runs on from the line before it")
    return out


def table_cells(lines: list[str]) -> list[str]:
    out, header, fenced = [], None, False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = cells
            continue
        if all(re.fullmatch(r":?-+:?", c) for c in cells):
            continue
        if len(cells) != len(header):
            out.append(f"line {number}: {len(cells)} cells under a {len(header)}-column header")
            continue
        if any(SUB_ROW.search(c) for c in cells):
            continue
        for name, value in zip(header, cells, strict=True):
            if name and value in EMPTY_VALUES:
                out.append(f"line {number}: empty cell under {name!r}: {line[:80]}")
    return out


def headings_without_finding(lines: list[str]) -> list[str]:
    out = []
    for number, line in enumerate(lines, 1):
        if not re.match(r"#{2,6} ", line):
            continue
        following = next((x for x in lines[number:] if x.strip()), "")
        paragraph = []
        for x in lines[number:]:
            if not x.strip() and paragraph:
                break
            if x.strip():
                paragraph.append(x.strip())
        first = following.strip()
        if not first or first.startswith(NOT_A_FINDING) and not first.startswith("**"):
            out.append(f"line {number}: heading {line!r} opens with {first[:40]!r}, not a finding")
        elif not re.search(r"[.!?:]\**($|\s)", " ".join(paragraph)):
            out.append(f"line {number}: heading {line!r} opens with no full sentence")
    return out


BLOCK_TAG_LINE = re.compile(r"^\s*\{[%#].*[%#]\}\s*$")


def glued_by_block_tags(template: str) -> list[str]:
    """Text lines ending in a block tag whose next text line (over tag-only lines) would be glued
    onto them; end such a line with text or put a blank line before the next statement."""
    lines, out = template.split("\n"), []
    for number, line in enumerate(lines, 1):
        if not line.rstrip().endswith("%}") or BLOCK_TAG_LINE.match(line):
            continue
        after = number  # index of the line after this one
        while after < len(lines) and BLOCK_TAG_LINE.match(lines[after]):
            after += 1
        if after < len(lines) and lines[after].strip():
            glued = lines[after][:40]
            out.append(f"line {number}: its end is glued to line {after + 1} ({glued!r})")
    return out


MAX_CHANGES_IN_A_SENTENCE = 3
# a sentence ends at . ! or ? before a space and a capital (or a bold label), or at the line's end
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\**[A-Z])")
APPLY_HEADING = re.compile(r"^###\s+\d+\.\s+(.+?)\s*$")


def change_titles(lines: list[str]) -> set[str]:
    """The changes a report names: the "change" column of its first table with that column (the
    first screen's) and the numbered "### N. title" headings (Apply it)."""
    titles = {heading[1] for heading in map(APPLY_HEADING.match, lines) if heading}
    for number, line in enumerate(lines):
        if not line.startswith("|") or (number and lines[number - 1].startswith("|")):
            continue  # not a table's header row
        header = _cells(line)
        if "change" not in header:
            continue
        column = header.index("change")
        for row in lines[number + 2 :]:
            if not row.startswith("|"):
                break
            cells = _cells(row)
            if len(cells) == len(header):
                titles.add(cells[column].strip("*").replace("\\|", "|"))
        break  # the first screen's table names every change
    return {title for title in titles if title}


def crowded_sentences(lines: list[str]) -> list[str]:
    """Sentences outside tables, headings and code that name more than
    MAX_CHANGES_IN_A_SENTENCE distinct changes (a title inside a longer one counts once)."""
    titles = sorted(change_titles(lines), key=len, reverse=True)
    out, fenced = [], False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not titles or line.startswith(("|", "#", "```")):
            continue
        for sentence in SENTENCE_END.split(line):
            named, rest = [], sentence
            for title in titles:
                if title in rest:
                    named.append(title)
                    rest = rest.replace(title, "\0")
            if len(named) > MAX_CHANGES_IN_A_SENTENCE:
                out.append(
                    f"line {number}: a sentence lists {len(named)} changes (at most "
                    f"{MAX_CHANGES_IN_A_SENTENCE}): put them in a table, one a row"
                )
    return out


def problems(markdown: str) -> list[str]:
    """Everything a reader would trip over, with line numbers; [] for a clean report."""
    lines = markdown.splitlines()
    return (
        run_together(lines)
        + glued_paragraphs(lines)
        + table_cells(lines)
        + headings_without_finding(lines)
        + crowded_sentences(lines)
    )
