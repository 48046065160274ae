"""Device names (R1.4): the one place a config's device name becomes something torch uses.

A config names ``cpu``, ``cuda:N`` or ``rocm:N``; GPU indices are the ordinals of the devices
this process can see (``CUDA_VISIBLE_DEVICES``, a Kubernetes device plugin's allocation),
never host ids. ROCm builds of torch address AMD GPUs through the ``cuda`` device API, so both
vendors' names become ``cuda:N`` for torch.

Only the two functions at the end need a real GPU (what the machine has, how much memory is
free); everything else runs on the CPU in the test suite, and ``bench/gpu_check`` runs those
two on a machine that has a GPU.
"""

from __future__ import annotations

import re

PLATFORMS = ("cpu", "cuda", "rocm")
_DEVICE = re.compile(r"^(cpu|cuda|rocm)(?::(\d{1,3}))?$")


def parse_device(text: str) -> tuple[str, int | None]:
    """``cpu`` | ``cuda:N`` | ``rocm:N`` -> (platform, index); ValueError names what is wrong."""
    m = _DEVICE.match(text)
    if not m:
        raise ValueError(f"device must be 'cpu', 'cuda:N' or 'rocm:N', got {text!r}")
    platform, index = m.group(1), m.group(2)
    if platform == "cpu" and index is not None:
        raise ValueError(f"device 'cpu' takes no index, got {text!r}")
    if platform != "cpu" and index is None:
        raise ValueError(f"device {text!r} needs an index ({platform}:0)")
    return platform, None if index is None else int(index)


def is_gpu(text: str) -> bool:
    return parse_device(text)[0] != "cpu"


def torch_device(text: str) -> str:
    """The torch device for a config device name: ``cpu``, or ``cuda:N`` for both vendors."""
    platform, index = parse_device(text)
    return "cpu" if platform == "cpu" else f"cuda:{index}"


# -- the calls that need a real GPU ---------------------------------------------------------

def gpu_free_bytes(text: str) -> int:
    """Free memory of a GPU device, in bytes, as its driver reports it."""
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(torch_device(text)))
    return int(free)


def visible_devices() -> dict[str, int]:
    """Devices this process can see, by platform (GPU indices are allocation ordinals)."""
    out = {"cpu": 1}
    try:
        import torch

        if torch.cuda.is_available():
            platform = "rocm" if getattr(torch.version, "hip", None) else "cuda"
            out[platform] = torch.cuda.device_count()
    except Exception:  # a broken GPU stack means no GPUs, not a crash
        pass
    return out
