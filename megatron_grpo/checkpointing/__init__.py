"""Training checkpoints on disk, shared by the trainer (which writes and restores them) and convert/
(which exports them): the folder layout and its rank-local checks (layout.py), and megatron
dist_checkpointing's view of model chunks (sharded.py)."""
