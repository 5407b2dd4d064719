"""The model: a Hugging Face ``transformers`` Llama-style causal LM, from a size preset or a local folder.

atoll does not define a transformer of its own; it builds :class:`transformers.LlamaForCausalLM` from a
:class:`transformers.LlamaConfig` preset sized for the machine at hand, or loads any causal LM saved with
``save_pretrained`` from a local path or the Hugging Face Hub (continued pretraining; the run then uses the
model's own tokenizer, :mod:`atoll.job.data.pretrained`). ``transformers`` is imported when a model is built.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from atoll.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a Llama-style preset (hidden size, layers, MLP size, attention heads, key-value heads); tied
    embeddings unless said otherwise. Parameter counts below include the embeddings of the vocabulary named."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool = True


PRESETS: dict[str, ModelPreset] = {
    # ~40K parameters plus embeddings: for tests and smoke checks only.
    "micro": ModelPreset(32, 2, 64, 2, 2),
    # ~0.27M parameters with the default 1024-token vocabulary: the default. Small enough that 4 islands see
    # about 50 tokens per parameter within minutes on 2 CPU cores (the regime the DiLoCo studies train in;
    # docs/results.md, "DiLoCo's defining result"); four layers, so four Streaming DiLoCo fragments are equal in size.
    "nano": ModelPreset(64, 4, 176, 4, 4),
    # ~1.9M parameters (the default before nano); four layers.
    "tiny": ModelPreset(160, 4, 448, 5, 5),
    # ~19M parameters.
    "20m": ModelPreset(384, 10, 1024, 6, 6),
    # ~120M parameters (GPT-2 small / DiLoCo's 150M scale).
    "125m": ModelPreset(768, 12, 3072, 12, 12),
    # ~1B parameters (TinyLlama-like shape, grouped-query attention, untied head).
    "1b": ModelPreset(2048, 22, 5632, 32, 4, tie_word_embeddings=False),
}


def check_fragments(model: str, fragments: int) -> None:
    """Refuse more Streaming DiLoCo fragments than a preset has layers (fragments are strided layers), at
    config time; a model folder is checked when it is loaded (:mod:`atoll.algorithms.fragments`).

    Raises:
        ValueError: ``fragments`` exceeds the preset's layers (one line naming the fix).
    """
    preset = PRESETS.get(model)
    if preset is not None and fragments > preset.num_hidden_layers:
        raise ValueError(f"fragments: {fragments} fragments for the {model} model's {preset.num_hidden_layers} "
                         f"layers; pass --fragments {preset.num_hidden_layers} or fewer")


def check_model_config(folder: str | Path, seq_len: int | None = None) -> None:
    """Refuse a model folder whose ``config.json`` is missing or unreadable, naming that file, or (with
    ``seq_len``) whose model has fewer positions than the training sequences need.

    Run before anything else reads the folder: ``AutoTokenizer`` reads ``config.json`` too, and its error
    would blame the tokenizer. Nothing happens for a preset name or a Hub id (not a folder).

    Raises:
        ConfigError: ``config.json`` is missing, not JSON, not an object, or has a value of the wrong type
            for ``transformers.AutoConfig`` (field ``model``); its ``max_position_embeddings`` (GPT-2:
            ``n_positions``) is below ``seq_len`` tokens (field ``seq_len``: GPT-2's learned positions would
            fail with an ``IndexError`` in the first evaluation).
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        return
    from transformers import AutoConfig

    fix = "restore it (save_pretrained writes it) or pass another --model folder or a preset"
    if not (path / "config.json").is_file():
        raise ConfigError(f"model: '{folder}' has no config.json, so it is not a model saved with "
                          f"save_pretrained; {fix}")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - JSONDecodeError, TypeError, ValueError, OSError from transformers
        detail = " ".join(str(e).split())[:160] or type(e).__name__
        raise ConfigError(f"model: '{path / 'config.json'}' cannot be read as a model configuration ({detail}); "
                          f"{fix}") from None
    positions = model_positions(config)
    if seq_len is not None and positions is not None and positions < seq_len:
        raise ConfigError(f"seq_len: {seq_len} tokens, but the model '{folder}' has {positions} positions "
                          f"(max_position_embeddings in its config.json); pass --seq-len {positions} or less, or "
                          "a model with more positions")


def model_positions(config: Any) -> int | None:
    """The longest sequence a Hugging Face model config takes, in tokens (``max_position_embeddings``, which
    GPT-2's config maps to ``n_positions``), or None where it names none."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class _HeldRecords(logging.Filter):
    """Holds the records of transformers' loading logger (its LOAD REPORT of missing or unexpected weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


@contextlib.contextmanager
def _held_load_report() -> Iterator[None]:
    """While a pretrained model loads, hold what transformers logs about it: a load that atoll refuses (an
    exception out of the block) says so in one line, not after transformers' multi-line report; an accepted
    one logs it afterwards, as transformers would have."""
    logger = logging.getLogger("transformers.modeling_utils")
    held = _HeldRecords()
    logger.addFilter(held)
    try:
        yield
    finally:
        logger.removeFilter(held)
    for record in held.records:  # reached only when the block raised nothing
        logger.handle(record)


def build_model(name_or_path: str, vocab_size: int, seq_len: int, seed: int, meta: bool = False) -> PreTrainedModel:
    """Build a preset model with a seeded initialisation, or load a pretrained one.

    With ``meta`` (presets only) the model is built on the meta device: shapes, no storage and no
    initialisation; a sharded island materialises and initialises only its pieces
    (:func:`atoll.runtime.collective.sharding.materialize`).

    Args:
        name_or_path: a key of :data:`PRESETS`, a folder saved with ``save_pretrained``, or a Hugging Face Hub
            id (``owner/name``; needs the network, or a cached copy with ``HF_HUB_OFFLINE=1``).
        vocab_size: the tokenizer's vocabulary size: a preset's embeddings; a loaded model keeps its own and
            must embed at least this many tokens (0: no check).
        seq_len: training sequence length in tokens; sets ``max_position_embeddings`` of presets.
        seed: seeds ``torch`` before initialisation so every island and every run start identical.

    Returns:
        A float32 causal LM on the CPU in training mode.

    Raises:
        ConfigError: the name is neither a preset nor an existing folder nor a reachable Hub id (field
            ``model``), a loaded model lacks weight tensors that its config.json names (transformers'
            ``missing_keys``, which it would initialise at random; a tied ``lm_head`` is not missing), or its
            vocabulary is smaller than the tokenizer's.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if name_or_path in PRESETS:
        p = PRESETS[name_or_path]
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=p.hidden_size,
            num_hidden_layers=p.num_hidden_layers,
            intermediate_size=p.intermediate_size,
            num_attention_heads=p.num_attention_heads,
            num_key_value_heads=p.num_key_value_heads,
            max_position_embeddings=max(seq_len, 128),
            tie_word_embeddings=p.tie_word_embeddings,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        config._attn_implementation = "sdpa"  # PyTorch's fused attention (flash / memory-efficient kernels on GPUs)
        if meta:
            with torch.device("meta"):
                model = LlamaForCausalLM(config)
            model.train()
            return model
        model = LlamaForCausalLM(config)
        model.train()
        return model
    from atoll.job.data.sources import _hub_unreachable_reason, is_hub_id

    if not Path(name_or_path).is_dir():
        if not is_hub_id(name_or_path):
            raise ConfigError(
                f"model: '{name_or_path}' is neither a preset ({', '.join(PRESETS)}) nor an existing folder; "
                "pass a preset name or a local Hugging Face model path"
            )
        reason = _hub_unreachable_reason()
        if reason is not None:
            raise ConfigError(f"model: cannot download '{name_or_path}' from the Hugging Face Hub ({reason}); "
                              f"pass a local folder (hf download {name_or_path} --local-dir DIR) or a preset")
    check_model_config(name_or_path, seq_len)
    with _held_load_report():
        try:
            model, info = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32,
                                                               output_loading_info=True)
        except Exception as e:  # noqa: BLE001 - a damaged folder fails in transformers, safetensors or the hub's checks
            detail = " ".join(str(e).split())[:160] or type(e).__name__
            raise ConfigError(f"model: '{name_or_path}' cannot be loaded as a Hugging Face causal LM ({detail}); "
                              "pass a folder saved with save_pretrained (config.json and intact weights) or a "
                              "preset") from None
        missing = sorted(info.get("missing_keys") or (), key=lambda k: [int(t) if t.isdigit() else t
                                                                         for t in re.split(r"(\d+)", k)])
        if missing:  # transformers would start them at random and only say so in its report
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise ConfigError(f"model: '{name_or_path}' lacks {len(missing)} of the model's weight tensors ({shown}), "
                              "which would start at random; pass a folder whose weights match its config.json "
                              "(save_pretrained writes both) or a preset")
    positions = model_positions(model.config)  # a Hub model's config is read only here
    if positions is not None and positions < seq_len:
        raise ConfigError(f"seq_len: {seq_len} tokens, but the model '{name_or_path}' has {positions} positions; "
                          f"pass --seq-len {positions} or less, or a model with more positions")
    check_vocab(model, vocab_size, name_or_path)
    model.train()
    return model


def check_vocab(model: PreTrainedModel, vocab_size: int, name: str, tokenizer: str = "") -> str | None:
    """Refuse a tokenizer whose ids the model cannot embed; describe a harmless difference.

    Args:
        model: the loaded model; its input embeddings have ``num_embeddings`` rows.
        vocab_size: the tokenizer's size (ids ``0 .. vocab_size - 1``); 0: nothing to check.
        name: ``--model`` as given, for the message.
        tokenizer: where a pretrained tokenizer came from ('' for atoll's BPE).

    Returns:
        None when the sizes are equal (or unchecked); else a one-line note (the tokenizer is smaller: rows of
        the embeddings no id reaches, common where a vocabulary is padded to a multiple of 64 or 128).

    Raises:
        ConfigError: the tokenizer has more tokens than the model embeds (field ``tokenizer``, or
            ``vocab_size`` for atoll's BPE).
    """
    rows = model.get_input_embeddings().num_embeddings
    if not vocab_size or vocab_size == rows:
        return None
    if vocab_size > rows:
        if tokenizer:
            raise ConfigError(f"tokenizer: '{tokenizer}' has {vocab_size} tokens but the model '{name}' embeds only "
                              f"{rows}, so some ids have no embedding; pass --tokenizer with the tokenizer the model "
                              "was trained with")
        raise ConfigError(f"model: '{name}' has a vocabulary of {rows} tokens, below the tokenizer's {vocab_size}; "
                          "lower --vocab-size or use a preset")
    return (f"the tokenizer has {vocab_size} tokens and the model '{name}' embeds {rows}: {rows - vocab_size} "
            "rows no token id reaches (harmless)")


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters as stored (float32: 4 bytes each); what ddp all-reduces per step."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def activation_checkpointing(model: PreTrainedModel) -> bool:
    """Whether ``model`` recomputes its blocks' activations in the backward pass."""
    name = ("is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing")  # transformers 5
            else "is_gradient_checkpointing")
    return bool(getattr(model, name, False))


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder block's activations in the backward pass (Chen et al. 2016, arXiv:1604.06174):
    transformers' activation (gradient) checkpointing with non-reentrant ``torch.utils.checkpoint``, which
    composes with FSDP2 and ``torch.compile``. The loss and gradients are those without it. Idempotent.

    Raises:
        ConfigError: the model does not support it (names the field and the fix).
    """
    if activation_checkpointing(model):
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"activation_checkpointing: {type(model).__name__} does not support activation "
                          "checkpointing; drop --activation-checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x (the older name is deprecated)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
