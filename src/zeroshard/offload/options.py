"""``ZeroConfig``'s disk offload options: ``offload_dir`` and ``sub_group_size`` checked,
and DeepSpeed's ``offload_optimizer``/``offload_param`` sections read."""

from __future__ import annotations

import tempfile
from pathlib import Path


def check_disk(config) -> None:
    """``offload_dir`` and ``sub_group_size``: one line naming what cannot be used."""
    n = config.sub_group_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"sub_group_size={n!r} must be an integer >= 1 (elements of the "
                         "optimizer partition stepped at once)")
    where = config.offload_dir
    if where is None:
        return
    if not isinstance(where, (str, Path)) or not str(where):
        raise ValueError(f"offload_dir={where!r}; expected the path of a writable directory")
    if not config.offload:
        raise ValueError(f"offload_dir={str(where)!r} keeps the offloaded optimizer state on "
                         "disk, but offload=None: set offload='optimizer' (or 'params')")
    path = Path(where)
    if not path.exists():
        raise ValueError(f"offload_dir={str(where)!r} does not exist; expected an existing "
                         "writable directory")
    if not path.is_dir():
        raise ValueError(f"offload_dir={str(where)!r} is not a directory; expected an "
                         "existing writable directory")
    try:  # the file system's answer, not the permission bits (root passes os.access)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"offload_dir={str(where)!r} is not writable ({exc.strerror or exc});"
                         " expected an existing writable directory") from None
    object.__setattr__(config, "offload_dir", str(where))


def deepspeed_offload(zero: dict) -> dict:
    """``offload``/``offload_dir`` from DeepSpeed's ``offload_optimizer`` and
    ``offload_param`` sections: device "cpu" is host memory, "nvme" files under
    ``nvme_path`` (the optimizer's only), "none" or no section is no offload."""
    out = {}
    for section, mode in (("offload_optimizer", "optimizer"), ("offload_param", "params")):
        block = zero.get(section)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ValueError(f"zero_optimization.{section}={block!r} must be a JSON object")
        device = block.get("device", "none")
        if device not in ("none", "cpu", "nvme") or (device == "nvme" and mode == "params"):
            accepted = "'none', 'cpu' or 'nvme'" if mode == "optimizer" else "'none' or 'cpu'"
            raise ValueError(f"zero_optimization.{section}.device={device!r}; expected "
                             f"{accepted}")
        if device == "none":
            continue
        out["offload"] = mode
        if device == "nvme":
            if "nvme_path" not in block:
                raise ValueError(f"zero_optimization.{section}.device='nvme' needs nvme_path "
                                 "(the directory the optimizer state is written to)")
            out["offload_dir"] = block["nvme_path"]
    return out
