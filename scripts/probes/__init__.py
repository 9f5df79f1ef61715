"""Shared logic of the training-throughput probes.

Entry scripts under ``scripts/`` stay thin: they read inputs, call functions from here and write
outputs. Everything here is importable and testable without Snakemake.
"""
