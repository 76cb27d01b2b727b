"""Mini-batches -> this data-parallel rank's token-balanced share -> packed (THD) or padded micro-batches.

Two modules, one direction: micro_batches.py plans (which sample indices go to which rank and
micro-batch, from lengths and costs only); batching.py holds the sample and micro-batch types and
turns a planned list of indices into tensors (collate / collate_packed)."""
