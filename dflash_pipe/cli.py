"""`dflash-pipe` command line. Each command is a thin shell over one stage module.

Exit codes: 0 ok, 2 usage (bad flag/manifest key), 3 validation (cache/config mismatch, corrupt
data), 4 runtime failure, 130 interrupted. See errors.py.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from .cli_options import config_command
from .config import RunConfig
from .errors import DFlashError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Train DFlash drafters from an offline target-feature cache.")
cache_app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, help="Inspect and verify a feature cache.")
app.add_typer(cache_app, name="cache")


def _echo_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


@config_command(app, "extract", own=("extract",), others=("target", "data"))
def extract_cmd(cfg: RunConfig):
    """Stage 1: run the target once and write hidden states + top-k log-probs to a sharded Parquet cache."""
    from .interrupts import sigterm_as_interrupt

    with sigterm_as_interrupt():  # SIGTERM stops it as Ctrl-C does: committed shards kept, exit 130
        from .extract.pipeline import run_extract

        s = run_extract(cfg)
    typer.echo(f"extract: cache {s.cache_dir} ({s.status}); shards written {s.shards_done}, "
               f"already committed {s.shards_skipped}; {s.tokens} tokens in {s.seconds:.1f}s"
               + (f" = {s.tokens / s.seconds:,.0f} tok/s" if s.seconds else ""))
    if s.shards_done:
        typer.echo(f"extract: bottleneck: {s.bottleneck}")
    if cfg.extract.max_cache_gib > 0:
        typer.echo(f"extract: disk budget {cfg.extract.max_cache_gib:g} GiB; {s.space_wait_s:.1f}s waiting for the "
                   "window trainer to free space")
    if s.reextracted_consumed:
        typer.echo(f"extract: re-extracted shards {s.reextracted_consumed} that a finished window run had consumed")
    typer.echo("extract: manifest.json " + ("written, cache complete" if s.complete else
                                            "not yet written (other shards are still missing)"))


@config_command(app, "train", own=("train",), others=("drafter",))
def train_cmd(cfg: RunConfig):
    """Stage 2: train a DFlash drafter on a feature cache (torchrun for data parallel)."""
    from .train.trainer import run_train

    run_train(cfg)


@config_command(app, "plan", own=(), others=("target", "data", "extract", "drafter", "train", "eval"))
def plan_cmd(cfg: RunConfig, as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """Print what a pipeline run would do, on which devices, and whether stage 1 is needed."""
    from .plan import make_plan

    plan = make_plan(cfg)
    typer.echo(plan.to_json() if as_json else plan.describe())


@config_command(app, "eval", own=("eval",), others=("target", "data", "train"))
def eval_cmd(cfg: RunConfig):
    """Real greedy speculative decoding with target + drafter (and a prompt-lookup baseline)."""
    from .interrupts import sigterm_as_interrupt

    with sigterm_as_interrupt():  # SIGTERM stops it as Ctrl-C does: its progress log kept, exit 130
        from .eval.runner import run_eval

        run_eval(cfg)


@config_command(app, "regenerate", own=("data",), others=("target",))
def regenerate_cmd(cfg: RunConfig, output: Path = typer.Option(..., "--output", "-o",
                                                                help="JSONL file of regenerated conversations."),
                   max_new_tokens: int = typer.Option(512, help="Tokens generated per response."),
                   batch_size: int = typer.Option(0, help="Sequences decoded together (0 = auto: 16 on the CPU, "
                                                          "up to 1024 on CUDA as memory allows; halved on OOM)."),
                   device: str = typer.Option("auto", help="'auto', 'cpu' or 'cuda'."),
                   max_turns: int = typer.Option(0, help="Regenerate at most this many assistant turns per "
                                                         "conversation (0 = all, turn by turn)."),
                   max_length: int = typer.Option(0, help="Longest conversation kept, prompts + answers, in tokens "
                                                          "(0 = the manifest's [extract] max_length; extraction "
                                                          "cuts there, so pass it the same value)."),
                   samples: int = typer.Option(1, help="Answers per conversation (ids <id>#0..; needs "
                                                       "--temperature > 0 when > 1)."),
                   temperature: float = typer.Option(0.0, help="Sampling temperature (0 = greedy)."),
                   top_p: float = typer.Option(1.0, help="Nucleus sampling: keep the smallest set of tokens "
                                                         "holding this probability, in (0, 1]."),
                   seed: int = typer.Option(0, help="Sampling seed; an answer depends on (seed, id, turn) only."),
                   greedy_after: int = typer.Option(0, help="Sample only the first K tokens of each answer (with "
                                                            "--temperature / --top-p), then continue greedily: "
                                                            "diverse answers whose later tokens are the target's "
                                                            "own greedy choices (0 = sample every token)."),
                   engine: str = typer.Option("auto", help="'auto' (static-KV engine where the target allows, "
                                                           "else HF generate), 'static' or 'hf'."),
                   engine_attention: str = typer.Option("auto", help="The static-KV engine's decode attention: "
                                                        "'auto' (per-row lengths, a Triton kernel, on CUDA in bf16 / "
                                                        "fp16 at large batch; else SDPA), 'rows' or 'sdpa'."),
                   reuse_history: bool = typer.Option(False, help="Static-KV engine, several turns: a finished "
                                                      "answer's row keeps its K/V and the conversation's next turn "
                                                      "prefills only its new tokens (the same answers up to "
                                                      "rounding; eval/regen_backends.py)."),
                   overlap_prefill: bool = typer.Option(False, help="Static-KV engine on CUDA: prefill waiting "
                                                        "prompts on a second stream under the decode and collect "
                                                        "answers a step before a launch ends, so neither "
                                                        "stops the decode (the same output; "
                                                        "eval/regen_staging.py)."),
                   compact_tail: bool = typer.Option(False, help="Static-KV engine: once no prompt waits, move the "
                                                     "live rows together and run the steps on batch/2, /4 or /8 "
                                                     "rows (the same output; not with --reuse-history)."),
                   first_sample: int = typer.Option(0, help="Number the samples from K (ids <id>#K..): more "
                                                       "answers per prompt in a new file, each equal to what a "
                                                       "run with more --samples writes for that id."),
                   max_seconds: float = typer.Option(0.0, help="Stop admitting conversations this many seconds "
                                                     "after the start and finish the ones in flight (0 = no "
                                                     "limit): the output is a prefix of the input, none of its "
                                                     "work lost as a kill loses it; a rerun continues it."),
                   prefetch_prompts: bool = typer.Option(True, help="Read conversations ahead and tokenize their "
                                                         "first prompts on a worker thread while the device "
                                                         "decodes (the same output; eval/regen_turns.py)."),
                   prefill_layout: str = typer.Option("auto", help="Static-KV engine: prefill new prompts as "
                                                      "'chunks' (16-token chunks, no padding to the longest "
                                                      "prompt), 'padded' (one padded call per length bucket) or "
                                                      "'auto' (chunks on CUDA in bf16 / fp16); the same answers "
                                                      "up to rounding (target/chunked_prefill.py)."),
                   steps_per_launch: int = typer.Option(8, help="Static-KV engine: decode steps queued per launch; "
                                                        "finished answers are read and their slots refilled "
                                                        "once per launch."),
                   collect_early: int = typer.Option(-1, help="Static-KV engine: read finished answers from a "
                                                     "copy of the state taken K steps before a launch ends, so "
                                                     "the host's work between launches overlaps the last steps "
                                                     "(-1 = 1 on CUDA, 0 on the CPU; at most --steps-per-launch: "
                                                     "the copy as the launch starts; the same output)."),
                   lookup_draft: int = typer.Option(-1, help="Static-KV engine: draft K tokens a row from its own "
                                                    "prompt and answer so far (prompt lookup) and verify them in "
                                                    "every decode step, keeping those the target would have "
                                                    "chosen (0 = off; -1 = auto: 2 for greedy answers on CUDA, "
                                                    "1.23x on the H100, else off: sampled answers 0.86x; "
                                                    "the same output up to rounding; "
                                                    "not with --overlap-prefill / --compact-tail; "
                                                    "eval/regen_lookup.py)."),
                   lookup_shared: bool = typer.Option(True, help="With --lookup-draft: draft also from an n-gram "
                                                      "table all rows share, where it holds a longer match than "
                                                      "the row's own history (eval/regen_ngram_table.py); "
                                                      "--no-lookup-shared: the row's own history only.")):
    """Regenerate the assistant turns with the target itself (drafters must learn the target's outputs)."""
    from .errors import UsageError
    from .eval.regenerate import run_regenerate
    from .interrupts import sigterm_as_interrupt

    if max_length < 0:
        raise UsageError(f"--max-length must be >= 0 (0 = the manifest's), got {max_length}")
    if max_length:
        cfg.extract.max_length = max_length
    with sigterm_as_interrupt():  # SIGTERM stops it as Ctrl-C does: written rows kept, a rerun continues, exit 130
        run_regenerate(cfg, output, max_new_tokens=max_new_tokens, batch_size=batch_size, device=device,
                       max_turns=max_turns, samples=samples, temperature=temperature, top_p=top_p, seed=seed,
                       engine=engine, attention=engine_attention, greedy_after=greedy_after,
                       reuse_history=reuse_history, overlap=overlap_prefill, compact=compact_tail,
                       max_seconds=max_seconds, first_sample=first_sample, prefetch_prompts=prefetch_prompts,
                       prefill_layout=prefill_layout, steps_per_launch=steps_per_launch,
                       collect_early=None if collect_early == -1 else collect_early,
                       lookup_draft=None if lookup_draft == -1 else lookup_draft, lookup_shared=lookup_shared)


@app.command("export")
def export_cmd(checkpoint: Path = typer.Argument(..., help="Training output dir or one checkpoint dir."),
               output: Path = typer.Option(..., "--output", "-o", help="Export directory (config.json + model.safetensors)."),
               with_modeling_code: bool = typer.Option(
                   False, "--with-modeling-code",
                   help="Also write modeling_dflash_pipe.py (torch + transformers only) and auto_map, so "
                        "AutoModel.from_pretrained(DIR, trust_remote_code=True) builds the drafter.")):
    """Write a trained drafter in the z-lab format that vLLM and SGLang load."""
    from .train.exporting import export_checkpoint

    typer.echo(f"exported to {export_checkpoint(checkpoint, output, with_modeling_code=with_modeling_code)}")


@cache_app.command("info")
def cache_info(cache_dir: str = typer.Argument(..., help="Cache directory or URI (s3://bucket/prefix, gs://, file://).")):
    """Print the manifest summary (fingerprint fields, features, totals) and, for a window run's cache, its
    held / retired / deleted / pending shards (also while extraction is still writing: no manifest yet).
    Exit 3 on a damaged spec or manifest."""
    from .cache import load_manifest, load_spec
    from .errors import CacheError
    from .cache.fs import open_cache_fs
    from .cache.manifest import MANIFEST_FILE
    from .cache.window import window_status

    cache_dir = open_cache_fs(cache_dir)

    spec = load_spec(cache_dir)  # refuses a damaged cache_spec.json, naming the fix
    window = window_status(cache_dir, spec) if spec is not None else None
    if window is not None and not cache_dir.exists(MANIFEST_FILE):
        _echo_json({k: spec[k] for k in ("fingerprint", "fingerprint_fields", "features", "num_shards",
                                         "tool_version") if k in spec} | {"complete": False, "window": window})
        return
    man = load_manifest(cache_dir)
    if spec is not None and spec["fingerprint"] != man["fingerprint"]:
        raise CacheError(f"{cache_dir}: cache_spec.json and manifest.json have different fingerprints",
                         "`dflash-pipe cache verify` lists the fix")
    _echo_json({k: man[k] for k in ("fingerprint", "fingerprint_fields", "features", "num_shards", "totals",
                                    "tool_version") if k in man}
               | {"data_stats": man.get("stats", {}).get("data_reader"),
                  "feature_rms_mean": man.get("stats", {}).get("feature_rms_mean"),
                  "fp8_error": man.get("stats", {}).get("fp8_error")}
               | ({"window": window} if window is not None else {}))


@cache_app.command("verify")
def cache_verify(cache_dir: str = typer.Argument(..., help="Cache directory or URI (s3://bucket/prefix, gs://, file://)."),
                 checksums: bool = typer.Option(True, "--checksums/--no-checksums", help="sha256 every shard."),
                 decode: bool = typer.Option(False, help="Decode every row (page CRCs, zstd frames)."),
                 recompute: int = typer.Option(0, help="Rerun K random samples through a plain HF forward and compare."),
                 device: str = typer.Option("auto", help="Device for --recompute.")):
    """Check every file of a cache (spec, manifest, sidecars, head file, shards); exit 3 naming each problem and its fix."""
    from .cache import verify_cache
    from .extract.recompute import check_recompute_args, recompute_check

    check_recompute_args(recompute, device)  # a usage error before minutes of checksums
    report = verify_cache(cache_dir, checksums=checksums, decode=decode)
    if recompute:
        report["recompute"] = recompute_check(cache_dir, recompute, device)
    _echo_json(report)


def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=os.environ.get("DFLASH_LOG", "INFO"), format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        # non-standalone typer returns an exit code instead of raising for Ctrl-C (130) and ctx.exit
        rv = app(args=argv, prog_name="dflash-pipe", standalone_mode=False)
        if isinstance(rv, int) and rv != 0:
            if rv == 130:
                typer.echo("interrupted: committed shards/checkpoints are kept; rerun the same command to resume",
                           err=True)
            sys.exit(rv)
    except DFlashError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted: committed shards/checkpoints are kept; rerun the same command to resume", err=True)
        sys.exit(130)
    except OSError as exc:  # one no stage turned into a RuntimeFailure (e.g. an unwritable --output-dir)
        from .io_utils import disk_error

        typer.echo(f"error: {disk_error(exc, Path(exc.filename or '?'), 'accessing')}", err=True)
        sys.exit(4)
    except Exception as exc:  # click's own exceptions (typer may vendor click, so match by shape)
        name = type(exc).__name__
        if name == "Abort":
            typer.echo("interrupted", err=True)
            sys.exit(130)
        if name == "Exit":
            sys.exit(getattr(exc, "exit_code", 0))
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            sys.exit(2 if "Usage" in name or "Option" in name or "Parameter" in name or "NoArgs" in name
                     else exc.exit_code)
        raise


if __name__ == "__main__":
    main()
