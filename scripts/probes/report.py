"""The playbook-evidence report: render the template from the context the sections build.

A number in the report is traceable in three hops: the template names a column
(``{{ row.time_s | seconds }}``), the column comes from one table listed in
``probes.contracts.TABLES`` (which stage and file), and the derived numbers come from one function.
The report is split by responsibility:

- ``probes.report_load``: read and check every stage output (``load_inputs``);
- ``probes.report_savings``: the time model, expected savings, the ranked recommendations;
- ``probes.report_sections``: one builder per section and ``build_context``;
- ``probes.report_format``: the template's filters (numbers, codes, labels);
- this module: render the markdown (``render_markdown``) and list the figures it links.

Never surface the data: the report shows only source labels, ids, counts and numbers. No column
outside ``TABLES`` is ever rendered, reason codes are filtered to code-like strings, and source
labels are shortened and escaped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from probes.report_format import FILTERS


def render_markdown(context: Mapping[str, Any], template_path: str | Path) -> str:
    """Render the template; an undefined name fails instead of rendering as empty."""
    import jinja2

    path = Path(template_path)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(path.parent),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,  # markdown, not HTML; cells are escaped by the `cell`/`label` filters
    )
    env.filters.update(FILTERS)
    return env.get_template(path.name).render(**context)


def linked_figures(markdown: str) -> list[str]:
    """Relative paths of every image the markdown links to."""
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", markdown)
