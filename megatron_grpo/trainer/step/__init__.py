"""One update and the forward-only log-prob passes through megatron's schedule; the one definition of useful FLOPs."""
