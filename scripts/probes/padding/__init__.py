"""The padding stage: tokenized lengths, padding waste, CE chunk sizing."""
