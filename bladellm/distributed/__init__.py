"""Process groups for tensor and pipeline parallelism (``parallel_state``)."""
