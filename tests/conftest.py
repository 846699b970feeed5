import os
import sys
import types

import pytest

from tests.fakes.build import build_fake
from tests.fakes.violations import take_all_nccl_violations


@pytest.fixture(autouse=True)
def no_card_rule_broken_on_the_fake_nccl():
    """Fails a test after which a fake libnccl of this process holds a violation: real NCCL
    returns no error for two collectives overlapping on one device (it hangs or corrupts), so
    the fake records it instead (tests/fakes/fake_nccl.c). A test that provokes one on purpose
    takes it (tests/fakes/violations.py). Cheap: only libraries already loaded are read."""
    yield
    broken = take_all_nccl_violations()
    if broken:
        pytest.fail("the fake libnccl recorded what NCCL forbids:\n" + "\n".join(broken), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def cache_in_a_temporary_folder(tmp_path_factory):
    """The per-user cache (the dry run's checkpoints) in a folder of this session, for this
    process and every one it starts: the suite never fills the user's cache or reuses it."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="session")
def fake_hccl_path(tmp_path_factory):
    return build_fake("fake_hccl", out_dir=tmp_path_factory.mktemp("fake_hccl"))


@pytest.fixture(scope="session")
def fake_hccl_no_allgatherv_path(tmp_path_factory):
    return build_fake("fake_hccl", defines=("FAKE_NO_ALLGATHERV",),
                      out_dir=tmp_path_factory.mktemp("fake_hccl_noagv"))


@pytest.fixture
def use_fake_hccl(monkeypatch, fake_hccl_path):
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    return fake_hccl_path


@pytest.fixture(scope="session")
def fake_nccl_path(tmp_path_factory):
    return build_fake("fake_nccl", out_dir=tmp_path_factory.mktemp("fake_nccl"))


@pytest.fixture
def use_fake_nccl(monkeypatch, fake_nccl_path):
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_path)
    return fake_nccl_path


@pytest.fixture(scope="session")
def fake_hccl_no_alltoallv_path(tmp_path_factory):
    return build_fake("fake_hccl", defines=("FAKE_NO_ALLTOALLV",),
                      out_dir=tmp_path_factory.mktemp("fake_hccl_noa2a"))


@pytest.fixture(scope="session")
def fake_nccl_no_sendrecv_path(tmp_path_factory):
    return build_fake("fake_nccl", defines=("FAKE_NO_SENDRECV",),
                      out_dir=tmp_path_factory.mktemp("fake_nccl_nop2p"))


@pytest.fixture(params=["peer", "hccl"])
def backend(request):
    """The backend a test's coordinator uses: peer-copy, then HCCL over the fake library. A module
    that runs other backends defines its own `backend`."""
    if request.param == "hccl":
        request.getfixturevalue("use_fake_hccl")
    return request.param


@pytest.fixture
def fake_patcher_extension(monkeypatch):
    """comfy.patcher_extension as far as the node and the SP wrapper use it, without ComfyUI."""
    module = types.ModuleType("comfy.patcher_extension")
    module.WrappersMP = types.SimpleNamespace(DIFFUSION_MODEL="diffusion_model")
    monkeypatch.setitem(sys.modules, "comfy.patcher_extension", module)
    return module


@pytest.fixture
def close_coordinators():
    """Ends the node's shared rank threads after a test that ran the node."""
    yield
    from comfy.multidevice.roles import apply as roles_apply  # only for the tests that use it
    roles_apply.close_shared_coordinators()
