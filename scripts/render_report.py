"""Render results/report/playbook-evidence.md and its figures from every stage's outputs.

Run by `snakemake report`, or standalone:
    python scripts/render_report.py --results results --out results/report/playbook-evidence.md
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from probes.io import run_metadata, write_text  # noqa: E402
from probes.logs import setup_logging  # noqa: E402
from probes.report import (  # noqa: E402
    ReportInputError,
    build_context,
    default_input_paths,
    linked_figures,
    load_inputs,
    render_markdown,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEMPLATE = REPO / "workflow" / "templates" / "playbook-evidence.md.j2"
REPORT_DEFAULTS = {"histogram_top_sources": 8, "max_recommendations": 4, "figure_dpi": 110}


def render_report(
    paths: Mapping[str, str | Path],
    template: str | Path,
    markdown_out: str | Path,
    figures_out: str | Path,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load, draw, render; write the figures directory and the markdown only if all succeeded."""
    from probes import figures as figs  # matplotlib is imported here, inside the timed render

    config = dict(config or {})
    options = {**REPORT_DEFAULTS, **(config.get("report") or {})}
    markdown_out, figures_out = Path(markdown_out), Path(figures_out)
    inputs = load_inputs(paths)
    figures_out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{figures_out.name}.", dir=figures_out.parent))
    # mkdtemp creates 0700; the figures directory should be as readable as any the user makes
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        drawn = figs.draw_all(
            inputs, staging, options["histogram_top_sources"], options["figure_dpi"]
        )
        # links are relative to the markdown, so the report reads the same wherever it is copied
        prefix = Path(os.path.relpath(figures_out, markdown_out.parent))
        links = {name: (prefix / f).as_posix() if f else None for name, f in drawn.items()}
        context = build_context(
            inputs,
            links,
            run_metadata(config),
            top_sources=options["histogram_top_sources"],
            max_recommendations=options["max_recommendations"],
        )
        markdown = render_markdown(context, template)
        for link in linked_figures(markdown):
            if not (staging / Path(link).relative_to(prefix)).is_file():
                raise ReportInputError(f"the report links {link} but no such figure was drawn")
        if figures_out.exists():
            shutil.rmtree(figures_out)
        os.replace(staging, figures_out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    write_text(markdown, markdown_out)
    return {"figures": drawn, "not_run": inputs["not_run"], "n_chars": len(markdown)}


def main(paths, template, markdown_out, figures_out, config, log_path=None) -> int:
    log = setup_logging(log_path, "report")
    start = time.perf_counter()
    try:
        result = render_report(paths, template, markdown_out, figures_out, config)
    except ReportInputError as err:
        log.error("%s", err)
        return 2
    elapsed = time.perf_counter() - start
    log.info(
        "rendered %s (%d chars) and %d figures in %.2f s; stages not run: %s",
        markdown_out,
        result["n_chars"],
        sum(1 for f in result["figures"].values() if f),
        elapsed,
        sorted(result["not_run"]) or "none",
    )
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--results", default="results", help="results directory of the workflow")
    parser.add_argument("--template", default=str(DEFAULT_TEMPLATE), help="jinja2 template")
    parser.add_argument("--out", default=None, help="markdown (default <results>/report/...)")
    parser.add_argument("--figures", default=None, help="figures directory (default beside --out)")
    parser.add_argument("--configfile", default=None, help="workflow config, for the provenance")
    parser.add_argument("--log", default=None, help="log file")
    return parser.parse_args(argv)


if "snakemake" in globals():
    smk = globals()["snakemake"]
    inputs = {k: v for k, v in smk.input.items() if k != "template"}
    sys.exit(
        main(
            inputs,
            smk.input.template,
            smk.output.markdown,
            smk.output.figures,
            {**smk.config, "report": dict(smk.params.report)},
            smk.log[0] if smk.log else None,
        )
    )
elif __name__ == "__main__":
    args = parse_args()
    out = Path(args.out or Path(args.results) / "report" / "playbook-evidence.md")
    config: dict[str, Any] = {}
    if args.configfile:
        import yaml

        config = yaml.safe_load(Path(args.configfile).read_text()) or {}
    sys.exit(
        main(
            default_input_paths(args.results),
            args.template,
            out,
            Path(args.figures or out.parent / "figures"),
            config,
            args.log,
        )
    )
