"""The peer-copy backend (comm/peer.py): the backend-independent exactness cases of
tests/collective_cases.py, run on peer-copy as tests/comm/test_hccl.py and test_nccl.py run
them on the ctypes backends.
"""

import pytest

from tests.collective_cases import *  # noqa: F401,F403  (the backend-independent cases)


@pytest.fixture
def backend():
    return "peer"
