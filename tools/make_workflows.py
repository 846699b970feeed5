#!/usr/bin/env python3
"""Generate the MiniMax-H3 multi-card workflows (the node pack's example_workflows/).

Each workflow starts from an official H3 template shipped in the MIT-licensed Python package
comfyui-workflow-templates-json (which template: source_deps_info.json "workflow_templates")
and is edited as a graph:

  1. a template that wraps its pipeline in a subgraph is flattened into one plain graph;
  2. the template's notes and resolution helper are dropped (our own note replaces them);
  3. the turbo on/off switches are resolved: the LoRA is kept only in the *_lora variants;
  4. steps, sampler, 1344x768, 15 s at 24 fps, a fixed seed, our sample inputs and prompt;
  5. MultiNPUParallelConfig (npu_count 4) goes between the loaders (UNET/LoRA, CLIP, the two
     VAEs) and every consumer of what they load; its node properties carry the pack's registry
     id and version (cnr_id / ver, from the pack's pyproject.toml), so ComfyUI-Manager can
     resolve the pack when a workflow is opened without it.

ComfyUI's Templates browser lists a pack's example_workflows/; the installer also copies them
into user/default/workflows/minimax-h3/ (ComfyUI versions without that browser).

  tools/make_workflows.py          (re)write the six workflow files
  tools/make_workflows.py --check  exit 1 when a committed file differs from the generator
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent
PACK_DIR = REPO_DIR  # the repository root is the node pack
OUT_DIR = PACK_DIR / "example_workflows"
PINS_FILE = REPO_DIR / "source_deps_info.json"
sys.path.insert(0, str(REPO_DIR))

WIDTH, HEIGHT, FPS, SECONDS = 1344, 768, 24, 15
NPU_COUNT = 4
SEED = 20260101
# Sample images sit at the top of ComfyUI's input/ (its LoadImage lists no subfolders).
SAMPLE_INPUT_PREFIX = "minimax_h3_"

# --- The MultiNPUParallelConfig interface -------------------------------------------------
# comfy_extras/nodes_multinpu.py publishes it as plain data (NODE_SCHEMA). This copy is
# used only where that module cannot be imported; tests/packaging/test_workflows.py checks that both
# agree whenever the module is there.
FALLBACK_NODE_SCHEMA = {
    "node_id": "MultiNPUParallelConfig",
    "inputs": [
        {"name": "model", "type": "MODEL"},
        {"name": "clip", "type": "CLIP"},
        {"name": "video_vae", "type": "VAE"},
        {"name": "audio_vae", "type": "VAE"},
        {"name": "npu_count", "type": "COMBO", "options": [1, 2, 4, 8], "default": 4},
        {"name": "backend", "type": "COMBO", "options": ["default", "auto", "hccl", "nccl", "peer"],
         "default": "default", "optional": True},
        {"name": "device_kind", "type": "COMBO", "options": ["auto", "npu", "cuda", "cpu"],
         "default": "auto", "optional": True},
        {"name": "devices", "type": "STRING", "default": "", "optional": True},
        {"name": "dit_weights", "type": "COMBO", "options": ["auto", "replicate", "shard"], "default": "auto",
         "optional": True},
        {"name": "plan_tokens", "type": "INT", "default": 0, "optional": True},
        {"name": "dit_ranks", "type": "COMBO", "options": ["auto", "threads", "processes"], "default": "auto",
         "optional": True},
        {"name": "sp_mode", "type": "COMBO", "options": ["auto", "allgather", "ulysses", "hybrid"], "default": "auto",
         "optional": True},
        {"name": "exchange_precision", "type": "COMBO", "options": ["exact", "int8", "fp8"], "default": "exact",
         "optional": True},
        {"name": "split", "type": "STRING", "default": "even", "optional": True},
    ],
    "outputs": [
        {"name": "model", "type": "MODEL"},
        {"name": "clip", "type": "CLIP"},
        {"name": "video_vae", "type": "VAE"},
        {"name": "audio_vae", "type": "VAE"},
    ],
}
SOCKET_TYPES = ("MODEL", "CLIP", "VAE")  # the inputs that are links, not widgets


def pack_identity() -> dict:
    """The node properties ComfyUI-Manager resolves a custom node by: registry id and version."""
    import tomllib

    project = tomllib.loads((PACK_DIR / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {"cnr_id": project["name"], "ver": project["version"]}


def node_schema() -> dict:
    """The node's interface: the module's own data when importable, else the fallback above."""
    try:
        from comfy_extras.nodes_multinpu import NODE_SCHEMA
    except Exception:  # not committed yet, or its own imports fail: use the fallback copy
        return FALLBACK_NODE_SCHEMA
    return NODE_SCHEMA


@dataclass(frozen=True)
class Variant:
    name: str
    task: str       # ref2va | fl2va: which template
    steps: int
    sampler: str
    lora: bool      # keep the template's Turbo LoRA


VARIANTS = (
    Variant("ref2va_8steps_lora", "ref2va", 8, "res_multistep", True),
    Variant("ref2va_21steps", "ref2va", 21, "res_multistep", False),
    Variant("ref2va_50steps", "ref2va", 50, "euler", False),
    Variant("fl2va_8steps_lora", "fl2va", 8, "res_multistep", True),
    Variant("fl2va_21steps", "fl2va", 21, "res_multistep", False),
    Variant("fl2va_50steps", "fl2va", 50, "euler", False),
)

PROMPTS = {
    "ref2va": (
        "Use <Picture 1> as the character and <Picture 2> as the place. The small round robot "
        "from <Picture 1> walks along the cliff top towards the lighthouse of <Picture 2> at dusk, "
        "stops, and looks up as the lamp sweeps its beam over the sea. The camera follows at "
        "shoulder height, then slowly tilts up to the lamp.\n"
        "Audio: waves breaking below the cliff, the robot's soft mechanical footsteps, a low "
        "foghorn in the distance."),
    "fl2va": (
        "A time-lapse over two rolling green hills, from dawn to midday. The video starts on "
        "<Picture 1>: an orange dawn sky, the sun just above the horizon. The sun climbs in a "
        "smooth arc while the sky turns from orange to clear blue and the shadows on the grass "
        "shorten, ending exactly on the last frame. The camera is locked off.\n"
        "Audio: early birdsong that grows into a full chorus, a light breeze over the grass."),
}

NOTE = """## MiniMax-H3 on {npu} cards: {name}

Generated by tools/make_workflows.py from the official `{template}` template
(comfyui-workflow-templates-json, MIT). {task_line}

- **MultiNPUParallelConfig** sits between the loaders and everything that uses the model,
  the text encoder and the two VAEs: the DiT runs sequence parallel over `npu_count` cards,
  the text encoder tensor parallel, the video VAE decodes its chunks on all cards and the
  audio VAE runs on the last card. Set `npu_count` to the number of visible cards
  (`ASCEND_RT_VISIBLE_DEVICES`).
- {steps} steps, sampler `{sampler}`, {lora_line}
- {width}x{height}, {seconds} s at {fps} fps (the duration node snaps the frame count to the
  model's 17k+5 grid).
- Weights: README, "Weight placement"; every file with its size: source_deps_info.json
  "model_files".
"""


# ----------------------------------------------------------------------------- the graph

class TemplateChanged(RuntimeError):
    """The official template no longer has the shape this generator edits."""


@dataclass
class Link:
    id: int
    origin: int
    origin_slot: int
    target: int
    target_slot: int
    type: str


class Graph:
    """A UI workflow as nodes plus links; slot lists of the nodes are rebuilt on output."""

    def __init__(self, nodes: list[dict], links: list[Link], groups: list[dict], extra: dict):
        self.nodes = {n["id"]: n for n in nodes}
        self.links = {l.id: l for l in links}
        self.groups = groups
        self.extra = extra
        # New nodes get ids above every id the template used, so none is ever reused.
        self.next_node_id = max(self.nodes, default=0) + 1

    # -- queries
    def of_type(self, node_type: str) -> list[dict]:
        return [n for n in self.nodes.values() if n["type"] == node_type]

    def one_of_type(self, node_type: str) -> dict:
        found = self.of_type(node_type)
        if len(found) != 1:
            raise TemplateChanged(f"expected one {node_type} node, found {len(found)}")
        return found[0]

    def input_slot(self, node: dict, name: str) -> int:
        for slot, entry in enumerate(node.get("inputs", [])):
            if entry["name"] == name:
                return slot
        raise TemplateChanged(f"node {node['id']} ({node['type']}) has no input {name!r}")

    def link_into(self, node: dict, name: str) -> Link | None:
        slot = self.input_slot(node, name)
        return next((l for l in self.links.values()
                     if l.target == node["id"] and l.target_slot == slot), None)

    def source_of(self, node: dict, name: str) -> dict:
        link = self.link_into(node, name)
        if link is None:
            raise TemplateChanged(f"input {name!r} of {node['type']} is not connected")
        return self.nodes[link.origin]

    def links_from(self, node_id: int, slot: int | None = None) -> list[Link]:
        return sorted((l for l in self.links.values()
                       if l.origin == node_id and (slot is None or l.origin_slot == slot)),
                      key=lambda l: l.id)

    # -- edits
    def connect(self, origin: dict, origin_slot: int, target: dict, target_name: str) -> None:
        slot = self.input_slot(target, target_name)
        self.disconnect(target, target_name)
        new_id = max(self.links, default=0) + 1
        self.links[new_id] = Link(new_id, origin["id"], origin_slot, target["id"], slot,
                                  origin["outputs"][origin_slot]["type"])

    def disconnect(self, node: dict, name: str) -> None:
        link = self.link_into(node, name)
        if link is not None:
            del self.links[link.id]

    def remove_node(self, node_id: int) -> None:
        del self.nodes[node_id]
        for link_id in [l.id for l in self.links.values() if node_id in (l.origin, l.target)]:
            del self.links[link_id]

    def add_node(self, node: dict) -> dict:
        node["id"] = self.next_node_id
        self.next_node_id += 1
        self.nodes[node["id"]] = node
        return node


def set_widget(node: dict, name: str, value) -> None:
    """Set one widget value by name (the package stores the names beside the values)."""
    names = list(node.get("widgets_values_named", {}))
    if name not in names:
        raise TemplateChanged(f"{node['type']} has no widget {name!r} (has {names})")
    node["widgets_values"][names.index(name)] = value
    node["widgets_values_named"][name] = value


def _links_from_json(raw: list) -> list[Link]:
    out = []
    for item in raw:
        if isinstance(item, dict):
            out.append(Link(item["id"], item["origin_id"], item["origin_slot"], item["target_id"],
                            item["target_slot"], item["type"]))
        else:
            out.append(Link(*item[:6]))
    return out


def flatten(template: dict) -> Graph:
    """The template as one plain graph: each subgraph instance replaced by its inner nodes."""
    subgraphs = {s["id"]: s for s in template.get("definitions", {}).get("subgraphs", [])}
    graph = Graph(copy.deepcopy(template["nodes"]), _links_from_json(template["links"]),
                  copy.deepcopy(template.get("groups", [])), copy.deepcopy(template.get("extra", {})))
    graph.next_node_id = max(graph.next_node_id, template.get("last_node_id", 0) + 1)
    for outer in [n for n in list(graph.nodes.values()) if n["type"] in subgraphs]:
        sub = subgraphs[outer["type"]]
        clash = {n["id"] for n in sub["nodes"]} & set(graph.nodes)
        if clash:
            raise TemplateChanged(f"subgraph node ids {sorted(clash)} clash with the outer graph")
        inner_links = _links_from_json(sub["links"])
        outer_in = {l.target_slot: l for l in graph.links.values() if l.target == outer["id"]}
        outer_out = graph.links_from(outer["id"])
        for node in copy.deepcopy(sub["nodes"]):
            graph.nodes[node["id"]] = node
        graph.next_node_id = max(graph.next_node_id, max(graph.nodes) + 1,
                                 template.get("last_node_id", 0) + 1)
        next_id = max([*graph.links, *(l.id for l in inner_links)]) + 1
        for link in inner_links:
            if link.origin == -10:  # from the subgraph's input: an outer link or a widget value
                name = sub["inputs"][link.origin_slot]["name"]
                slot = next((i for i, e in enumerate(outer.get("inputs", [])) if e["name"] == name), None)
                source = outer_in.get(slot) if slot is not None else None
                if source is not None:
                    graph.links[next_id] = Link(next_id, source.origin, source.origin_slot,
                                                link.target, link.target_slot, link.type)
                    next_id += 1
                elif name in outer.get("widgets_values_named", {}):
                    target = graph.nodes[link.target]
                    widget = target["inputs"][link.target_slot]["widget"]["name"]
                    set_widget(target, widget, outer["widgets_values_named"][name])
            elif link.target == -20:  # to the subgraph's output: every outer consumer
                for consumer in (l for l in outer_out if l.origin_slot == link.target_slot):
                    graph.links[next_id] = Link(next_id, link.origin, link.origin_slot,
                                                consumer.target, consumer.target_slot, link.type)
                    next_id += 1
            else:
                if link.id in graph.links:  # an id the outer graph uses already
                    link = Link(next_id, link.origin, link.origin_slot, link.target,
                                link.target_slot, link.type)
                    next_id += 1
                graph.links[link.id] = link
        graph.groups += copy.deepcopy(sub.get("groups", []))
        _move_outer_nodes_aside(graph, outer, sub)
        graph.remove_node(outer["id"])
    return graph


def _move_outer_nodes_aside(graph: Graph, outer: dict, sub: dict) -> None:
    """Inner nodes keep their own coordinates; move the outer graph's nodes out of their way:
    the ones feeding the subgraph to its left, the ones it feeds to its right."""
    inner = [graph.nodes[n["id"]] for n in sub["nodes"]]
    x0 = min(n["pos"][0] for n in inner)
    x1 = max(n["pos"][0] + n["size"][0] for n in inner)
    y0 = min(n["pos"][1] for n in inner)
    feeders = {l.origin for l in graph.links.values() if l.target == outer["id"]}
    fed = {l.target for l in graph.links.values() if l.origin == outer["id"]}
    left_y = right_y = y0
    for node_id in sorted(feeders):
        node = graph.nodes[node_id]
        node["pos"] = [x0 - node["size"][0] - 120, left_y]
        left_y += node["size"][1] + 80
    for node_id in sorted(fed):
        node = graph.nodes[node_id]
        node["pos"] = [x1 + 120, right_y]
        right_y += node["size"][1] + 80


# ----------------------------------------------------------------------------- the edits

DROPPED_TYPES = ("MarkdownNote", "Note", "ResolutionSelector", "ImageScaleToTotalPixels", "GetImageSize")
LOADER_TYPES = ("UNETLoader", "LoraLoaderModelOnly", "CLIPLoader", "VAELoader")
KEPT_WITHOUT_CONSUMERS = ("SaveVideo",)


def resolve_switches(graph: Graph, use_lora: bool) -> None:
    """Replace each turbo switch by the input it would pick."""
    chosen = "on_true" if use_lora else "on_false"
    for switch in graph.of_type("ComfySwitchNode"):
        source_link = graph.link_into(switch, chosen)
        source = graph.nodes[source_link.origin]
        for consumer_link in graph.links_from(switch["id"], 0):
            consumer = graph.nodes[consumer_link.target]
            name = consumer["inputs"][consumer_link.target_slot]["name"]
            graph.connect(source, source_link.origin_slot, consumer, name)
        graph.remove_node(switch["id"])


def prune_unused(graph: Graph) -> None:
    """Drop nodes whose outputs feed nothing (until none is left), except the output nodes."""
    while True:
        unused = [n["id"] for n in graph.nodes.values()
                  if n["type"] not in KEPT_WITHOUT_CONSUMERS and n.get("outputs")
                  and not graph.links_from(n["id"])]
        if not unused:
            return
        for node_id in unused:
            graph.remove_node(node_id)


def h3_node(graph: Graph) -> dict:
    found = [n for n in graph.nodes.values()
             if n["type"] in ("MiniMaxH3ReferenceToVideo", "MiniMaxH3ImageToVideo")]
    if len(found) != 1:
        raise TemplateChanged(f"expected one MiniMax-H3 conditioning node, found {len(found)}")
    return found[0]


def frame_count(seconds: float, fps: int = FPS) -> int:
    """Frames for a duration, rounded up to H3's valid lengths 17k+5 (5 latent frames per 17)."""
    frames = max(5, round(seconds * fps))
    return frames + (5 - frames % 17) % 17


def set_length(graph: Graph, h3: dict) -> None:
    """The template computes `length` from a duration in seconds: set that duration (and the
    length widget it overrides, so both say the same)."""
    expression = graph.source_of(h3, "length")
    if expression["type"] != "ComfyMathExpression":
        raise TemplateChanged("the H3 node's length no longer comes from a math expression")
    set_widget(graph.source_of(expression, "values.a"), "value", SECONDS)
    set_widget(h3, "length", frame_count(SECONDS))


def set_prompt(graph: Graph, h3: dict, text: str) -> None:
    """The prompt is the H3 node's own widget, or comes from a text node linked into it."""
    linked = any(e["name"] == "prompt" for e in h3.get("inputs", [])) and graph.link_into(h3, "prompt")
    if linked:
        set_widget(graph.nodes[linked.origin], "value", text)
    else:
        set_widget(h3, "prompt", text)


def set_images(graph: Graph, h3: dict, task: str) -> None:
    if task == "ref2va":
        names = {"ref_images.ref_image_0": "ref_character", "ref_images.ref_image_1": "ref_scene"}
    else:
        names = {"first_frame": "first_frame", "last_frame": "last_frame"}
    loaders = [n for n in graph.of_type("LoadImage")]
    if not loaders:
        raise TemplateChanged("the template has no LoadImage node")
    for input_name, file_name in names.items():
        link = graph.link_into(h3, input_name)
        if link is None:  # add a loader next to the first one
            model = loaders[0]
            node = graph.add_node(copy.deepcopy(model))
            node["pos"] = [model["pos"][0], model["pos"][1] + model["size"][1] + 80]
            graph.connect(node, 0, h3, input_name)
        else:
            node = graph.nodes[link.origin]
        set_widget(node, "image", f"{SAMPLE_INPUT_PREFIX}{file_name}.png")


def insert_parallel_node(graph: Graph) -> dict:
    """MultiNPUParallelConfig between the loaders and all their consumers."""
    schema = node_schema()
    sockets = [s for s in schema["inputs"] if s["type"] in SOCKET_TYPES]
    widgets = [s for s in schema["inputs"] if s["type"] not in SOCKET_TYPES]
    vaes = {("audio" if "audio" in n["widgets_values_named"]["vae_name"] else "video"): n
            for n in graph.of_type("VAELoader")}
    # The model chain is UNETLoader [-> LoraLoaderModelOnly]; its last loader feeds the node,
    # and whatever took a MODEL from any loader of the chain takes it from the node instead.
    model_chain = graph.of_type("UNETLoader") + graph.of_type("LoraLoaderModelOnly")
    chain_ends = [n for n in model_chain if not any(
        graph.nodes[l.target]["type"] in LOADER_TYPES for l in graph.links_from(n["id"]))]
    if len(chain_ends) != 1 or len(vaes) != 2 or len(graph.of_type("VAELoader")) != 2:
        raise TemplateChanged("expected one model loader chain and one video plus one audio VAELoader")
    sources = {"model": (chain_ends[0], model_chain), "clip": (graph.one_of_type("CLIPLoader"),) * 2,
               "video_vae": (vaes["video"],) * 2, "audio_vae": (vaes["audio"],) * 2}
    loaders = [n for n in graph.nodes.values() if n["type"] in LOADER_TYPES]
    x0 = min(n["pos"][0] for n in loaders)
    y1 = max(n["pos"][1] + n["size"][1] for n in loaders)
    node = graph.add_node({
        # tall enough for every widget as the frontend draws it (it grows a node stored smaller,
        # over the nodes below): the space below is made for this height
        "type": schema["node_id"], "pos": [x0, y1 + 80], "size": [380, 110 + 24 * len(widgets)], "flags": {},
        "order": 0, "mode": 0,
        "inputs": [{"name": s["name"], "type": s["type"], "link": None} for s in sockets],
        "outputs": [{"name": o["name"], "type": o["type"], "links": []} for o in schema["outputs"]],
        "properties": {**pack_identity(), "Node name for S&R": schema["node_id"]},
        "widgets_values": [NPU_COUNT if s["name"] == "npu_count" else s["default"] for s in widgets],
        "widgets_values_named": {s["name"]: NPU_COUNT if s["name"] == "npu_count" else s["default"]
                                 for s in widgets},
    })
    for out_slot, socket in enumerate(sockets):
        source, redirected = sources[socket["name"]]
        for loader in (redirected if isinstance(redirected, list) else [redirected]):
            for link in graph.links_from(loader["id"], 0):
                target = graph.nodes[link.target]
                if target["type"] not in LOADER_TYPES:
                    graph.connect(node, out_slot, target, target["inputs"][link.target_slot]["name"])
        graph.connect(source, 0, node, socket["name"])
    group = next((g for g in graph.groups if all(_holds(g, n["pos"]) for n in loaders)), None)
    moved = _make_room_below(graph, node)  # before the group grows: membership by old place
    if group is not None:
        _grow_group_around(graph, group, [node] + [n for n, old in moved if _holds(group, old)])
    return node


GROUP_MARGIN = 40  # pixels between a node and its group's edge
TITLE_HEIGHT = 40  # the canvas draws a node's title bar above its `pos`
MIN_HEIGHT = 60    # a node stored with height 0 is laid out by the frontend at about this


def node_box(n: dict) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of a node as the canvas draws it, title bar included."""
    x, y = n["pos"]
    w, h = n["size"]
    return x, y - TITLE_HEIGHT, x + w, y + max(h, MIN_HEIGHT)


def boxes_overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _holds(group: dict, pos) -> bool:
    x, y, w, h = group["bounding"]
    return x <= pos[0] <= x + w and y <= pos[1] <= y + h


def _make_room_below(graph: "Graph", node: dict) -> list[tuple[dict, list]]:
    """Move down every node the new node would cover, and in turn those they would then cover,
    so no node hides another; [(moved node, its position before)]. Nothing else moves."""
    moved, pushers = {}, [node]
    while pushers:
        pusher = pushers.pop()
        box = node_box(pusher)  # a pusher does not move while it pushes
        for other in graph.nodes.values():
            if other is node or other is pusher or other["pos"][1] < pusher["pos"][1]:
                continue
            if boxes_overlap(box, node_box(other)):
                moved.setdefault(id(other), (other, list(other["pos"])))
                other["pos"] = [other["pos"][0], box[3] + GROUP_MARGIN + TITLE_HEIGHT]
                pushers.append(other)
    return list(moved.values())


def _grow_group_around(graph: "Graph", group: dict, covered: list[dict]) -> None:
    """Grow the group that holds the loaders (the templates' "Models" group) down and out to
    cover `covered` (the new node and what moved within the group); a group right below it
    (with its nodes) moves down by as much, so no two groups overlap."""
    node = covered[0]
    x, y, w, h = group["bounding"]
    right = max([x + w] + [n["pos"][0] + n["size"][0] + GROUP_MARGIN for n in covered])
    bottom = max([y + h] + [node_box(n)[3] + GROUP_MARGIN for n in covered])
    group["bounding"] = [x, y, right - x, bottom - y]
    grown = bottom - (y + h)
    for other in graph.groups:
        ox, oy, ow, oh = other["bounding"]
        if other is group or oy < y + h or ox >= right or ox + ow <= x or grown <= 0:
            continue
        for n in graph.nodes.values():
            if n is not node and _holds(other, n["pos"]):
                n["pos"] = [n["pos"][0], n["pos"][1] + grown]
        other["bounding"] = [ox, oy + grown, ow, oh]


def add_note(graph: Graph, variant: Variant, template_name: str) -> None:
    x0 = min(n["pos"][0] for n in graph.nodes.values())
    y0 = min(n["pos"][1] for n in graph.nodes.values())
    lora = graph.of_type("LoraLoaderModelOnly")
    text = NOTE.format(
        npu=NPU_COUNT, name=variant.name, template=template_name, steps=variant.steps,
        sampler=variant.sampler, width=WIDTH, height=HEIGHT, seconds=SECONDS, fps=FPS,
        task_line=("Reference-to-video with audio (ref2va): two reference pictures and a prompt."
                   if variant.task == "ref2va" else
                   "First/last-frame to video with audio (fl2va): two key frames and a prompt."),
        lora_line=(f"Turbo LoRA `{lora[0]['widgets_values_named']['lora_name']}` at strength 1."
                   if lora else "no LoRA."))
    graph.add_node({
        "type": "MarkdownNote", "pos": [x0, y0 - 520],
        "size": [640, 440], "flags": {}, "order": 0, "mode": 0, "inputs": [], "outputs": [],
        "properties": {}, "widgets_values": [text], "widgets_values_named": {"text": text},
        "color": "#432", "bgcolor": "#653"})


def drop_empty_groups(graph: Graph) -> None:
    def inside(node, group):
        x, y, w, h = group["bounding"]
        return x <= node["pos"][0] <= x + w and y <= node["pos"][1] <= y + h
    graph.groups = [g for g in graph.groups if any(inside(n, g) for n in graph.nodes.values())]
    for number, group in enumerate(graph.groups, start=1):
        group["id"] = number


def build(variant: Variant, template: dict, template_name: str) -> dict:
    graph = flatten(template)
    for node in [n for n in graph.nodes.values() if n["type"] in DROPPED_TYPES]:
        graph.remove_node(node["id"])
    resolve_switches(graph, variant.lora)
    scheduler = graph.one_of_type("BasicScheduler")
    graph.disconnect(scheduler, "steps")
    set_widget(scheduler, "steps", variant.steps)
    prune_unused(graph)
    set_widget(graph.one_of_type("KSamplerSelect"), "sampler_name", variant.sampler)
    if variant.lora:
        set_widget(graph.one_of_type("LoraLoaderModelOnly"), "strength_model", 1)
    h3 = h3_node(graph)
    for name, value in (("width", WIDTH), ("height", HEIGHT)):
        graph.disconnect(h3, name)
        set_widget(h3, name, value)
    set_length(graph, h3)
    set_prompt(graph, h3, PROMPTS[variant.task])
    set_images(graph, h3, variant.task)
    set_widget(graph.one_of_type("CreateVideo"), "fps", FPS)
    noise = graph.one_of_type("RandomNoise")
    set_widget(noise, "noise_seed", SEED)
    set_widget(noise, "control_after_generate", "fixed")
    set_widget(graph.one_of_type("SaveVideo"), "filename_prefix", f"video/minimax_h3_{variant.name}")
    insert_parallel_node(graph)
    drop_empty_groups(graph)
    add_note(graph, variant, template_name)
    return to_workflow(graph, variant)


# ----------------------------------------------------------------------------- output

def execution_order(graph: Graph) -> dict[int, int]:
    """A topological order (ties by node id), stored in each node's "order" field."""
    pending = {node_id: {l.origin for l in graph.links.values() if l.target == node_id}
               for node_id in graph.nodes}
    order = {}
    while pending:
        ready = sorted(n for n, deps in pending.items() if not deps - set(order))
        if not ready:
            raise TemplateChanged("the workflow has a cycle")
        for node_id in ready:
            order[node_id] = len(order)
            del pending[node_id]
    return order


def to_workflow(graph: Graph, variant: Variant) -> dict:
    # Links renumbered 1..n in a stable order, then every slot list rebuilt from them.
    links = sorted(graph.links.values(), key=lambda l: (l.origin, l.origin_slot, l.target, l.target_slot))
    renumber = {l.id: i for i, l in enumerate(links, start=1)}
    order = execution_order(graph)
    nodes = []
    for node_id in sorted(graph.nodes, key=lambda i: (order[i], i)):
        node = copy.deepcopy(graph.nodes[node_id])
        node.pop("widgets_values_named", None)
        node["order"] = order[node_id]
        for slot, entry in enumerate(node.get("inputs", [])):
            entry["link"] = next((renumber[l.id] for l in links
                                  if l.target == node_id and l.target_slot == slot), None)
        for slot, entry in enumerate(node.get("outputs", [])):
            entry["links"] = [renumber[l.id] for l in links if l.origin == node_id and l.origin_slot == slot]
        nodes.append(node)
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"minimax-h3-multidevice/{variant.name}")),
        "revision": 0,
        "last_node_id": max(graph.nodes),
        "last_link_id": len(links),
        "nodes": nodes,
        "links": [[renumber[l.id], l.origin, l.origin_slot, l.target, l.target_slot, l.type] for l in links],
        "groups": graph.groups,
        "config": {},
        "extra": {"ds": graph.extra.get("ds", {"scale": 0.6, "offset": [0, 0]})},
        "version": 0.4,
    }


def dumps(workflow: dict) -> str:
    return json.dumps(workflow, indent=2, ensure_ascii=False) + "\n"


def templates_dir() -> Path:
    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the package comfyui-workflow-templates-json is not installed in this "
                         "Python; run `bash install_deps_minimax_h3.sh` and use .venv/bin/python")
    return Path(list(spec.submodule_search_locations)[0])


def template_paths() -> dict[str, Path]:
    declared = json.loads(PINS_FILE.read_text())["workflow_templates"]["templates"]
    return {task: templates_dir() / rel for task, rel in declared.items()}


def generate() -> dict[str, str]:
    """File name -> content of every workflow."""
    paths = template_paths()
    out = {}
    for variant in VARIANTS:
        path = paths[variant.task]
        out[f"{variant.name}.json"] = dumps(build(variant, json.loads(path.read_text()), path.name))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for name, text in generate().items():
        path = OUT_DIR / name
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(REPO_DIR)}")
    if stale:
        print(f"stale workflows: {', '.join(stale)}; run: .venv/bin/python tools/make_workflows.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
