"""The command line behind minimax_h3_parallel.py: the dry run (threads or torchrun) and doctor."""
