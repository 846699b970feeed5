"""bench/bench_file_identity.py runs end to end on a small file: every figure present, the
identity reads the header and 64 MiB (the cold run from storage), the cached call reads nothing,
and the full hash reads the whole file."""

import pytest

from tests.helpers import bench_json


@pytest.mark.timeout(120)
def test_bench_file_identity_reports_bounded_identity_reads_against_a_full_hash(tmp_path):
    result = bench_json("bench_file_identity.py", "--gib", "0.125", "--dir", str(tmp_path), timeout=110)
    assert result["file_bytes"] == 2**27 == result["full"]["bytes_read"]
    assert 64 << 20 < result["identity"]["bytes_read"] < (64 << 20) + 4096  # the sample + a small header
    assert result["cached"]["bytes_read"] == 0
    assert result["identity_bytes_vs_full"] == round(result["identity"]["bytes_read"] / 2**27, 5)
    for key in ("identity_vs_full_cold", "identity_vs_full_warm", "full_gib_per_s_cold",
                "full_sha256_s_at_19_5_gib"):
        assert result[key] > 0, key
    assert list(tmp_path.iterdir()) == []  # the file was removed
