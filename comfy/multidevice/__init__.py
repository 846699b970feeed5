"""MiniMax-H3 multi-device inference for ComfyUI: every module of the overlay lives here.

The package map and the data path of one sampling step are in docs/ARCHITECTURE.md. The
names below are the public entry points; everything else is imported from its sub-package.
"""

from comfy.multidevice.comm.collectives import RankComm
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.comm.settings import VALID_BACKENDS
from comfy.multidevice.comm.errors import (BackendUnavailable, CollectiveAborted, CollectiveError,
                                           CollectiveTimeout)

__all__ = ["SequenceParallelCoordinator", "RankComm", "VALID_BACKENDS", "CollectiveError",
           "CollectiveAborted", "CollectiveTimeout", "BackendUnavailable"]
