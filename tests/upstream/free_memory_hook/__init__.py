"""Test-only custom node of tests/upstream/test_node_errors.py, copied into that test server's
custom_nodes/ only: with MINIMAX_H3_TEST_FREE_BYTES set, the memory plan of
MultiNPUParallelConfig reads that many free bytes for every card (CPU ranks included), so a
plan that does not fit can be asked for on a CPU-only server. It adds no node; never shipped.
"""

import os

from comfy.multidevice.roles import memory_plan

_FREE = os.environ.get("MINIMAX_H3_TEST_FREE_BYTES")
if _FREE:
    memory_plan.free_memory_bytes = lambda device, _free=int(_FREE): _free

NODE_CLASS_MAPPINGS: dict = {}
