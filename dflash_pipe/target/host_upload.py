"""Small host-to-device copies without a host sync: regenerate's launch path (`runner_utils.to_device`).

Between two launches regenerate uploads a few small int64 tensors per prefill call (the prompts' tokens in
chunks, their rows, their sampling keys, the rows to reset). `host_long` builds such a tensor from an
`array('q')` buffer, 3-4x faster than `torch.tensor(list)` for 1-8 k ints (CPU box, session 35);
`upload` pins it and copies it asynchronously.

Measured and not kept (session 35, H100, SmolLM2 regenerate at batch 1,024): a ring of reused pinned blocks with an
event per block instead of pinning each upload. Per upload it cost 33.9 us against 20.7 for 80 ints and saved
351 us for 8 k ints, and regenerate ran at 0.995x with it (same process), so the simpler path stayed.
"""

from __future__ import annotations

from array import array

import torch


def host_long(values) -> torch.Tensor:
    """A host int64 tensor of a list / tuple / range of ints (a tensor: as it is, made int64). Through an
    `array('q')` buffer, which is several times faster than `torch.tensor(list)`; the same values, and the same
    ValueError for values int64 cannot hold."""
    if isinstance(values, torch.Tensor):
        return values.long()
    try:
        buf = array("q", values)
    except (TypeError, OverflowError):
        return torch.tensor(values, dtype=torch.long)   # the exact error torch gives for such values
    if len(buf) == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(buf, dtype=torch.long)       # shares `buf`, which the tensor keeps alive


def upload(x, device: torch.device) -> torch.Tensor:
    """A host list / tensor on `device` without a host sync: on CUDA through pinned memory and an async copy (the
    caching host allocator keeps the pinned block until the copy is done); lists become int64 tensors. Refused
    during CUDA graph capture, where the copy would be captured and read the freed block at every replay."""
    t = host_long(x) if not isinstance(x, torch.Tensor) else x
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("host-to-device upload during CUDA graph capture: copy into a static input instead")
    return t.pin_memory().to(device, non_blocking=True)
