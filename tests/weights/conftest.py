"""Fixtures of the weights tests."""

import pytest

from comfy.multidevice.weights.checkpoint import clear_shared_checkpoints


@pytest.fixture(autouse=True)
def clean_registry():
    clear_shared_checkpoints()
    yield
    clear_shared_checkpoints()
