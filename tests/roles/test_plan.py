"""The role plan (roles/plan.py): which card runs which component for 1, 2, 4 and 8 cards."""

from __future__ import annotations

import pytest

from comfy.multidevice.cards import UnsupportedCardCount
from comfy.multidevice.roles.plan import plan_roles, roles_table


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
