"""A small H3 DiT written here with upstream's contract, for tests and the dry run."""
