"""Weights read from disk once: the safetensors header, read-only views, the shared base, per-card replicas."""
