"""Bundled and fetched data: the default model, held-out texts, calibration samples."""
