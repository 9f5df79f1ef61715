"""The mask gate: band structure and SDPA fast path of every layer, from config.json alone."""
