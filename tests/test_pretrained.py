"""Continued pretraining of a Hugging Face model: the run encodes its corpus with the model's own tokenizer.

The models are tiny random Llama / GPT-2 networks saved with ``save_pretrained`` beside a small BPE wrapped
in ``PreTrainedTokenizerFast`` (its own special tokens, eos id 2: not atoll's), so nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli

from atoll.config import build_config
from atoll.job.data import pretrained as pretrained_mod
from atoll.job.run import prepare_inputs

TOKENIZER_TEXTS = [f"the {w} of island {i} trains a model while links carry bytes" for i in range(40)
                   for w in ("shape", "weight", "step")]


def make_model_folder(path: Path, arch: str = "llama", tokenizer_vocab: int = 300, model_vocab: int = 320) -> Path:
    """A random causal LM of ``model_vocab`` embedding rows and a ``tokenizer_vocab``-token BPE, in ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TOKENIZER_TEXTS, trainers.BpeTrainer(
        vocab_size=tokenizer_vocab, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=model_vocab, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                             max_position_embeddings=64, bos_token_id=1, eos_token_id=2))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=model_vocab, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                           bos_token_id=1, eos_token_id=2))
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture()
def jsonl_corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    rng = np.random.default_rng(0)
    words = ["island", "model", "trains", "slow", "links", "bytes", "outer", "step", "def", "return", "weight"]
    texts = [f"doc{i} " + " ".join(rng.choice(words, size=int(rng.integers(80, 160)))) for i in range(120)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path, texts


def settings(tmp_path: Path, data: Path, model: Path | str, **extra: object) -> dict:
    return {"data": str(data), "model": str(model), "cache_dir": str(tmp_path / "cache"), "islands": 2,
            "seq_len": 32, "batch_size": 4, "steps": 4, "sync_every": 2, "eval_batches": 1, "progress": False,
            "threads": 1, "out": str(tmp_path / "run"), **extra}


def documents(shard: np.ndarray, eos_id: int) -> list[tuple[int, ...]]:
    ends = np.flatnonzero(shard == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tuple(shard[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_model_folder_trains_on_its_own_tokenizer(tmp_path: Path, jsonl_corpus, arch: str,  # noqa: ANN001
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    folder = make_model_folder(tmp_path / "model", arch)
    corpus, texts = jsonl_corpus
    data, model = prepare_inputs(build_config(overrides=settings(tmp_path, corpus, folder)))
    hf = AutoTokenizer.from_pretrained(folder)
    assert data.pretrained is not None and data.vocab_size == len(hf) == 300 and data.eos_id == hf.eos_token_id == 2
    assert model.get_input_embeddings().num_embeddings == model.config.vocab_size == 320  # the model's own
    # Every document of the shards is exactly AutoTokenizer's ids of one corpus text, and all texts are there.
    used = sorted(d for s in data.island_tokens + [data.val_tokens] for d in documents(s, data.eos_id))
    assert used == sorted(tuple(hf(t, add_special_tokens=False)["input_ids"]) for t in texts)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("atoll: note:")]
    assert len(notes) == 1 and "300 tokens" in notes[0] and "embeds 320" in notes[0] and "harmless" in notes[0]


@pytest.mark.parametrize("tied", [True, False])
def test_a_complete_folder_loads_its_weights_and_a_lacking_one_is_refused(tmp_path: Path, tied: bool,
                                                                          capfd: pytest.CaptureFixture[str]) -> None:
    """Complete weights load exactly (a tied lm_head, absent from the file by design, is not missing); weights
    that lack tensors are refused in one line, without transformers' LOAD REPORT on either stream."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from atoll.errors import ConfigError
    from atoll.job.model import build_model

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=tied)).save_pretrained(tmp_path / "model")
    saved = load_file(tmp_path / "model" / "model.safetensors")
    assert ("lm_head.weight" in saved) is not tied
    model = build_model(str(tmp_path / "model"), 0, 32, seed=1)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert torch.equal(state["lm_head.weight"], saved["lm_head.weight" if not tied else "model.embed_tokens.weight"])
    lacking = {k: v for k, v in saved.items() if k != "model.norm.weight" and not k.startswith("model.layers.0.mlp")}
    save_file(lacking, tmp_path / "model" / "model.safetensors", metadata={"format": "pt"})
    capfd.readouterr()
    with pytest.raises(ConfigError) as e:
        build_model(str(tmp_path / "model"), 0, 32, seed=1)
    assert str(e.value).startswith(f"model: '{tmp_path / 'model'}' lacks 4 of the model's weight tensors "
                                   "(model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.gate_proj.weight, "
                                   "model.layers.0.mlp.up_proj.weight and 1 more), which would start at random")
    printed = capfd.readouterr()
    assert "LOAD REPORT" not in printed.out + printed.err and "MISSING" not in printed.out + printed.err


def test_tokenizer_bpe_and_a_folder_without_tokenizer_say_so(tmp_path: Path, jsonl_corpus,  # noqa: ANN001
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    folder = make_model_folder(tmp_path / "model")
    corpus, _ = jsonl_corpus
    data, _ = prepare_inputs(build_config(overrides=settings(tmp_path, corpus, folder, tokenizer="bpe",
                                                             vocab_size=300)))
    assert data.pretrained is None and data.eos_id == 0 and data.vocab_size == 300
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("atoll: note:")]
    assert len(err) == 1 and "--tokenizer FOLDER" in err[0]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink(missing_ok=True)
    (folder / "special_tokens_map.json").unlink(missing_ok=True)
    assert pretrained_mod.tokenizer_source(str(folder), None) is None
    assert pretrained_mod.tokenizer_source("nano", None) is None
    assert pretrained_mod.tokenizer_source(str(folder), str(tmp_path)) == str(tmp_path)


def test_a_tokenizer_the_model_cannot_embed_is_one_line_exit_2(tmp_path: Path, jsonl_corpus) -> None:  # noqa: ANN001
    corpus, _ = jsonl_corpus
    small = make_model_folder(tmp_path / "small", model_vocab=256)
    flags = ["--data", str(corpus), "--model", str(small), "--cache-dir", str(tmp_path / "c"), "--out",
             str(tmp_path / "run"), "--no-progress", "--seq-len", "32"]  # within the model's 64 positions
    r = run_cli("train", *flags)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"atoll: error: tokenizer: '{small}' has 300 tokens but the model") and "256" in r.stderr
    r = run_cli("train", *flags, "--tokenizer", "bpe", "--vocab-size", "512")
    assert r.returncode == 2 and "atoll: error: model:" in r.stderr and "below the tokenizer's" in r.stderr
    r = run_cli("train", *flags, "--tokenizer", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "atoll: error: tokenizer:" in r.stderr and "neither a folder nor" in r.stderr


def test_a_hub_id_offline_is_one_line_exit_2(tmp_path: Path, jsonl_corpus, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    corpus, _ = jsonl_corpus
    monkeypatch.setattr(pretrained_mod, "_hub_unreachable_reason", lambda: "cannot reach huggingface.co:443: test")
    r = run_cli("train", "--data", str(corpus), "--model", "HuggingFaceTB/SmolLM2-135M", "--no-progress",
                "--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "tokenizer: cannot download 'HuggingFaceTB/SmolLM2-135M'" in r.stderr and "--local-dir" in r.stderr


@pytest.mark.slow
def test_continued_pretraining_end_to_end_and_resume(tmp_path: Path, jsonl_corpus) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = make_model_folder(tmp_path / "model")
    corpus, texts = jsonl_corpus
    flags = ["--data", str(corpus), "--model", str(folder), "--cache-dir", str(tmp_path / "c"), "--islands", "2",
             "--steps", "4", "--sync-every", "2", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1",
             "--threads", "1", "--no-progress", "--out", str(tmp_path / "run")]
    r = run_cli("train", *flags)
    assert r.returncode == 0, r.stderr
    ckpt = tmp_path / "run" / "checkpoints" / "latest"
    ckpt = ckpt if ckpt.is_dir() else max((tmp_path / "run" / "checkpoints").glob("step_*"))
    saved, original = AutoTokenizer.from_pretrained(ckpt / "model"), AutoTokenizer.from_pretrained(folder)
    assert saved.eos_token == "</s>" and all(saved(t)["input_ids"] == original(t)["input_ids"] for t in texts[:5])
    trained = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    assert trained.config.vocab_size == 320
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] + 0.5 and summary["tokens"] == 2 * 4 * 4 * 32
    r = run_cli("train", "--resume", str(tmp_path / "run"), "--steps", "6", "--no-progress")
    assert r.returncode == 0, r.stderr
    # The folder's tokenizer replaced by another: the data fingerprint no longer matches the checkpoint's.
    make_model_folder(tmp_path / "other", tokenizer_vocab=280)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tmp_path / "other" / name).read_bytes())
    r = run_cli("train", "--resume", str(tmp_path / "run"), "--steps", "8", "--no-progress")
    assert r.returncode == 2 and "or its tokenizer changed since this run started" in r.stderr
    r = run_cli("train", "--resume", str(tmp_path / "run"), "--steps", "8", "--tokenizer", "bpe")
    assert r.returncode == 2 and "tokenizer: cannot change on resume" in r.stderr
