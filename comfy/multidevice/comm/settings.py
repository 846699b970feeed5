"""Every environment variable the package reads: parsed and checked here, and only here.

Ours:

COMFYUI_MULTI_DEVICE_BACKEND       auto | hccl | nccl | peer (default auto)
COMFYUI_MULTI_DEVICE_TIMEOUT_S     seconds a rank waits for the others at a collective (default 600)
COMFYUI_MULTI_DEVICE_RUN_TIMEOUT_S seconds a coordinator's run() lets pass with no rank returning
                                   and none reaching a collective (default 3600)
COMFYUI_MULTI_DEVICE_WEIGHT_BASE   map | pin: how a checkpoint's read-only base is held (default map)
COMFYUI_MULTI_DEVICE_RENDEZVOUS    HOST:PORT where worker processes (and other servers) meet rank 0
                                   (default 127.0.0.1 on a port the system picks); without remote
                                   ranks every listener stays on 127.0.0.1 whatever HOST says
COMFYUI_MULTI_DEVICE_REMOTE_RANKS  DiT ranks on other servers that join rank 0's pool (default 0;
                                   above 0 needs a fixed RENDEZVOUS port and the cluster secret)
COMFYUI_MULTI_DEVICE_SECRET_FILE   a file holding the cluster secret that ranks of other servers
                                   prove (the same file on every server; or the secret itself in
                                   COMFYUI_MULTI_DEVICE_SECRET)
COMFYUI_MULTI_DEVICE_TRUSTED_MODULES
                                   Python modules (comma-separated; a package trusts its
                                   submodules) whose functions and classes a worker process may
                                   use when rank 0 names them, besides the ones this project
                                   registered (default none; tests' stand-ins)

Set by torchrun for each process it starts: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT (checked, TorchrunEnvError) and LOCAL_WORLD_SIZE.

Read, not checked (other programs own them): the visible-devices variables of each card kind
(ASCEND_RT_VISIBLE_DEVICES, ASCEND_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES), a collective
library's path override (HCCL_SO_PATH, NCCL_SO_PATH), and what the doctor shows. Read where
they are used: the libraries' buffer sizes for the memory plan (HCCL_BUFFSIZE, NCCL_BUFFSIZE,
NCCL_MAX_NCHANNELS: roles/communicator_memory.py) and their error handling, which ComfyUI's
process sets before it makes a process group (TORCH_NCCL_ASYNC_ERROR_HANDLING,
HCCL_ASYNC_ERROR_HANDLING, HCCL_EXEC_TIMEOUT: comm/async_errors.py). XDG_CACHE_HOME places the
per-user cache folder (`user_cache_dir`), as other programs on Linux do.

Every bad value raises SettingError worded as an environment-variable error: the variable, the
value, what is wrong and what to set instead. The command line and the node call these same
functions, so each value is refused the same way everywhere.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BACKEND_ENV = "COMFYUI_MULTI_DEVICE_BACKEND"
TIMEOUT_ENV = "COMFYUI_MULTI_DEVICE_TIMEOUT_S"
RUN_TIMEOUT_ENV = "COMFYUI_MULTI_DEVICE_RUN_TIMEOUT_S"
WEIGHT_BASE_ENV = "COMFYUI_MULTI_DEVICE_WEIGHT_BASE"
RENDEZVOUS_ENV = "COMFYUI_MULTI_DEVICE_RENDEZVOUS"
REMOTE_RANKS_ENV = "COMFYUI_MULTI_DEVICE_REMOTE_RANKS"
TRUSTED_MODULES_ENV = "COMFYUI_MULTI_DEVICE_TRUSTED_MODULES"
VALID_BACKENDS = ("auto", "hccl", "nccl", "peer")
MULTI_DEVICE_ENV_VARS = (BACKEND_ENV, TIMEOUT_ENV, RUN_TIMEOUT_ENV, WEIGHT_BASE_ENV, RENDEZVOUS_ENV,
                         REMOTE_RANKS_ENV, TRUSTED_MODULES_ENV)
WEIGHT_BASE_MODES = ("map", "pin")  # read-only shared mapping (default) | anonymous RAM
# The variable that decides which physical cards a process sees, per kind (and Ascend's
# container-level one, shown beside it).
VISIBLE_DEVICES_ENV = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}
ASCEND_VISIBLE_DEVICES_ENV = "ASCEND_VISIBLE_DEVICES"
# torchrun sets these for every process it starts (and LOCAL_WORLD_SIZE, the processes per machine).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"


DEFAULT_TIMEOUT_S = 600.0  # a rank may load weights for minutes before its first collective
MAX_TIMEOUT_S = 86_400.0   # one day: a rank that waits longer is stuck, not slow
# The run watchdog: a sampling step calls a collective in every block (seconds apart even at
# 768p 15 s), and weights load before the first one; an hour with no rank returning and none
# reaching a collective is a stuck run, not a slow one.
DEFAULT_RUN_TIMEOUT_S = 3600.0
# Plain ASCII decimals only: float() also takes "nan", "inf", "1_0" and non-ASCII digits.
_DECIMAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")


class SettingError(ValueError):
    """An environment variable or option has a bad value; the message names it and the fix."""


def env_error(name: str, raw: str, problem: str, fix: str) -> SettingError:
    return SettingError(f"environment variable {name}={raw!r} {problem}; {fix}")


def backend_from_env(value: str | None = None) -> str:
    """The backend name of an option/input `value`, else of COMFYUI_MULTI_DEVICE_BACKEND."""
    if value is not None:
        if not isinstance(value, str) or value.strip().lower() not in VALID_BACKENDS:
            raise SettingError(f"unknown multi-device backend {value!r}; valid values: "
                               f"{', '.join(VALID_BACKENDS)}")
        return value.strip().lower()
    return _choice_from_env(BACKEND_ENV, VALID_BACKENDS, "backend")


def _choice_from_env(name: str, choices: tuple[str, ...], what: str, meaning: str = "") -> str:
    """The variable `name` as one of `choices` (case and blanks ignored), else the first choice."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower() or choices[0]
    if value not in choices:
        raise env_error(name, raw, f"is not a {what}",
                        f"set it to one of {', '.join(choices)}{meaning}, or unset it for {choices[0]}")
    return value


def seconds_problem(text: str) -> tuple[float | None, str | None]:
    """(seconds, None) for a valid timeout written as text, else (None, what is wrong)."""
    if not _DECIMAL.fullmatch(text.strip()):
        return None, "is not a number of seconds (plain digits, e.g. 600)"
    value = float(text)
    if value <= 0:
        return None, "must be more than 0 seconds"
    if value > MAX_TIMEOUT_S:
        return None, f"is above the limit of {MAX_TIMEOUT_S:g} seconds (one day)"
    return value, None


def check_timeout(value, where: str = "timeout_s") -> float:
    """A timeout given as a number (an argument, not text): finite, > 0, at most a day."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_TIMEOUT_S:
        raise SettingError(f"{where}={value!r}: must be a number of seconds above 0 and at most "
                           f"{MAX_TIMEOUT_S:g}")
    return float(value)


def _seconds_from_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value, problem = seconds_problem(raw)
    if problem:
        raise env_error(name, raw, problem,
                        f"set it to seconds above 0 and at most {MAX_TIMEOUT_S:g}, or unset it for "
                        f"the default {default:g}")
    return value


def timeout_from_env() -> float:
    return _seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def run_timeout_from_env() -> float:
    return _seconds_from_env(RUN_TIMEOUT_ENV, DEFAULT_RUN_TIMEOUT_S)


def weight_base_from_env(value: str | None = None) -> str:
    """The weight base mode: `value` if given, else COMFYUI_MULTI_DEVICE_WEIGHT_BASE, else "map"."""
    meaning = "map: the file's page cache, read-only; pin: a private copy in RAM, for NFS"
    if value is not None:
        mode = value.strip().lower() if isinstance(value, str) else None
        if mode not in WEIGHT_BASE_MODES:
            raise SettingError(f"mode={value!r} is not a weight base mode; use one of "
                               f"{', '.join(WEIGHT_BASE_MODES)} ({meaning})")
        return mode
    return _choice_from_env(WEIGHT_BASE_ENV, WEIGHT_BASE_MODES, "weight base mode", f" ({meaning})")


def parse_rendezvous(text: str) -> tuple[str, int] | None:
    """(host, port) of "HOST:PORT" (port 0: the system picks one), or None when malformed."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")  # an IPv6 address in brackets
    if not sep or not host or not port.isascii() or not port.isdigit() or int(port) > 65535:
        return None
    return host, int(port)


def rendezvous_from_env() -> tuple[str, int]:
    """Where rank 0's worker pools meet their workers: COMFYUI_MULTI_DEVICE_RENDEZVOUS, else
    loopback on a port the system picks."""
    raw = os.environ.get(RENDEZVOUS_ENV, "")
    if not raw.strip():
        return "127.0.0.1", 0
    parsed = parse_rendezvous(raw)
    if parsed is None:
        raise env_error(RENDEZVOUS_ENV, raw, "is not HOST:PORT",
                        "set it to this server's address as the other servers reach it and a free "
                        "port, e.g. 10.0.0.1:29600, or unset it for loopback")
    return parsed


def remote_ranks_from_env() -> int:
    """COMFYUI_MULTI_DEVICE_REMOTE_RANKS: DiT ranks on other servers (default 0); above 0 it
    needs a fixed rendezvous port, the one their join command names."""
    raw = os.environ.get(REMOTE_RANKS_ENV, "")
    text = raw.strip()
    if not text:
        return 0
    if not (text.isascii() and text.isdigit()) or int(text) > 4096:
        raise env_error(REMOTE_RANKS_ENV, raw, "is not a number of ranks (0 to 4096)",
                        "set it to how many DiT ranks the other servers run, or unset it for 0")
    count = int(text)
    if count and rendezvous_from_env()[1] == 0:
        raise env_error(REMOTE_RANKS_ENV, raw, "needs a fixed rendezvous port the other servers can reach",
                        f"set {RENDEZVOUS_ENV}=ADDRESS:PORT too (this server's address, e.g. "
                        "10.0.0.1:29600), or unset it for ranks on this server only")
    return count


def trusted_modules_from_env() -> tuple[str, ...]:
    """COMFYUI_MULTI_DEVICE_TRUSTED_MODULES: dotted module names (default none)."""
    raw = os.environ.get(TRUSTED_MODULES_ENV, "")
    names = tuple(name.strip() for name in raw.split(",") if name.strip())
    bad = [n for n in names if not all(part.isidentifier() for part in n.split("."))]
    if bad:
        raise env_error(TRUSTED_MODULES_ENV, raw, f"names {bad}, which are no Python module names",
                        "list dotted module names separated by commas (e.g. tests.upstream.standins), "
                        "or unset it")
    return names


def check_environment(backend: bool = True) -> None:
    """Raise SettingError for the first bad multi-device variable (before anything is built).
    `backend=False` leaves COMFYUI_MULTI_DEVICE_BACKEND out (an option given instead wins)."""
    if backend:
        backend_from_env()
    timeout_from_env()
    run_timeout_from_env()
    weight_base_from_env()
    remote_ranks_from_env()  # reads the rendezvous too
    trusted_modules_from_env()


def read_variables(names=(), prefixes: tuple[str, ...] = ()) -> dict[str, str | None]:
    """The values of `names` (None where unset) and of every set variable whose name starts
    with one of `prefixes`: what the doctor and the device inventory report, as they are."""
    values = {name: os.environ.get(name) for name in names}
    if prefixes:
        values.update({k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)})
    return values


def read_visible_devices() -> dict[str, str | None]:
    """Every visible-devices variable, by name (None where unset)."""
    return read_variables(sorted({*VISIBLE_DEVICES_ENV.values(), ASCEND_VISIBLE_DEVICES_ENV}))


def library_path(env_var: str, default: str) -> str:
    """A collective library's path: the variable `env_var` when set and not empty, else `default`."""
    return os.environ.get(env_var) or default


CACHE_HOME_ENV = "XDG_CACHE_HOME"
CACHE_FOLDER = "minimax-h3-multinpu"  # the project's name (pyproject.toml)


def user_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """This project's per-user cache folder, outside any checkout: $XDG_CACHE_HOME/<project>,
    else ~/.cache/<project> (a relative XDG_CACHE_HOME is ignored, as the XDG rule says)."""
    environ = os.environ if environ is None else environ
    home = environ.get(CACHE_HOME_ENV, "")
    base = Path(home) if os.path.isabs(home) else Path(environ.get("HOME") or Path.home()) / ".cache"
    return base / CACHE_FOLDER


# ----------------------------------------------------------------------------- torchrun

class TorchrunEnvError(SettingError):
    """The torchrun environment variables are missing or malformed."""


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when this process was started by torchrun (its rank variables are set)."""
    environ = os.environ if environ is None else environ
    return all(name in environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def read_torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv:
    environ = os.environ if environ is None else environ
    missing = [name for name in TORCHRUN_ENV if not environ.get(name)]
    if missing:
        raise TorchrunEnvError(
            f"environment variable(s) {', '.join(missing)} not set: start this program with "
            "torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), "
            "or set them yourself")
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        text = environ[name].strip()
        if not (text.isascii() and text.isdigit()):  # int() would also take "٣", "1_0", "-1"
            raise TorchrunEnvError(f"environment variable {name}={environ[name]!r} is not an integer "
                                   "(the digits 0-9); torchrun sets it, or set it yourself")
        values[name] = int(text)
    if values["WORLD_SIZE"] < 1 or not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise TorchrunEnvError(f"environment variable RANK={values['RANK']} must be in [0, "
                               f"WORLD_SIZE={values['WORLD_SIZE']}); give each process its own rank")
    if not 0 < values["MASTER_PORT"] < 65536:
        raise TorchrunEnvError(f"environment variable MASTER_PORT={values['MASTER_PORT']} is not a "
                               "TCP port; use a free port from 1 to 65535")
    return TorchrunEnv(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"],
                       environ["MASTER_ADDR"], values["MASTER_PORT"])


def local_world_size(default: int) -> int:
    """The processes torchrun started on this machine (LOCAL_WORLD_SIZE), else `default`."""
    return int(os.environ.get(LOCAL_WORLD_SIZE_ENV, default))
