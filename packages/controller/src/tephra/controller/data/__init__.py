"""Prompt data and the built-in demo datasets and model (to move to tephra.episodes)."""
