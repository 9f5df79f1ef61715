"""The replay stage: every strategy's real micro-batches timed through the harness."""
