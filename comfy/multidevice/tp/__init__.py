"""Tensor parallelism for the text encoder: parallel linears, decoder sharding, the ComfyUI CLIP."""
