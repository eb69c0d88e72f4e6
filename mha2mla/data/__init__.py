"""Bundled data (calibration sample, offline eval task items) and reading token slices of text files."""
