"""Adaptive intra-op thread learning (filled by the adaptive-threads issue)."""
