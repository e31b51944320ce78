"""Data in: read sources, normalise formats to chat messages, clean, split, tokenise."""
