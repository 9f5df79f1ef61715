"""The bucket sweep: length-grouped batching per bucket size, packing, batch_rebalance."""
