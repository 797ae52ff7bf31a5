"""Analyses behind `multihead params` and `multihead demo`: the seeds claims, on numbers."""
