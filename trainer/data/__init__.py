"""The data side: hh-rlhf rows (sources, validation, prompt-disjoint splits), tokenization, batches."""
