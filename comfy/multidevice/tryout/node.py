"""The try-out node: the custom_nodes/ folder that switches upstream's H3 loaders to the tiny configs.

It registers no node. Importing it (ComfyUI does at start) runs `shrink.shrink_upstream()` from
its own copy of shrink.py, so it works whichever way the pack is installed and whatever order
ComfyUI loads custom_nodes/ in, and logs one warning line that says it is a try-out and how to
remove it. Its folder name says so too.
"""

from __future__ import annotations

from pathlib import Path

from comfy.multidevice.tryout import shrink

FOLDER = "minimax-h3-TRYOUT-tiny-random-weights"
LOG_LINE = "TRY-OUT: tiny random weights, not the model; remove with {}"

INIT_SOURCE = '''"""MiniMax-H3 TRY-OUT: tiny random weights, not the model.

Written by `minimax_h3_parallel.py tryout`, with tiny random-weight files under the released
model names in models/. Importing this folder makes upstream's H3 text-encoder and VAE loaders
build the matching tiny configs (shrink.py). REMOVE_COMMAND removes the try-out (only what it
wrote); ComfyUI logs it at each start.
"""

import logging

from .shrink import shrink_upstream

REMOVE_COMMAND = {remove!r}

shrink_upstream()
logging.getLogger(__name__).warning({line!r})

NODE_CLASS_MAPPINGS = {{}}
'''


def node_files(remove_command: str) -> dict[str, bytes]:
    """File name -> bytes of the node's folder; `remove_command` is the one its log line names."""
    init = INIT_SOURCE.format(remove=remove_command, line=LOG_LINE.format(remove_command))
    return {"__init__.py": init.encode(), "shrink.py": Path(shrink.__file__).read_bytes()}
