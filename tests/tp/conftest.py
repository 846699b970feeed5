"""Fixtures of the tensor-parallel tests."""

import pytest


@pytest.fixture(params=["peer", "hccl"])
def backend(request, monkeypatch):
    if request.param == "hccl":
        request.getfixturevalue("use_fake_hccl")
    return request.param
