"""Helpers for tests of trainers built on the controller."""

SMOKE_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) % 5) / 4.0
"""
"""A custom reward with variance on a random tiny model: rule scorers would give all zeros,
and zero advantages would make "resume is exact" or "two layouts agree" trivially true."""
