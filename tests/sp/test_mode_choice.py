"""The node's sp_mode (comfy/multidevice/sp/mode_choice.py): what each choice runs, the one rule of
`auto` with its reasons, refusals that name the fix, and the measurement doctor --deep keeps."""

from __future__ import annotations

import json

import pytest

from comfy.multidevice.sp.cost_model import attention_traffic
from comfy.multidevice.sp.mode_choice import (bytes_ratio, choose_sp_mode, measurement_for, record_measurement,
                                              SP_MODE_CHOICES, SPModeError)

H3_HEADS = 56


@pytest.mark.parametrize("world, expected", [(2, 1.0), (4, 0.5), (7, 2 / 7), (8, 0.25)])
def test_ulysses_receives_two_over_w_of_the_allgathers_bytes_at_h3s_heads(world, expected):
    assert bytes_ratio(world, H3_HEADS) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("world, mode, degree", [
    (1, "allgather", 1),   # one rank: nothing to exchange
    (2, "allgather", 1),   # a tie in bytes: one collective instead of two
    (3, "allgather", 1),   # 56 heads and 3 ranks share no divisor above one
    (4, "ulysses", 4), (7, "ulysses", 7), (8, "ulysses", 8),
    (6, "ulysses", 2),     # the hybrid: 3 groups of 2
    (12, "ulysses", 4),    # the hybrid: 3 groups of 4
])
def test_auto_follows_the_cost_model(world, mode, degree):
    choice = choose_sp_mode("auto", world, H3_HEADS)
    assert (choice.mode, choice.degree) == (mode, degree), choice.describe()
    if mode == "ulysses":
        # the bytes it states are the cost model's, for the busiest rank
        worst = {m: max(attention_traffic(m, 4096, world, r, H3_HEADS, 128, 2).received for r in range(world))
                 for m in ("allgather", "ulysses")}
        assert f"{worst['ulysses'] / worst['allgather']:.2f} of the all-gather's bytes" in choice.reason
    if (mode, degree) == ("ulysses", world):  # plain Ulysses holds 3/W of the all-gather's buffers
        assert f"holds {3 / world:.2f} of its exchange buffers" in choice.reason


def test_auto_names_the_hybrid_and_other_servers_network():
    choice = choose_sp_mode("auto", 6, H3_HEADS, other_servers=True)
    assert choice.name == "hybrid (3 groups of 2)" and "other servers' network" in choice.reason


@pytest.mark.parametrize("faster", ["ulysses", "allgather"])
def test_a_measurement_of_this_machine_decides_over_the_cost_model(faster):
    measured = {"allgather_s": 0.002 if faster == "allgather" else 0.004,
                "ulysses_s": 0.002 if faster == "ulysses" else 0.004}
    choice = choose_sp_mode("auto", 4, H3_HEADS, measured=measured)
    assert choice.mode == faster and "measured on this machine" in choice.reason
    # a measurement cannot make Ulysses run where no group divides the heads
    assert choose_sp_mode("auto", 3, H3_HEADS, measured=measured).mode == "allgather"


def test_explicit_choices_run_what_they_say():
    assert choose_sp_mode("allgather", 8, H3_HEADS).mode == "allgather"
    ulysses = choose_sp_mode("ulysses", 8, H3_HEADS)
    assert (ulysses.mode, ulysses.degree, ulysses.name) == ("ulysses", 8, "ulysses")
    hybrid = choose_sp_mode("hybrid", 6, H3_HEADS)
    assert (hybrid.mode, hybrid.degree) == ("ulysses", 2)
    assert choose_sp_mode("hybrid", 4, H3_HEADS).name == "ulysses"  # the heads divide: plain Ulysses


@pytest.mark.parametrize("choice, world, heads, words", [
    ("ulysses", 6, H3_HEADS, "56 does not divide by 6: set sp_mode to hybrid (Ulysses in groups of 2), allgather"),
    ("ulysses", 3, H3_HEADS, "56 does not divide by 3: set sp_mode to allgather or auto"),
    ("hybrid", 3, H3_HEADS, "there is none: set sp_mode to allgather or auto"),
    ("ulysses", 4, None, "head count is not readable: set sp_mode to allgather or auto"),
    ("ring", 4, H3_HEADS, "sp_mode='ring' is unknown: set sp_mode to one of auto, allgather, ulysses, hybrid"),
])
def test_what_cannot_run_is_refused_naming_the_fix(choice, world, heads, words):
    with pytest.raises(SPModeError) as refused:
        choose_sp_mode(choice, world, heads)
    assert words in str(refused.value)


def test_every_choice_is_offered():
    assert SP_MODE_CHOICES == ("auto", "allgather", "ulysses", "hybrid")


def test_measurements_are_kept_per_kind_and_w_and_a_bad_file_is_ignored(tmp_path):
    path = tmp_path / "cache" / "exchange_measurements.json"
    assert measurement_for("npu", 4, path) is None  # none kept yet
    record_measurement("npu", 4, 0.003, 0.001, {"measured_by": "doctor --deep"}, path)
    record_measurement("npu", 8, 0.004, 0.002, None, path)
    record_measurement("npu", 4, 0.002, 0.001, None, path)  # replaces the first
    assert measurement_for("npu", 4, path)["allgather_s"] == 0.002
    assert measurement_for("npu", 8, path)["ulysses_s"] == 0.002
    assert measurement_for("cuda", 4, path) is None
    assert not list(path.parent.glob("*.tmp"))  # written whole, then renamed
    path.write_text("{not json")
    assert measurement_for("npu", 4, path) is None
    path.write_text(json.dumps({"npu:4": {"allgather_s": "fast", "ulysses_s": 0.1}}))
    assert measurement_for("npu", 4, path) is None
    record_measurement("npu", 2, 0.1, 0.2, None, path)  # over an unreadable entry: the file is rewritten
    assert measurement_for("npu", 2, path)["ulysses_s"] == 0.2


def test_a_measurement_of_another_backend_does_not_count_when_the_node_names_one(tmp_path):
    path = tmp_path / "exchange_measurements.json"
    record_measurement("npu", 4, 0.001, 0.003, {"backend": "peer"}, path)
    assert measurement_for("npu", 4, path, backend="hccl") is None  # the node runs HCCL: not this timing
    assert measurement_for("npu", 4, path, backend="peer")["backend"] == "peer"
    assert measurement_for("npu", 4, path)["allgather_s"] == 0.001  # default/auto: any backend's


def test_an_uneven_split_runs_the_allgather_and_refuses_ulysses_naming_the_fix():
    from comfy.multidevice.sp.mode_choice import choose_sp_mode, SPModeError
    choice = choose_sp_mode("auto", 4, 56, uneven_rows=True)
    assert (choice.mode, choice.degree) == ("allgather", 1) and "split gives the cards different rows" in choice.reason
    assert choose_sp_mode("allgather", 4, 56, uneven_rows=True).reason == "asked"
    for mode in ("ulysses", "hybrid"):
        with pytest.raises(SPModeError, match=f"sp_mode={mode} splits the attention heads evenly .* set sp_mode to "
                                              "allgather or auto, or split to even"):
            choose_sp_mode(mode, 4, 56, uneven_rows=True)
    assert choose_sp_mode("ulysses", 1, 56, uneven_rows=True).mode == "allgather"  # one rank: nothing to split
