"""Realize: real training steps of the baseline and the recommended changes."""
