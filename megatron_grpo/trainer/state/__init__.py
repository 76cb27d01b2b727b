"""A run's state on disk: checkpoints, what a resume may load and restores, the run folder's rules."""
