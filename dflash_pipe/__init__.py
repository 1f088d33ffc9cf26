"""dflash-pipe: extract target features once, train DFlash drafters many times."""

__version__ = "0.1.0"

import os as _os

# The kernel-cache locations the user chose, read before anything imports torch._inductor: importing its config
# writes TORCHINDUCTOR_CACHE_DIR into os.environ (its default, /tmp/torchinductor_<user>), which would otherwise
# look like the user's own choice to dist.set_rank_cache_dirs and keep every rank on one shared inductor cache.
USER_KERNEL_CACHE_ENV = {k: _os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
