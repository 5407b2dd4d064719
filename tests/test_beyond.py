"""bench/beyond.py's plan: the study by model size, its flags, and bad input (no training here)."""

from __future__ import annotations

from pathlib import Path

from bench import beyond


def test_size_study_compares_each_model_with_its_own_diloco_and_one_island() -> None:
    runs = beyond.size_runs(["micro", "20m"], {"device": "cuda", "precision": "bf16"})
    names = [name for name, _, _ in runs]
    assert names == ["size_micro_diloco", "size_micro_sparseloco", "size_micro_one_island",
                     "size_20m_diloco", "size_20m_sparseloco", "size_20m_one_island"]
    assert all(ref == f"size_{own['model']}_diloco" for _, ref, own in runs)
    sparse = dict((n, o) for n, _, o in runs)["size_20m_sparseloco"]
    assert sparse["sparseloco_topk"] / sparse["sparseloco_chunk"] == 16 / 1024  # 1.6%
    assert sparse["device"] == "cuda" and sparse["precision"] == "bf16" and sparse["steps"] == 800
    assert dict((n, o) for n, _, o in runs)["size_20m_one_island"]["islands"] == 1


def test_an_unknown_model_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    assert beyond.main(["--size-only", "--size-models", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "size_models" in err[0] and "nope" in err[0]
    assert not any(tmp_path.iterdir())  # nothing trained or written
