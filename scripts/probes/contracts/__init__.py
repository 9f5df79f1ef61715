"""The contract between stages: every output file, table column, status and strategy name.

One home per fact. Rules (`workflow/rules/common.smk`), entry scripts, the report and the tests
import these names instead of retyping them; adding a column or an output file is one edit in
this package plus the code that writes it.

Split by kind: ``names`` (example statuses, strategy names), ``files`` (each stage's output files
and inputs), ``tables`` (each table's columns, the reader's check), ``jsons`` (each JSON file's
keys). Every name is importable from ``probes.contracts`` itself.
"""

from __future__ import annotations

from probes.contracts.files import (
    DATA_FILES,
    MODEL_CONFIG,
    MODEL_TOKENIZER,
    OPTIONAL_STAGES,
    RESULTS_DIR,
    STAGE_INPUTS,
    STAGE_OUTPUTS,
    STAGES,
    TOKENIZER_FILES,
    optional_report_inputs,
    report_inputs,
    stage_enabled,
    stage_outputs,
)
from probes.contracts.jsons import CONTROL_KEYS, JSONS
from probes.contracts.names import (
    BATCH_REBALANCE,
    DATASET_ORDER,
    EMPTY,
    ERROR,
    GLOBAL_SORT,
    GROUP_BY_LENGTH_BUILTIN,
    LENGTH_GROUPED,
    OK,
    PACKING,
    PAD_TO_MAX_SEQ_LEN,
    RANDOM,
    RANDOM_NO_IDLE,
    SKIPPED_STATUSES,
    SORTED,
    STATUSES,
    STRATEGY_ORDER,
    TRAINER_DATASET_FILE,
    TRAINING_STATUSES,
    TRUNCATED,
    UNKNOWN_SOURCE,
)
from probes.contracts.tables import (
    LENGTH_COLUMNS,
    TABLES,
    ContractError,
    TableSpec,
    check_table_columns,
    table_columns,
)
from probes.errors import ProbeError

__all__ = [
    "BATCH_REBALANCE",
    "CONTROL_KEYS",
    "ContractError",
    "DATASET_ORDER",
    "DATA_FILES",
    "EMPTY",
    "ERROR",
    "GLOBAL_SORT",
    "GROUP_BY_LENGTH_BUILTIN",
    "JSONS",
    "LENGTH_COLUMNS",
    "LENGTH_GROUPED",
    "MODEL_CONFIG",
    "MODEL_TOKENIZER",
    "OK",
    "OPTIONAL_STAGES",
    "PACKING",
    "PAD_TO_MAX_SEQ_LEN",
    "ProbeError",
    "RANDOM",
    "RANDOM_NO_IDLE",
    "RESULTS_DIR",
    "SKIPPED_STATUSES",
    "SORTED",
    "STAGES",
    "STAGE_INPUTS",
    "STAGE_OUTPUTS",
    "STATUSES",
    "STRATEGY_ORDER",
    "TABLES",
    "TOKENIZER_FILES",
    "TRAINER_DATASET_FILE",
    "TRAINING_STATUSES",
    "TRUNCATED",
    "TableSpec",
    "UNKNOWN_SOURCE",
    "check_table_columns",
    "optional_report_inputs",
    "report_inputs",
    "stage_enabled",
    "stage_outputs",
    "table_columns",
]
