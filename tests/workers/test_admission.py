"""The pool's secret and proofs (workers/admission.py): a proof is bound to its direction,
purpose, rank and pool, so none can be replayed as another; pool keys and store prefixes
differ per pool; the version a rank announces is the package's."""

from __future__ import annotations

import tomllib
from pathlib import Path

from comfy.multidevice.workers import admission

REPO = Path(__file__).resolve().parents[2]


def test_the_announced_project_version_is_the_packages():
    with open(REPO / "pyproject.toml", "rb") as f:
        assert admission.PROJECT_VERSION == tomllib.load(f)["project"]["version"]


def test_a_proof_verifies_only_for_its_own_direction_purpose_rank_and_pool():
    key = b"k" * 32
    good = admission.proof(key, "rank", "nonce", "live", 1, 3)
    assert admission.proofs_match(good, admission.proof(key, "rank", "nonce", "live", 1, 3))
    for other in (admission.proof(key, "rank0", "nonce", "live", 1, 3),  # rank 0's answer replayed
                  admission.proof(key, "rank", "other", "live", 1, 3),
                  admission.proof(key, "rank", "nonce", "store", 1, 3),
                  admission.proof(key, "rank", "nonce", "live", 2, 3),
                  admission.proof(key, "rank", "nonce", "live", 1, 4),
                  admission.proof(b"x" * 32, "rank", "nonce", "live", 1, 3)):
        assert not admission.proofs_match(good, other)
    assert not admission.proofs_match(good, None) and not admission.proofs_match(good, 7)


def test_each_pool_has_its_own_key_and_store_prefix():
    base = admission.random_base()
    first, second = admission.pool_key(base, 1, "a"), admission.pool_key(base, 2, "a")
    assert first != second != admission.pool_key(base, 2, "b")
    assert admission.pool_key(base, 1, "a") == first  # a join command derives the same key
    assert admission.store_prefix(first) != admission.store_prefix(second)
    assert admission.follow_key(base) not in (first, second)
    assert admission.random_base() != base
