"""Every coordinator backend declares the `Backend` protocol's capabilities; none is probed."""

import pytest

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.comm.protocol import Backend

CAPABILITIES = ("reads_peer_memory", "has_all_to_all_v", "prepares_all_to_all_v", "one_collective_per_device")


@pytest.mark.parametrize("name", ["peer", "hccl", "nccl"])
def test_each_backend_declares_its_capabilities(name, monkeypatch, fake_hccl_path, fake_nccl_path):
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_path)
    with SequenceParallelCoordinator(["cpu"] * 2, backend=name) as coord:
        backend = coord.backend
        assert backend.name == name
        assert isinstance(backend, Backend)
        assert {c: type(getattr(backend, c)) for c in CAPABILITIES} == {c: bool for c in CAPABILITIES}
        assert backend.reads_peer_memory == (name == "peer")  # the libraries move the bytes themselves
        assert backend.one_collective_per_device == (name != "peer")  # CANN's and NCCL's rule


def test_a_backend_without_all_to_all_gets_the_emulation(monkeypatch, fake_hccl_no_alltoallv_path):
    import torch
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_no_alltoallv_path)
    with SequenceParallelCoordinator(["cpu"] * 2, backend="hccl") as coord:
        assert coord.backend.has_all_to_all_v is False
        x = [torch.arange(4.0).view(4, 1) + 10 * r for r in range(2)]
        out = coord.run(lambda rank, comm: comm.all_to_all_v(x[rank], [2, 2], 0))
    assert [o.flatten().tolist() for o in out] == [[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]]
