"""A pretrained tokenizer: the one saved with a Hugging Face model, loaded with ``AutoTokenizer``.

Continued pretraining of an existing causal LM must feed it the ids of its own tokenizer; a BPE trained
on the new corpus would give the loaded embeddings ids that mean something else. ``tokenizer_source``
decides which tokenizer a run uses (``--tokenizer``, else the ``--model`` folder's own, else atoll's BPE);
``load_pretrained_tokenizer`` loads it; ``backend_of`` is the ``tokenizers.Tokenizer`` that encodes the
corpus (the same ids as calling the ``AutoTokenizer`` with ``add_special_tokens=False``).
``transformers`` is imported only when a pretrained tokenizer is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers

from atoll.errors import ConfigError
from atoll.job.data.sources import _hub_unreachable_reason, _one_line, is_hub_id

#: ``--tokenizer bpe``: train atoll's byte-level BPE on the corpus even when the model brings a tokenizer.
BPE = "bpe"
# Files one of which a folder saved with ``tokenizer.save_pretrained`` holds.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(folder: str | Path) -> bool:
    """True when ``folder`` holds a tokenizer saved with ``save_pretrained`` (any of ``TOKENIZER_FILES``)."""
    return any((Path(folder).expanduser() / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_source(model: str, tokenizer: str | None) -> str | None:
    """Where the run's tokenizer comes from: a folder or Hub id to load, or None for atoll's BPE.

    Args:
        model: ``--model``: a preset name, a local folder, or a Hub id.
        tokenizer: ``--tokenizer``: ``"bpe"``, a folder / Hub id, or None (default: the model's own; a preset
            brings none).

    Returns:
        ``tokenizer`` when it names one; with None, the model folder when it holds a tokenizer, the Hub id
        when ``model`` is one; else None (train the BPE).

    Raises:
        ConfigError: ``model`` is a folder whose ``config.json`` is missing or unreadable (field ``model``;
            checked here, the first place every runtime reads the folder, before its tokenizer is loaded).
    """
    from atoll.job.model import PRESETS, check_model_config

    check_model_config(model)
    if tokenizer == BPE:
        return None
    if tokenizer:
        return tokenizer

    if model in PRESETS:
        return None
    if Path(model).expanduser().is_dir():
        return model if has_tokenizer(model) else None
    return model if is_hub_id(model) else None


def load_pretrained_tokenizer(source: str) -> Any:
    """``AutoTokenizer.from_pretrained(source)``, failing with one line (field ``tokenizer``).

    Args:
        source: a local folder or a Hugging Face Hub id (needs the network, or a cached copy with
            ``HF_HUB_OFFLINE=1``).

    Returns:
        A fast tokenizer (``transformers.PreTrainedTokenizerFast`` or another ``tokenizers``-backed class)
        with an end-of-sequence token.

    Raises:
        ConfigError: the tokenizer cannot be loaded (offline, not found, not a tokenizer folder), has no
            ``tokenizers`` backend, or defines no end-of-sequence token (atoll separates documents by it).
    """
    fix = "pass --tokenizer FOLDER (a tokenizer saved with save_pretrained) or --tokenizer bpe"
    local = Path(source).expanduser()
    if not local.is_dir():
        if not is_hub_id(source):
            raise ConfigError(f"tokenizer: '{source}' is neither a folder nor a Hugging Face id; {fix}")
        reason = _hub_unreachable_reason()
        if reason is not None:
            raise ConfigError(f"tokenizer: cannot download '{source}' from the Hugging Face Hub ({reason}); download "
                              f"it once (hf download {source} --local-dir DIR) and pass DIR, or {fix}")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(local) if local.is_dir() else source)
    except Exception as exc:  # OSError, ValueError, EnvironmentError... for missing or foreign files
        raise ConfigError(f"tokenizer: cannot load a tokenizer from '{source}' "
                          f"({_one_line(exc, 160)}); {fix}") from None
    if not isinstance(getattr(tok, "backend_tokenizer", None), tokenizers.Tokenizer):
        raise ConfigError(f"tokenizer: '{source}' has no fast (tokenizers) version; save it with "
                          f"PreTrainedTokenizerFast (tokenizer.json), or {fix}")
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer: '{source}' defines no end-of-sequence token (eos_token), which atoll puts "
                          "between documents; set eos_token in its tokenizer_config.json")
    return tok


def backend_of(pretrained: Any) -> tokenizers.Tokenizer:
    """A copy of the ``tokenizers.Tokenizer`` behind a fast tokenizer, without truncation or padding.

    Encoding with it and ``add_special_tokens=False`` gives the ids ``pretrained(text,
    add_special_tokens=False)["input_ids"]`` gives; the copy keeps a ``tokenizer.json``'s truncation setting
    from cutting documents short.
    """
    tok = tokenizers.Tokenizer.from_str(pretrained.backend_tokenizer.to_str())
    tok.no_truncation()
    tok.no_padding()
    return tok


def tokenizer_size(pretrained: Any) -> int:
    """Token ids the tokenizer can produce: ``len(tokenizer)`` (its vocabulary and added tokens)."""
    return len(pretrained)
