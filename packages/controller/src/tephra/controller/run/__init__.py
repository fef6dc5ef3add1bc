"""Services of every run: checkpoints, trackers, evaluation, FLOPs/MFU, model paths."""
