"""Docs that cannot rot: check what README.md and docs/ show against the tree.

    python tools/docs_check.py           # exit 1, listing each problem, when a doc is stale
    python tools/docs_check.py --write   # regenerate the outputs tables of docs/stages/*.md

Checked, in every page of DOCS:
- every command shown (fenced shell blocks, and inline code starting with make / python /
  snakemake / bash): Makefile targets exist; scripts exist; a stage script's flags are flags of
  its parser (built in-process, without the stage's imports); other scripts' flags are in their
  source; snakemake targets are rules or paths, its --configfile / --profile exist;
- every relative link resolves, a #anchor to a heading of its page;
- every config key named (`section.key`, `--set section.key=...`) is in the schema;
- the outputs tables of docs/stages/*.md equal what probes.contracts says each stage writes.
tests/unit/test_docs.py runs these checks.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "scripts"))

import config_docs  # noqa: E402

STAGES_DIR = REPO / "docs" / "stages"
SHELL_LANGS = {"bash", "sh", "shell", "console"}
COMMAND_WORDS = ("make", "python", "python3", "snakemake", "bash", "pytest")
FILE_SUFFIXES = (".parquet", ".json", ".md", ".py", ".txt", ".png", ".yaml", ".yml", ".smk")
FILE_SUFFIXES += (".jsonl", ".sh", ".j2", ".html", ".tsv", ".jinja", ".log", ".toml")
# a dotted name in inline code, not a call (`trainer.train()`)
KEY_TOKEN = r"(?:^|[\s'\"{(])([a-z_]+(?:\.[a-z_0-9*\[\]]+)+)(?![\w(])"
# names the docs use for the user's own files (my.yaml, my_package.train)
PLACEHOLDER = re.compile(r"^(my|your)[._-]")
BEGIN = "<!-- generated outputs: python tools/docs_check.py --write -->"
END = "<!-- end generated outputs -->"
# snakemake options that take one value, and those that take any number (until the next option)
SMK_ONE = {"--cores", "-c", "--jobs", "-j", "--profile", "--configfile", "--report", "--forcerun"}
SMK_ONE |= {"--allowed-rules", "--slurm-status-command", "--directory", "-d", "--snakefile"}
SMK_ONE |= {"--slurm-init-seconds-before-status-checks", "--software-deployment-method"}
SMK_MANY = {"--config", "--resources", "--set-resources", "--set-threads", "-R"}


def docs() -> list[Path]:
    """The pages checked: the README, config/README.md, docs/*.md, docs/stages/*.md and the
    evidence index (the evidence folders themselves are records, kept as they came back)."""
    pages = [REPO / "README.md", REPO / "config" / "README.md", REPO / "docs/evidence/README.md"]
    return pages + sorted((REPO / "docs").glob("*.md")) + sorted(STAGES_DIR.glob("*.md"))


# ---------------------------------------------------------------------------------------------
# What the tree offers
# ---------------------------------------------------------------------------------------------


@cache
def make_targets() -> frozenset[str]:
    text = (REPO / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)) - {".PHONY"}


@cache
def rules() -> frozenset[str]:
    names = set()
    for path in [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]:
        names |= set(re.findall(r"^rule\s+(\w+)\s*:", path.read_text(), re.M))
    return frozenset(names)


@cache
def schema_keys() -> frozenset[str]:
    return frozenset(config_docs.keys())


@cache
def stage_flags(stage: str) -> frozenset[str]:
    """The flags of a stage script's parser (probes.stage), built without the stage's imports."""
    from probes.stage import _parse_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        _parse_cli(stage, "", ["--help"], {})
    return frozenset(re.findall(r"(--[a-z][a-z-]*)", out.getvalue())) | {"--help"}


def script_flags(path: Path) -> frozenset[str] | None:
    """A stage script's parser flags; None for other scripts (their flags are read from source)."""
    from probes.contracts import STAGE_OUTPUTS

    match = re.search(r'^main\(\s*"(\w+)"', path.read_text(), re.M)
    if match and match.group(1) in STAGE_OUTPUTS:
        return stage_flags(match.group(1))
    return None


# ---------------------------------------------------------------------------------------------
# What a page shows
# ---------------------------------------------------------------------------------------------


def commands(text: str) -> Iterator[str]:
    """Each command line of the fenced shell blocks, and inline code that is a command."""
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if lang in SHELL_LANGS:
            yield from _lines(body)
    for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", _without_fences(text)):
        if span.split(" ", 1)[0] in COMMAND_WORDS and " " in span:
            yield span


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _lines(body: str) -> Iterator[str]:
    for line in body.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        for part in re.split(r"&&|\|\||;|\|", line):
            if part.strip():
                yield part.strip()


def links(text: str) -> list[str]:
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _without_fences(text))


def named_keys(text: str) -> Iterator[str]:
    """Config keys named in inline code: `section.key`, `section.key=...`, `--set section.key=`."""
    sections = {key for key in schema_keys() if "." not in key}
    for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", _without_fences(text)):
        for token in re.findall(KEY_TOKEN, " " + span):
            if token.split(".")[0] in sections and not token.endswith(FILE_SUFFIXES):
                yield token


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+\s+(.*)$", _without_fences(path.read_text()), re.M)}


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def check_key(key: str) -> str | None:
    key = re.sub(r"\[\d*\]", "", key).rstrip(".")
    if key.endswith(".*"):
        return None if key[:-2] in schema_keys() else f"unknown config section {key!r}"
    return None if key in schema_keys() else f"unknown config key {key!r}"


def check_command(command: str) -> list[str]:
    try:
        words = shlex.split(command)
    except ValueError as error:
        return [f"{command!r}: does not parse ({error})"]
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    if not words:
        return []
    head, args = words[0], words[1:]
    if head == "make":
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        return [
            f"{command!r}: no Makefile target {t!r}" for t in targets if t not in make_targets()
        ]
    if head in ("python", "python3"):
        return _check_python(command, args)
    if head == "snakemake":
        return _check_snakemake(command, args)
    if head in ("bash", "pytest") or "/" in head:
        paths = [head] if "/" in head else [a for a in args if not a.startswith("-")][:1]
        return [
            f"{command!r}: no file {p!r}" for p in paths if not (REPO / p.split("::")[0]).exists()
        ]
    return []


def _check_python(command: str, args: list[str]) -> list[str]:
    if not args or args[0] in ("-m", "-c", "-X"):
        return []
    script = REPO / args[0]
    if not script.is_file():
        return [f"{command!r}: no script {args[0]!r}"]
    problems = []
    flags = [a.split("=", 1)[0] for a in args[1:] if a.startswith("--")]
    known = script_flags(script)
    source = script.read_text()
    for flag in flags:
        if (flag not in known) if known is not None else (f'"{flag}"' not in source):
            problems.append(f"{command!r}: {args[0]} has no flag {flag}")
    for i, arg in enumerate(args[:-1]):
        if arg == "--set":
            problems += [f"{command!r}: {p}" for p in [check_key(args[i + 1].split("=")[0])] if p]
        path = args[i + 1]
        if arg == "--configfile" and not ((REPO / path).is_file() or PLACEHOLDER.match(path)):
            problems.append(f"{command!r}: no config file {args[i + 1]!r}")
    return problems


def _check_snakemake(command: str, args: list[str]) -> list[str]:
    problems, targets, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            targets += args[i + 1 :]
            break
        if arg.split("=")[0] in SMK_ONE:
            name, _, value = arg.partition("=")
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            exists = (REPO / value).exists() or PLACEHOLDER.match(value)
            if name in ("--profile", "--configfile") and not exists:
                problems.append(f"{command!r}: no such {name[2:]} {value!r}")
            i += 1 if "=" in arg else 2
            continue
        if arg in SMK_MANY:
            i += 1
            while i < len(args) and not args[i].startswith("-"):
                if arg == "--config" and "=" in args[i]:
                    top = args[i].split("=")[0]
                    if top not in schema_keys():
                        problems.append(f"{command!r}: unknown config key {top!r}")
                i += 1
            continue
        if not arg.startswith("-"):
            targets.append(arg)
        i += 1
    for target in targets:
        if "/" not in target and target not in rules():
            problems.append(f"{command!r}: no rule {target!r}")
    return problems


def check_link(page: Path, link: str) -> str | None:
    if re.match(r"^[a-z]+:", link):
        return None
    target, _, anchor = link.partition("#")
    path = (page.parent / target).resolve() if target else page
    if not path.exists():
        return f"broken link {link!r}"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"link {link!r}: no heading #{anchor} in {path.relative_to(REPO)}"
    return None


def check_page(page: Path, text: str | None = None) -> list[str]:
    text = page.read_text() if text is None else text
    problems = [check_link(page, link) for link in links(text)]
    problems += [check_key(key) for key in named_keys(text)]
    for command in commands(text):
        problems += check_command(command)
    return [f"{page.relative_to(REPO)}: {p}" for p in problems if p]


# ---------------------------------------------------------------------------------------------
# The generated outputs tables of docs/stages/*.md
# ---------------------------------------------------------------------------------------------


def outputs_table(stage: str) -> str:
    """Each output file of `stage` with the columns (tables) or keys (JSON) the contract names."""
    from probes.contracts import RESULTS_DIR, STAGE_OUTPUTS
    from probes.contracts.jsons import JSONS
    from probes.contracts.tables import TABLES

    lines = ["| file | columns or keys (*optional*) |", "|---|---|"]
    for key, path in STAGE_OUTPUTS[stage].items():
        name = f"{stage}_{key}"
        if name in TABLES:
            spec = TABLES[name]
            cells = [*spec.required, *(f"*{c}*" for c in spec.optional)]
        elif name in JSONS:
            cells = list(JSONS[name][1])
        else:
            cells = []
        lines.append(f"| `{RESULTS_DIR}/{path}` | {', '.join(cells) or '—'} |")
    return "\n".join(lines)


def stage_of(page: Path) -> str:
    return page.stem


def with_outputs(text: str, stage: str) -> str:
    block = f"{BEGIN}\n{outputs_table(stage)}\n{END}"
    return re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)


def stale_outputs(pages: Iterable[Path]) -> list[str]:
    return [
        f"{p.relative_to(REPO)}: outputs table stale: run python tools/docs_check.py --write"
        for p in pages
        if BEGIN in p.read_text() and with_outputs(p.read_text(), stage_of(p)) != p.read_text()
    ]


def problems() -> list[str]:
    found = []
    for page in docs():
        found += check_page(page)
    return found + stale_outputs(sorted(STAGES_DIR.glob("*.md")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate the outputs tables")
    args = parser.parse_args(argv)
    if args.write:
        for page in sorted(STAGES_DIR.glob("*.md")):
            text = page.read_text()
            if BEGIN in text:
                page.write_text(with_outputs(text, stage_of(page)))
    found = problems()
    print("\n".join(found) or "docs consistent")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
