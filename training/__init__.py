"""The GPT trainer behind training/train.py: options, data, parallelism, checkpoints, metrics."""
