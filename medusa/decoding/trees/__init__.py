"""Candidate trees: static sparse trees (their buffers and every tree spec) and per-row dynamic trees."""
