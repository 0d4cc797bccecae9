"""Memory and time of saving a full checkpoint: Lightning's gather on rank 0 against every rank writing its slices."""
