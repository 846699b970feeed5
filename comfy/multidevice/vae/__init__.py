"""Multi-device video VAE decode: H3's temporal chunks decoded on all cards, merged on one."""
