"""Test-only custom node of the e2e suite, assembled into the test server's custom_nodes/ only
(this file plus tests/e2e/shrink.py beside it). It adds no node: importing it makes upstream's
fixed-size H3 loaders build the suite's tiny configs (shrink.py says which and why). Never
shipped, never installed by the installer.
"""

from .shrink import shrink_upstream

shrink_upstream()

NODE_CLASS_MAPPINGS: dict = {}
