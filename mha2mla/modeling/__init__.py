"""Attention and cache helpers for the MLA checkpoints that mha2mla writes."""
