"""Delivery to the learner: dense per-env transition chunks written by workers, read by the driver."""
from torchrl_asyncpool.delivery.chunks import ChunkBuffers, ChunkHandle, ChunkReader, transition_fields

__all__ = ["ChunkBuffers", "ChunkHandle", "ChunkReader", "transition_fields"]
