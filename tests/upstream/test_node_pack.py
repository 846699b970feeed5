"""The node pack's pyproject.toml read by upstream's own parser (comfy_config), as ComfyUI does
when it loads the pack: every field we set comes back, the classifiers are all accepted."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

PACK = Path(__file__).resolve().parents[2]  # the repository root is the node pack


def test_upstreams_parser_reads_every_field_of_the_packs_pyproject(upstream):
    config_parser = pytest.importorskip("comfy_config.config_parser",
                                        reason="this ComfyUI has no comfy_config (added upstream in 2025)")
    ours = tomllib.loads((PACK / "pyproject.toml").read_text(encoding="utf-8"))
    parsed = config_parser.extract_node_configuration(str(PACK))
    assert parsed.project.name == ours["project"]["name"]
    assert parsed.project.version == ours["project"]["version"]
    assert parsed.project.license.file == "LICENSE"
    assert parsed.tool_comfy.publisher_id == ours["tool"]["comfy"]["PublisherId"]
    assert parsed.tool_comfy.display_name == ours["tool"]["comfy"]["DisplayName"]
    # The parser drops the whole list when one classifier is not one it knows.
    assert parsed.project.supported_os == ["POSIX :: Linux"]
    assert sorted(parsed.project.supported_accelerators) == ["GPU :: NVIDIA CUDA", "NPU :: Huawei Ascend"]
