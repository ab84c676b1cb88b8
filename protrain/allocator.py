"""CUDA's caching allocator at start-up: expandable segments unless the user configured it.

Long sequences fragment the caching allocator: activations of many sizes come and go at every
step (and swap, checkpoint and chunk buffers interleave with them), and a free gap in one
fixed-size segment cannot serve a request larger than the gap, so reserved memory grows past
what is live and a plan that fits the allocated bytes can still run out of memory. Expandable
segments (``expandable_segments:True``) grow one segment's mapping in place instead, so freed
memory is reused whatever the request sizes; the memory model's margin covers what remains.

The engines call ``choose_allocator`` once at start-up, before they allocate on the device, and
print the line it returns. A user's setting wins, whatever its value: ``PYTORCH_ALLOC_CONF``
(torch's name since 2.9), ``PYTORCH_CUDA_ALLOC_CONF`` (the older one, still read) or
``PYTORCH_HIP_ALLOC_CONF`` in the environment, or settings the script made itself. Without CUDA
nothing happens. This is the only file that sets the allocator.
"""
from __future__ import annotations

import os

import torch

USER_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
"""The environment variables torch reads its allocator settings from: any of them set means the
user chose."""

EXPANDABLE = "expandable_segments:True"


def choose_allocator() -> str | None:
    """Choose expandable segments for CUDA's caching allocator unless the user configured it,
    and return the start-up line that says which (None without CUDA: nothing to choose)."""
    if not torch.cuda.is_available():
        return None
    for name in USER_VARIABLES:
        if name in os.environ:
            return (f"ProTrain: CUDA allocator as {name}={os.environ[name]!r} sets it (the user's "
                    f"setting, left as it is)")
    current = _allocator_settings()
    if current and current != EXPANDABLE:
        return f"ProTrain: CUDA allocator as the script set it ({current!r}, left as it is)"
    try:
        _set_allocator_settings(EXPANDABLE)
    except RuntimeError as e:          # a build or platform without the option
        return (f"ProTrain: CUDA allocator left as it is: torch refused {EXPANDABLE} ({e}); the "
                f"memory margin covers its fragmentation")
    return (f"ProTrain: CUDA allocator set to expandable segments ({EXPANDABLE}): long sequences "
            f"fragment fixed-size segments; the memory margin covers what remains. Set "
            f"PYTORCH_ALLOC_CONF (or PYTORCH_CUDA_ALLOC_CONF) to choose yourself")


def _set_allocator_settings(settings: str) -> None:
    # Why a call and not the environment variable: torch reads PYTORCH_ALLOC_CONF once, when
    # its allocator configuration is first used (by then torch is imported and DeepSpeed or
    # Megatron has usually touched the device), and never again, so setting os.environ here
    # would do nothing. The call updates the same configuration at any time; the caching
    # allocator reads expandable_segments whenever it creates a segment, so every segment
    # from now on is expandable and only those reserved before keep their fixed size - hence
    # the engines call this before they allocate. torch 2.13 deprecates
    # torch.cuda.memory._set_allocator_settings (a FutureWarning) in favour of this function,
    # which it forwards to; the fallback is for a torch that moves it again.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


def _allocator_settings() -> str:
    """The settings torch holds now ("" where none were given, or this torch cannot say)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return getter() if getter is not None else ""
