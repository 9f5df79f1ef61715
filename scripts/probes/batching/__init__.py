"""Batching machinery shared by padding, bucket and replay: orders, packing, metrics, plans."""
