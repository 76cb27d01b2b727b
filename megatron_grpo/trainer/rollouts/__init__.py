"""Rank 0's rollouts: generate, score, group advantages (phase.py); ahead of training with bounded staleness
(pipeline.py)."""
