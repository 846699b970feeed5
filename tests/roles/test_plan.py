"""The role plan (roles/plan.py): which card runs which component for 1, 2, 4 and 8 cards."""

from __future__ import annotations

import pytest

from comfy.multidevice.cards import UnsupportedCardCount
from comfy.multidevice.roles.plan import plan_roles, RolePlanError, roles_table


def test_plan_roles_for_1_2_4_8_cards():
    assert plan_roles(1).as_dict() == {
        "n_cards": 1,
        "dit": {"cards": [0], "mode": "single"},
        "text_encoder": {"cards": [0], "mode": "single"},
        "video_vae": {"cards": [0], "mode": "single"},
        "audio_vae": {"cards": [0], "mode": "single"},
    }
    assert plan_roles(2).as_dict() == {
        "n_cards": 2,
        "dit": {"cards": [0], "mode": "single"},
        "text_encoder": {"cards": [0], "mode": "single"},
        "video_vae": {"cards": [0], "mode": "single"},
        "audio_vae": {"cards": [1], "mode": "single"},
    }
    assert plan_roles(4).as_dict() == {
        "n_cards": 4,
        "dit": {"cards": [0, 1, 2, 3], "mode": "sequence_parallel"},
        "text_encoder": {"cards": [0, 1, 2, 3], "mode": "tensor_parallel"},
        "video_vae": {"cards": [0, 1, 2, 3], "mode": "temporal_chunks", "merge_card": 0},
        "audio_vae": {"cards": [3], "mode": "single"},
    }
    eight = list(range(8))
    assert plan_roles(8).as_dict() == {
        "n_cards": 8,
        "dit": {"cards": eight, "mode": "sequence_parallel"},
        "text_encoder": {"cards": eight, "mode": "tensor_parallel"},
        "video_vae": {"cards": eight, "mode": "temporal_chunks", "merge_card": 0},
        "audio_vae": {"cards": [7], "mode": "single"},
    }
    assert [row["n_cards"] for row in roles_table()] == [1, 2, 4, 8]


@pytest.mark.parametrize("bad", [0, 3, 5, 6, 16, -4, "4", 4.0, True, None])
def test_unsupported_counts(bad):
    with pytest.raises(UnsupportedCardCount) as info:
        plan_roles(bad)
    assert repr(bad) in str(info.value) and "1, 2, 4, 8" in str(info.value)


def test_other_servers_ranks_make_the_dit_sequence_parallel_at_two_cards():
    from comfy.multidevice.roles.plan import SEQUENCE_PARALLEL, SINGLE
    two = plan_roles(2, remote_ranks=2)
    assert (two.dit.cards, two.dit.mode) == ((0, 1), SEQUENCE_PARALLEL)
    assert two.text_encoder == plan_roles(2).text_encoder and two.audio_vae == plan_roles(2).audio_vae
    assert (plan_roles(1, remote_ranks=2).dit.mode, plan_roles(4, remote_ranks=2)) == (SINGLE, plan_roles(4))


def test_dit_ranks_auto_is_processes_only_with_other_servers_ranks():
    from comfy.multidevice.roles.dit import resolve_dit_ranks
    assert [resolve_dit_ranks(c, 0) for c in ("auto", "threads", "processes")] == ["threads", "threads", "processes"]
    assert [resolve_dit_ranks(c, 2) for c in ("auto", "processes")] == ["processes", "processes"]
    with pytest.raises(RolePlanError, match="COMFYUI_MULTI_DEVICE_REMOTE_RANKS=2 asks for DiT ranks on other "
                                            "servers, which rank threads cannot reach: set dit_ranks to processes"):
        resolve_dit_ranks("threads", 2)
    with pytest.raises(RolePlanError, match="dit_ranks='fibers' is unknown"):
        resolve_dit_ranks("fibers", 0)
