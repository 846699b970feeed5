"""Small models written here with upstream's contracts (an H3 DiT, a Qwen-style decoder) for tests and the dry run."""
