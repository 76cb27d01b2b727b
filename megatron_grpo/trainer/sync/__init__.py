"""The policy's shards -> HF-named tensors -> the rollout engine, by rank 0 or by sender ranks
(per stage, colocated)."""
