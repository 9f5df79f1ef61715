"""Bucket sweep: padding saved by length-grouped batching per bucket size (HF
get_length_grouped_indices semantics), the source-diversity cost, and packing for comparison.

Run by Snakemake (`snakemake bucket_sweep`) or standalone:
    python scripts/run_bucket_sweep.py --results results --set bucket.seeds=[0,1]
"""

from probes.bucket import stage as bucket_stage
from probes.stage import main

main("bucket", bucket_stage.run, __doc__, globals())
