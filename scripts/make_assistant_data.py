"""The embedded default's conversations that have an assistant turn, as a folder of one parquet
file: the local dataset `trl sft --dataset_name <folder>` reads (config/command.yaml). TRL's
assistant_only_loss refuses a conversation with no assistant turn; the factory of
examples/sft_trainer.py keeps the same ones."""

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def main(data: Path, folder: Path) -> None:
    table = pq.read_table(data)
    keep = [any(m["role"] == "assistant" for m in row) for row in table["messages"].to_pylist()]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.filter(pa.array(keep)), folder / "train.parquet")


if "snakemake" in globals():
    main(Path(snakemake.input.data), Path(snakemake.output.folder))  # noqa: F821
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("data", type=Path)
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    main(args.data, args.folder)
