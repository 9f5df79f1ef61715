"""Materialise the embedded default data: chitchat conversations as OpenAI-style messages."""

import argparse
from pathlib import Path

from probes.assets import convert_chitchat, load_chitchat
from probes.io import run_metadata, write_json, write_parquet
from probes.logs import setup_logging


def main(data_path: Path, counts_path: Path, log_path: str | None = None) -> None:
    log = setup_logging(log_path, "default_data")
    frame, counts = convert_chitchat(load_chitchat())
    write_parquet(frame, data_path, run_metadata({"asset": "chitchat"}))
    write_json(counts, counts_path)
    log.info("chitchat: %s; %d sources", counts, frame["source"].nunique())


if "snakemake" in globals():
    main(
        Path(snakemake.output.data),  # noqa: F821
        Path(snakemake.output.counts),  # noqa: F821
        snakemake.log[0],  # noqa: F821
    )
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("resources/data/chitchat.parquet"))
    args = parser.parse_args()
    main(args.out, args.out.with_suffix(".counts.json"))
