"""Our example workflows (tools/make_workflows.py, example_workflows/): the committed files are
the generator's output, their nodes and links match upstream's and our node's signatures, and
their settings are the released ones; the sample inputs likewise."""

from __future__ import annotations

import ast
import re

import pytest

from tests.packaging.packaging_cases import (LOADER_FOLDERS, PINS, REPO, WORKFLOW_DIR, WORKFLOW_NAMES,
                                             load_workflow, make_sample_inputs, make_workflows,
                                             official_templates, one_node)


def test_committed_workflows_are_the_generator_output():
    generated = make_workflows.generate()
    assert sorted(generated) == sorted(f"{n}.json" for n in WORKFLOW_NAMES)
    assert sorted(p.name for p in WORKFLOW_DIR.glob("*.json")) == sorted(generated)
    for name, text in generated.items():
        assert (WORKFLOW_DIR / name).read_text(encoding="utf-8") == text, \
            f"{name} is stale: run .venv/bin/python tools/make_workflows.py"


def reference_signatures() -> dict[str, dict]:
    """Node type -> its input and output slots (name -> type) as the official H3 templates use them."""
    sigs: dict[str, dict] = {}
    for template in official_templates().values():
        nodes = list(template["nodes"])
        for sub in template.get("definitions", {}).get("subgraphs", []):
            nodes += sub["nodes"]
        for node in nodes:
            sig = sigs.setdefault(node["type"], {"inputs": {}, "outputs": {}})
            sig["inputs"].update({i["name"]: i["type"] for i in node.get("inputs", [])})
            sig["outputs"].update({o["name"]: o["type"] for o in node.get("outputs", [])})
    return sigs


def our_signature() -> dict:
    schema = make_workflows.node_schema()
    sockets = [s for s in schema["inputs"] if s["type"] in make_workflows.SOCKET_TYPES]
    return {"inputs": {s["name"]: s["type"] for s in sockets},
            "outputs": {o["name"]: o["type"] for o in schema["outputs"]}}


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_workflow_nodes_are_upstream_or_ours_and_links_match_types(name):
    workflow = load_workflow(name)
    refs = reference_signatures()
    ours = make_workflows.node_schema()["node_id"]
    nodes = {n["id"]: n for n in workflow["nodes"]}
    for node in nodes.values():
        sig = our_signature() if node["type"] == ours else refs.get(node["type"])
        assert sig is not None, f"{name}: node type {node['type']} is neither upstream's nor ours"
        for entry in node.get("inputs", []):
            assert sig["inputs"].get(entry["name"]) == entry["type"], (node["type"], entry)
        for entry in node.get("outputs", []):
            assert sig["outputs"].get(entry["name"]) == entry["type"], (node["type"], entry)
    if ours in {n["type"] for n in nodes.values()}:
        node = next(n for n in nodes.values() if n["type"] == ours)
        assert [(i["name"], i["type"]) for i in node["inputs"]] == list(our_signature()["inputs"].items())
        assert [(o["name"], o["type"]) for o in node["outputs"]] == list(our_signature()["outputs"].items())
    seen_inputs = set()
    for link_id, origin, origin_slot, target, target_slot, link_type in workflow["links"]:
        out_entry = nodes[origin]["outputs"][origin_slot]
        in_entry = nodes[target]["inputs"][target_slot]
        assert out_entry["type"] == link_type, (name, link_id)
        assert link_type in in_entry["type"].split(",") or in_entry["type"] == "*", (name, link_id)
        assert link_id in out_entry["links"] and in_entry["link"] == link_id
        assert (target, target_slot) not in seen_inputs  # one link per input
        seen_inputs.add((target, target_slot))
    linked = {(n["id"], s) for n in nodes.values() for s, i in enumerate(n.get("inputs", []))
              if i.get("link") is not None}
    assert linked == seen_inputs
    assert workflow["last_link_id"] == len(workflow["links"])
    assert workflow["last_node_id"] >= max(nodes)


def _widget(node: dict, index: int):
    return node["widgets_values"][index]


def _evaluate(expression: str, a: float) -> int:
    """The template's duration formula (names: max, round, a, numbers and + - * %)."""
    tree = ast.parse(expression, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Call, ast.Name, ast.Constant, ast.Load,
               ast.Add, ast.Sub, ast.Mult, ast.Mod)
    assert all(isinstance(n, allowed) for n in ast.walk(tree)), expression
    return eval(compile(tree, "<expr>", "eval"), {"__builtins__": {}}, {"max": max, "round": round, "a": a})


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_workflow_settings(name):
    variant = next(v for v in make_workflows.VARIANTS if v.name == name)
    workflow = load_workflow(name)
    nodes = {n["id"]: n for n in workflow["nodes"]}
    links = {l[0]: l for l in workflow["links"]}
    schema = make_workflows.node_schema()
    parallel = one_node(workflow, schema["node_id"])
    widget_names = [s["name"] for s in schema["inputs"] if s["type"] not in make_workflows.SOCKET_TYPES]
    assert parallel["widgets_values"][widget_names.index("npu_count")] == 4

    # Between the loaders and their consumers: the node's inputs come from the loaders, and
    # every MODEL / CLIP / VAE that a non-loader uses comes from the node.
    loaders = set(LOADER_FOLDERS)
    for entry in parallel["inputs"]:
        assert nodes[links[entry["link"]][1]]["type"] in loaders
    for origin, target, link_type in ((l[1], l[3], l[5]) for l in workflow["links"]):
        if link_type in ("MODEL", "CLIP", "VAE") and nodes[target]["type"] not in loaders | {schema["node_id"]}:
            assert origin == parallel["id"], (name, nodes[target]["type"])
    vae_in = {e["name"]: nodes[links[e["link"]][1]]["widgets_values"][0] for e in parallel["inputs"]
              if e["type"] == "VAE"}
    assert "video_vae" in vae_in["video_vae"] and "audio_vae" in vae_in["audio_vae"]

    h3 = next(n for n in workflow["nodes"] if n["type"].startswith("MiniMaxH3") and "ToVideo" in n["type"])
    assert h3["type"] == {"ref2va": "MiniMaxH3ReferenceToVideo", "fl2va": "MiniMaxH3ImageToVideo"}[variant.task]
    names = [i["name"] for i in h3["inputs"]]
    widgets = [i for i in names if i in ("width", "height", "length")]
    offset = 1  # the prompt widget comes first in both nodes
    width, height = (h3["widgets_values"][offset + widgets.index(k)] for k in ("width", "height"))
    assert (width, height) == (1344, 768)
    assert h3["inputs"][names.index("width")]["link"] is None  # fixed, not computed
    expression = nodes[links[h3["inputs"][names.index("length")]["link"]][1]]
    duration = nodes[links[expression["inputs"][0]["link"]][1]]
    assert duration["type"] == "PrimitiveFloat" and duration["widgets_values"][0] == 15
    frames = _evaluate(expression["widgets_values"][0], 15)
    assert frames == make_workflows.frame_count(15) == 362 and (frames - 5) % 17 == 0
    assert one_node(workflow, "CreateVideo")["widgets_values"][0] == 24
    assert abs(frames / 24 - 15) < 17 / 24  # 15 s at 24 fps, snapped to the model's grid

    assert one_node(workflow, "BasicScheduler")["widgets_values"][1] == variant.steps
    assert one_node(workflow, "KSamplerSelect")["widgets_values"][0] == variant.sampler
    assert (variant.steps, variant.sampler) in ((8, "res_multistep"), (21, "res_multistep"), (50, "euler"))
    loras = [n for n in workflow["nodes"] if n["type"] == "LoraLoaderModelOnly"]
    assert len(loras) == (1 if variant.lora else 0) and variant.lora == name.endswith("_lora")
    assert not [n for n in workflow["nodes"] if n["type"] == "ComfySwitchNode"]

    images = [n["widgets_values"][0] for n in workflow["nodes"] if n["type"] == "LoadImage"]
    assert len(images) == 2
    for image in images:
        # directly in input/: upstream's LoadImage lists no subfolders (the canvas would report
        # "Missing Inputs" for a name with a folder in it)
        assert "/" not in image and (REPO / "additional_files" / "input" / image).is_file(), image


def test_generator_uses_the_nodes_own_schema_when_it_can():
    try:
        from comfy_extras.nodes_multinpu import NODE_SCHEMA
    except Exception:
        assert make_workflows.node_schema() is make_workflows.FALLBACK_NODE_SCHEMA
        return
    fallback = make_workflows.FALLBACK_NODE_SCHEMA
    assert make_workflows.node_schema() is NODE_SCHEMA
    assert NODE_SCHEMA["node_id"] == fallback["node_id"]
    keys = ("name", "type", "default", "options")
    assert [{k: s.get(k) for k in keys} for s in NODE_SCHEMA["inputs"]] == \
        [{k: s.get(k) for k in keys} for s in fallback["inputs"]]
    assert [(o["name"], o["type"]) for o in NODE_SCHEMA["outputs"]] == \
        [(o["name"], o["type"]) for o in fallback["outputs"]]


def test_sample_inputs_are_the_generator_output():
    for name, draw in make_sample_inputs.SAMPLES.items():
        path = make_sample_inputs.OUT_DIR / name
        assert path.stat().st_size < 64 * 1024, name
        assert not make_sample_inputs.differs(path, draw()), \
            f"{name} is stale: run .venv/bin/python tools/make_sample_inputs.py"


def test_model_sources_match_the_workflows_own_download_links():
    # Every file a workflow links (node properties "models": url .../OWNER/REPO/resolve/...)
    # has that OWNER/REPO as its source in source_deps_info.json.
    sources = {m["file"]: m["source"] for m in PINS["model_files"]["files"]}
    links = {}
    for path in sorted(WORKFLOW_DIR.glob("*.json")):
        for repo, name in re.findall(r"huggingface\.co/([^/\"]+/[^/\"]+)/resolve/[^/\"]+/(?:[^\"]*/)?([^/\"]+)\"",
                                     path.read_text(encoding="utf-8")):
            links.setdefault(name, set()).add(repo)
    assert links, "no model links found in the workflows"
    for name, repos in links.items():
        assert name in sources, f"{name} is linked by a workflow but not listed in source_deps_info.json"
        assert repos == {sources[name]}, f"{name}: workflows link {sorted(repos)}, pins say {sources[name]}"


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_the_node_sits_inside_the_workflows_models_group(name):
    workflow = load_workflow(name)
    node = next(n for n in workflow["nodes"] if n["type"] == "MultiNPUParallelConfig")
    models = [g for g in workflow["groups"] if g["title"] == "Models"]
    assert len(models) == 1, [g["title"] for g in workflow["groups"]]
    x, y, w, h = models[0]["bounding"]
    (nx, ny), (nw, nh) = node["pos"], node["size"]
    assert x <= nx and nx + nw <= x + w and y <= ny and ny + nh <= y + h, (models[0]["bounding"], node["pos"])
    hidden = [n["type"] for n in workflow["nodes"] if n is not node and
              make_workflows.boxes_overlap(make_workflows.node_box(node), make_workflows.node_box(n))]
    assert hidden == [], f"the node's box (title bar included) covers {hidden}"
    for group in workflow["groups"]:  # the grown group covers no other group
        if group is not models[0]:
            gx, gy, gw, gh = group["bounding"]
            assert gx >= x + w or gx + gw <= x or gy >= y + h or gy + gh <= y, (group["title"], group["bounding"])


def test_every_workflow_has_its_thumbnail_showing_the_images_it_loads():
    """ComfyUI's Templates browser shows example_workflows/<name>.jpg on the workflow's card:
    the committed ones are tools/make_thumbnails.py's output, of the images the workflow loads."""
    import make_thumbnails
    for variant in make_workflows.VARIANTS:
        path = WORKFLOW_DIR / f"{variant.name}.jpg"
        assert not make_thumbnails.differs(path, make_thumbnails.draw(variant)), \
            f"{path.name} is stale: run .venv/bin/python tools/make_thumbnails.py"
        loaded = sorted(n["widgets_values"][0] for n in load_workflow(variant.name)["nodes"] if n["type"] == "LoadImage")
        assert loaded == sorted(p.name for p in make_thumbnails.image_files(variant))
        assert f"{variant.steps} steps" in make_thumbnails.caption(variant)
