"""Warm starts (``init_from``): the global weights of another run's latest checkpoint copied into a new
run's initial model, or, for a decoupled run stopped before its first checkpoint, those of its syncer's
last commit (``<run>/syncer/``)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from atoll.errors import CheckpointError, ConfigError
from atoll.job.checkpoint import latest_checkpoint, load_checkpoint
from atoll.job.island import copy_flat_into


def load_init_weights(model: PreTrainedModel, run_dir: Path) -> None:
    """Copy the global weights of another run's latest checkpoint into ``model`` (a warm start); for a
    decoupled run stopped before its first checkpoint, those of its syncer's last commit.

    Raises:
        ConfigError: ``init_from`` holds no checkpoint or a model of another shape.
    """
    from safetensors.torch import load_file

    try:
        ckpt = latest_checkpoint(run_dir)
    except Exception:
        if _load_syncer_weights(model, run_dir):
            return
        raise ConfigError(f"init_from: '{run_dir}' holds no atoll checkpoint; "
                          "pass the --out folder of a finished run") from None
    if not (ckpt / "model").is_dir() and _load_syncer_weights(model, run_dir):  # a syncer's own folder
        return
    try:
        weights = load_file(str(ckpt / "model" / "model.safetensors"))
    except Exception as e:  # safetensors raises its own error type for damaged files
        raise ConfigError(f"init_from: cannot read the weights of '{ckpt}' ({type(e).__name__}); "
                          "pass a run whose checkpoint is intact") from None
    own = model.state_dict()
    mismatched = [k for k, v in weights.items() if k not in own or own[k].shape != v.shape]
    missing = [k for k in own if k not in weights and not k.endswith("lm_head.weight")]
    if mismatched or missing:
        raise ConfigError(f"init_from: the model in '{ckpt}' does not match --model/--vocab-size of this run "
                          f"({(mismatched + missing)[0]}); use the same model and vocabulary as that run")
    model.load_state_dict(weights, strict=False)
    model.tie_weights()


def _load_syncer_weights(model: PreTrainedModel, run_dir: Path) -> bool:
    """Copy the global model of a decoupled run's syncer checkpoint (``<run>/syncer/``, written at every
    commit; a Ray run killed before its own checkpoint leaves only that) into ``model``; False when there is
    none. The fragments' global parameters are put back in place with the same fragment layout the run used.

    Raises:
        ConfigError: the syncer's model does not match this run's model.
    """
    from atoll.strategies.base import model_fragments

    for folder in (run_dir / "syncer", run_dir):
        try:
            _, state = load_checkpoint(latest_checkpoint(folder))
            outer = state["syncer"]["outer"]
        except (CheckpointError, KeyError, TypeError):
            continue
        shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        try:
            index = model_fragments(shapes, len(outer))
            flat = torch.empty(sum(p.numel() for p in model.parameters()), dtype=torch.float32)
            for fragment, frag in zip(index, outer, strict=True):
                fragment.scatter_(flat, frag["params"])
        except (ConfigError, RuntimeError, IndexError, ValueError):
            raise ConfigError(f"init_from: the syncer's model in '{folder}' does not match --model/--vocab-size of "
                              "this run; use the same model and vocabulary as that run") from None
        copy_flat_into(list(model.parameters()), flat)
        return True
    return False
