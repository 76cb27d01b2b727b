"""Is a scorer's model folder the kind its scorer needs? A reward model is a *ForSequenceClassification
checkpoint with its trained score head; a causal LM loaded as one gets a head initialised at random
(transformers' load report is the only hint) and the run would train on noise. A judge is a chat
model; a classifier loaded as one has no trained LM head. Read before any weights load, from
config.json's `architectures` and the names in the safetensors index or headers (cheap: a JSON
file, or each file's first bytes), so the recipe check refuses it for every backend that loads the
folder (hf, and SGLang servers launched here); torch-free. After a load, `load_report_problem`
reads transformers' own report (a hub id's folder is not local before its download)."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable, Optional

# The heads of transformers' *ForSequenceClassification classes: `score` for decoder LMs (Llama, Qwen2 /
# Qwen3, Mistral, Gemma, the generic class), `classifier` for encoders (BERT, RoBERTa, DeBERTa).
HEAD_NAMES = ("score", "classifier")
GENERATION_CLASSES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")  # suffixes of architectures
CLASSIFIER_CLASSES = ("ForSequenceClassification", "ForRewardModel")
MAX_HEADER = 100_000_000  # safetensors' own bound on a header's bytes
NEEDED = {"reward_model": "a reward model is a *ForSequenceClassification checkpoint with its trained score head "
                          "(a chat model scores as kind=judge)",
          "judge": "a judge generates its answer: a chat model (*ForCausalLM); this one scores as kind=reward_model"}


def scorer_folder_problem(key: str, path: str, kind: str) -> Optional[str]:
    """One line naming `key` when the local folder `path` is not the kind of model `kind` needs, else
    None (also when it cannot tell: no config.json, weights not in safetensors)."""
    folder = Path(path).expanduser()
    architectures = _architectures(folder)
    named = ", ".join(architectures)
    if kind == "reward_model":
        if architectures and all(a.endswith(GENERATION_CLASSES) for a in architectures):
            return (f"{key}.path={path} is a causal LM ({named}): it has no score head, so transformers would add "
                    f"one initialised at random and the reward would be noise; {NEEDED[kind]}")
        names = _weight_names(folder)
        if names is not None and not any(_is_head(n) for n in names):
            return (f"{key}.path={path}: its weights hold no score head (no {' / '.join(h + '.*' for h in HEAD_NAMES)} "
                    f"tensor{f'; config.json says {named}' if named else ''}), so transformers would initialise one "
                    f"at random; {NEEDED[kind]}")
    elif kind == "judge" and any(a.endswith(CLASSIFIER_CLASSES) for a in architectures):
        return f"{key}.path={path} is a reward model ({named}), not a chat model: {NEEDED[kind]}"
    return None


def load_report_problem(key: str, path: str, kind: str, missing: Iterable[str],
                        unexpected: Iterable[str]) -> Optional[str]:
    """The same verdict from transformers' loading info (from_pretrained(..., output_loading_info=True)):
    a reward model whose head was missing from the weights, a judge whose weights carry a classifier's."""
    if kind == "reward_model" and any(_is_head(n) for n in missing):
        return (f"{key}.path={path}: the weights have no score head ({', '.join(sorted(missing))} initialised at "
                f"random); {NEEDED[kind]}")
    if kind == "judge" and any(_is_head(n) for n in unexpected):
        return f"{key}.path={path} is a reward model (its weights hold a score head), not a chat model: {NEEDED[kind]}"
    return None


def _is_head(name: str) -> bool:
    return name.split(".", 1)[0] in HEAD_NAMES


def _architectures(folder: Path) -> list[str]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    found = config.get("architectures") if isinstance(config, dict) else None
    return [a for a in found if isinstance(a, str)] if isinstance(found, list) else []


def _weight_names(folder: Path) -> Optional[list[str]]:
    """The tensor names of the folder's safetensors weights (the index's map, else every file's
    header); None when there are none or one cannot be read."""
    try:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            return list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            return None
        names: list[str] = []
        for file in files:
            with open(file, "rb") as handle:  # 8 bytes little-endian header length, then the JSON header
                (length,) = struct.unpack("<Q", handle.read(8))
                if length > MAX_HEADER:
                    return None
                names += [n for n in json.loads(handle.read(length)) if n != "__metadata__"]
        return names
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
