"""Stage 2's model: the DFlash drafter, its attention mask and paths, loss/metrics and export.

Public API (see each module's docstring):
  config.py    DrafterModelConfig, derive_drafter_config
  masks.py     AttentionMask, block_positions
  attention.py attend, lock_compilation, unlock_compilation, compilation_unlocked
  grouped.py   the 'sdpa-grouped' path's key layout (set_group_blocks)
  model.py     DFlashDrafter
  loss.py      draft_loss, KDTargets, gather_kd_targets, default_gamma, summarize_metrics
  export.py    export_drafter, load_exported_drafter
"""

from .attention import attend, compilation_unlocked, lock_compilation, unlock_compilation
from .config import DrafterModelConfig, derive_drafter_config
from .export import export_drafter, load_exported_drafter
from .loss import KDTargets, default_gamma, draft_loss, gather_kd_targets, summarize_metrics
from .masks import AttentionMask, block_positions
from .model import DFlashDrafter

__all__ = [
    "AttentionMask", "DFlashDrafter", "DrafterModelConfig", "KDTargets", "attend", "block_positions",
    "compilation_unlocked", "default_gamma", "derive_drafter_config", "draft_loss", "export_drafter",
    "gather_kd_targets", "load_exported_drafter", "lock_compilation", "summarize_metrics", "unlock_compilation",
]
