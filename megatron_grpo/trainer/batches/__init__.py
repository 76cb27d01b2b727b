"""Mini-batches -> this data-parallel rank's token-balanced share -> packed (THD) or padded micro-batches."""
