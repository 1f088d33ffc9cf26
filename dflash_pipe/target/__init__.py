"""The target side of stage 1: load a frozen target LLM and compute packed, per-document-exact features.

Public API:
  load_target(model, *, device, dtype, ...) -> TargetBundle
  TargetRunner(bundle, layer_ids, topk=32, linear_attn_kernels="auto", logits_chunk=2048).run(ids, doc_lens)
  standalone_features(bundle, input_ids_T, layer_ids, topk=0) -> TargetOutput   (reference)
  default_target_layer_ids(n, L), validate_layer_ids(ids, L), LAYER_ID_CONVENTION
  read_embeddings_and_head(model_dir), save_embeddings_and_head(bundle, out_dir)
  weights_fingerprint_files(paths), weights_fingerprint_tensors(named, extra)
"""

from .fingerprint import weights_fingerprint_files, weights_fingerprint_tensors
from .heads import EmbeddingsAndHead, read_embeddings_and_head, save_embeddings_and_head
from .layers import LAYER_ID_CONVENTION, default_target_layer_ids, validate_layer_ids
from .loading import TargetBundle, load_target
from .presets import PRESETS, preset_config
from .runner import TargetOutput, TargetRunner, standalone_features

__all__ = [
    "EmbeddingsAndHead", "LAYER_ID_CONVENTION", "PRESETS", "TargetBundle", "TargetOutput", "TargetRunner",
    "default_target_layer_ids", "load_target", "preset_config", "read_embeddings_and_head",
    "save_embeddings_and_head", "standalone_features", "validate_layer_ids", "weights_fingerprint_files",
    "weights_fingerprint_tensors",
]
