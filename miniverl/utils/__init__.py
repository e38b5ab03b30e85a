"""Tools with no knowledge of the algorithm: checkpoints, the run folder, the dataset reader, device
and determinism, hashing, the out-of-memory downshift, signals, errors, measuring, table text."""
