"""MiniMax-H3 multi-device: the ComfyUI node pack that registers MultiNPUParallelConfig.

This file is the pack's entry point in both ways of installing it:

  * the repository cloned into ComfyUI/custom_nodes/<any name>/ (git clone, ComfyUI-Manager,
    comfy-cli): the node and its package come from the clone. Its folder is APPENDED to
    sys.path; ComfyUI's `comfy` and `comfy_extras` are namespace packages (no __init__.py), so
    Python merges the clone's comfy/multidevice/ and comfy_extras/nodes_multinpu.py into them
    while every upstream module still comes from ComfyUI's tree, which stays first on the path;
  * the patch applied to a ComfyUI checkout (install_deps_minimax_h3.sh --comfyui DIR): this file
    is custom_nodes/ComfyUI-MultiNPU/__init__.py there and the package is in ComfyUI's own tree.

One copy is used: the one Python already finds (the patched tree, or a pack folder loaded
earlier); any other pack folder registers nothing and says so in one log line, so no node is
registered twice and no module comes from two copies.

On first use a clone copies its sample images into ComfyUI's input/ folder (the workflows name
them; files already there are never overwritten). WEB_DIRECTORY serves web/docs/<node id>.md,
the node's help page; ComfyUI's Templates browser lists example_workflows/.

Model folders: when MINIMAX_H3_MODELS names a folder (runtime/restart-v1.sh sets it), its
diffusion_models/, text_encoders/, vae/ and loras/ are added to ComfyUI's search paths.
"""

import importlib
import importlib.util
import logging
import os
import shutil
import sys

log = logging.getLogger(__name__)

NODE_MODULE = "comfy_extras.nodes_multinpu"
MODELS_ENV = "MINIMAX_H3_MODELS"
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras")  # the H3 files' folders
SAMPLE_INPUTS = os.path.join("additional_files", "input")  # the images the workflows name
WEB_DIRECTORY = "./web"
PACK_DIR = os.path.dirname(os.path.realpath(__file__))  # realpath: follows a symlinked folder


def register_model_folders(environ=os.environ):
    """Add $MINIMAX_H3_MODELS/<folder> to ComfyUI's model search paths; returns what was added."""
    root = environ.get(MODELS_ENV, "").strip()
    if not root:
        return []
    try:
        import folder_paths  # ComfyUI's; absent when the pack is imported outside ComfyUI
    except ImportError:
        return []
    added = []
    for folder in MODEL_FOLDERS:
        path = os.path.join(os.path.abspath(os.path.expanduser(root)), folder)
        folder_paths.add_model_folder_path(folder, path)
        added.append(path)
    log.info("MiniMax-H3 pack: model folders from %s=%s: %s", MODELS_ENV, root, ", ".join(MODEL_FOLDERS))
    return added


def holds_the_project(path):
    """Whether `path` is a checkout of this repository (not the patch's pack folder)."""
    return os.path.isfile(os.path.join(path, *NODE_MODULE.split(".")) + ".py") and \
        os.path.isfile(os.path.join(path, "comfy", "multidevice", "__init__.py"))


def node_module_on_path():
    """Where Python already finds the node module (the patched tree, an earlier clone), or None."""
    try:
        spec = importlib.util.find_spec(NODE_MODULE)
    except ModuleNotFoundError:  # no comfy_extras at all: not inside ComfyUI
        return None
    return os.path.realpath(spec.origin) if spec is not None and spec.origin else None


def choose_copy(pack_dir=PACK_DIR):
    """(the node module's file to use or None, whether this folder's copy is the one, why).

    Never touches sys.path; `use_this_copy` does that."""
    found = node_module_on_path()
    own = holds_the_project(pack_dir)
    if found is not None and (not own or found.startswith(os.path.join(pack_dir, ""))):
        return found, False, "found"
    if found is not None:
        return found, False, "shadowed"
    if own:
        return os.path.join(pack_dir, *NODE_MODULE.split(".")) + ".py", True, "own"
    return None, False, "missing"


def copy_sample_inputs(pack_dir=PACK_DIR):
    """Copy the sample images into ComfyUI's input/ where they are missing; returns the copied names."""
    source = os.path.join(pack_dir, SAMPLE_INPUTS)
    try:
        import folder_paths
    except ImportError:
        return []
    if not os.path.isdir(source):  # the patch's pack folder: the installer copied them
        return []
    target = folder_paths.get_input_directory()
    copied = []
    for name in sorted(os.listdir(source)):
        if os.path.exists(os.path.join(target, name)):
            continue  # the user's file (or ours from an earlier start) stays
        os.makedirs(target, exist_ok=True)
        partial = os.path.join(target, f".{name}.partial")  # never a half-written image under its name
        try:
            shutil.copyfile(os.path.join(source, name), partial)
            os.replace(partial, os.path.join(target, name))
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        copied.append(name)
    if copied:
        log.info("MiniMax-H3 pack: copied the sample images %s into %s", ", ".join(copied), target)
    return copied


def load_node_module(pack_dir=PACK_DIR):
    """Import the node module from the copy `choose_copy` picks; None when another copy is used."""
    path, own, why = choose_copy(pack_dir)
    if why == "missing":
        raise ImportError(
            f"MiniMax-H3 pack in {pack_dir}: {NODE_MODULE} is neither in ComfyUI's tree nor beside "
            "this file. Clone the whole repository into ComfyUI/custom_nodes/, or apply the patch "
            "again (bash install_deps_minimax_h3.sh --comfyui <ComfyUI dir>, from a checkout of it).")
    if why == "shadowed":  # this folder is a clone: its own installer removes the patch
        log.info("MiniMax-H3 pack in %s: not used, the node is already installed from %s (remove one "
                 "of the two; bash %s --comfyui <ComfyUI dir> --uninstall removes the patch)",
                 pack_dir, os.path.dirname(os.path.dirname(path)), os.path.join(pack_dir, "install_deps_minimax_h3.sh"))
        return None
    if own:
        if pack_dir not in sys.path:
            sys.path.append(pack_dir)
        importlib.invalidate_caches()
    module = importlib.import_module(NODE_MODULE)
    log.info("MiniMax-H3 pack: MultiNPUParallelConfig from %s", os.path.dirname(os.path.dirname(path)))
    return module


node_module = None
NODE_CLASS_MAPPINGS = None  # set to {} when another copy is used: ComfyUI then registers nothing
if "folder_paths" in sys.modules:  # inside ComfyUI; a plain import (tests, tools) only defines names
    node_module = load_node_module()
    if node_module is None:
        NODE_CLASS_MAPPINGS, WEB_DIRECTORY = {}, None
    else:
        try:
            copy_sample_inputs()
        except OSError as exc:  # a read-only input/ must not stop the node from loading
            log.warning("MiniMax-H3 pack: could not copy the sample images into ComfyUI's input/ "
                        "(%s); copy %s there by hand", exc, os.path.join(PACK_DIR, SAMPLE_INPUTS))
    register_model_folders()


async def comfy_entrypoint():
    return await (node_module or load_node_module()).comfy_entrypoint()
