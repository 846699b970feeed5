"""Trying the pack without the weights: tiny random-weight files under the released names and a try-out node.

`minimax_h3_parallel.py tryout --comfyui DIR` (cli/tryout.py) writes them into a ComfyUI and
`--remove` takes exactly them away again (record.py); the e2e suite runs its servers on them.
"""
