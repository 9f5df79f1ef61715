"""Names every stage shares: example statuses and batching strategies (one name per concept)."""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------
# Example statuses (one row per example in lengths.parquet, none ever dropped)
# ---------------------------------------------------------------------------------------------

OK, TRUNCATED, EMPTY, ERROR = "OK", "TRUNCATED", "EMPTY", "ERROR"
STATUSES = (OK, TRUNCATED, EMPTY, ERROR)
# The examples that train (TRUNCATED ones train on their first max_seq_len tokens).
TRAINING_STATUSES = (OK, TRUNCATED)
# Counted in their own buckets, never folded into a distribution.
SKIPPED_STATUSES = (EMPTY, ERROR)

# The source label of an example whose file gives none.
UNKNOWN_SOURCE = "none"

# ---------------------------------------------------------------------------------------------
# Batching strategies (one name per strategy in every stage, table and figure)
# ---------------------------------------------------------------------------------------------

RANDOM = "random"
LENGTH_GROUPED = "length_grouped"
# transformers' own train_sampling_strategy="group_by_length" (its LengthGroupedSampler at the
# Trainer's default megabatch): the setting recommendations.json emits beside ours
GROUP_BY_LENGTH_BUILTIN = "group_by_length_builtin"
# Every example sorted by length before batching (a bucket as large as the dataset).
GLOBAL_SORT = "global_sort"
PACKING = "packing"
# transformers' own train_sampling_strategy="batch_rebalance" (its BatchRebalanceSampler: variable
# micro-batch size): a comparison row in the sweep, and a plan of its own that the replay prices
BATCH_REBALANCE = "batch_rebalance"
PAD_TO_MAX_SEQ_LEN = "pad_to_max_seq_len"
# random batching without the examples that carry no loss token (the replay's candidates)
RANDOM_NO_IDLE = "random_no_idle"
# the lengths table's `file` for the rows of the user's trainer's own prepared dataset
# (trainer.factory): its collator, checked by the padding stage, pads each row to its own length
TRAINER_DATASET_FILE = "trainer.train_dataset"
# the padding stage's reference orders: the data as given, and one global length sort
DATASET_ORDER = "dataset_order"
SORTED = "sorted"

STRATEGY_ORDER = (RANDOM, LENGTH_GROUPED, GLOBAL_SORT, PACKING, BATCH_REBALANCE)
