"""Deterministic trainer scripts for the lossless-resume tests (run as ``python -m``)."""
