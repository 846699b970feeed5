"""ComfyUI-MultiNPU: registers the MultiNPUParallelConfig node.

The node lives in the overlay's `comfy_extras/nodes_multinpu.py`; everything it uses, in the package `comfy/multidevice/`.
Two ways to install, no upstream file edited in either:

  * the overlay applied to a ComfyUI checkout (install_deps_minimax_h3.sh --comfyui DIR):
    `comfy_extras.nodes_multinpu` sits next to ComfyUI's own modules and imports directly;
  * only this folder linked or copied into ComfyUI's custom_nodes/, with the project checkout
    elsewhere: the shim looks for the project root (a folder holding
    comfy_extras/nodes_multinpu.py) in COMFYUI_MULTINPU_ROOT, then two levels above this file,
    and APPENDS it to sys.path. `comfy` and `comfy_extras` are namespace packages (no
    __init__.py), so Python merges the project's files into them while every upstream module
    still comes from ComfyUI's own tree, which stays first on the path.

ComfyUI's loader takes NODE_CLASS_MAPPINGS before comfy_entrypoint; this shim exports only
comfy_entrypoint (the V3 hook). WEB_DIRECTORY serves web/docs/<node id>.md, the node's help page.

Model folders: when MINIMAX_H3_MODELS names a folder (runtime/restart-v1.sh sets it), its
diffusion_models/, text_encoders/, vae/ and loras/ are added to ComfyUI's search paths when the
pack loads; without it ComfyUI's own models/<folder>/ is used, and nothing is added.
"""

import importlib
import logging
import os
import sys

log = logging.getLogger(__name__)

_MODULE = "comfy_extras.nodes_multinpu"
ROOT_ENV = "COMFYUI_MULTINPU_ROOT"
MODELS_ENV = "MINIMAX_H3_MODELS"
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras")  # the H3 files' folders
WEB_DIRECTORY = "./web"


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
    log.info("ComfyUI-MultiNPU: model folders from %s=%s: %s", MODELS_ENV, root, ", ".join(MODEL_FOLDERS))
    return added


def _candidate_roots():
    env = os.environ.get(ROOT_ENV)
    if env:
        yield os.path.abspath(env)
    here = os.path.dirname(os.path.realpath(__file__))  # realpath: follows a symlinked folder
    yield os.path.dirname(os.path.dirname(here))


def _is_project_root(path):
    return os.path.isfile(os.path.join(path, "comfy_extras", "nodes_multinpu.py")) and \
        os.path.isfile(os.path.join(path, "comfy", "multidevice", "__init__.py"))


def load_node_module():
    """Import comfy_extras.nodes_multinpu from the overlay, or from the project root if needed."""
    try:
        return importlib.import_module(_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name not in (_MODULE, "comfy_extras"):
            raise  # the module exists but something it imports is missing: report that
    tried = []
    for root in _candidate_roots():
        tried.append(root)
        if _is_project_root(root):
            if root not in sys.path:
                sys.path.append(root)
            importlib.invalidate_caches()
            log.info("ComfyUI-MultiNPU: using the project files in %s", root)
            return importlib.import_module(_MODULE)
    raise ImportError(
        f"ComfyUI-MultiNPU: {_MODULE} was not found in ComfyUI's tree nor in {tried}. Apply the "
        f"overlay (install_deps_minimax_h3.sh --comfyui <ComfyUI dir>) or set {ROOT_ENV} to the "
        f"MiniMax-H3 multi-device checkout.")


async def comfy_entrypoint():
    return await load_node_module().comfy_entrypoint()


register_model_folders()
