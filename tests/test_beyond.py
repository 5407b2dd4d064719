"""bench/beyond.py's plan: the study by model size, its flags, and bad input (no training here)."""

from __future__ import annotations

import json
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


def test_size_references_reuse_only_matching_diloco_and_one_island_runs(tmp_path: Path, capsys) -> None:
    runs = beyond.size_runs(["micro"])
    own = {name: o for name, _, o in runs}
    tokens = 800 * 4 * 32 * 128
    diloco = {"strategy": "diloco", "model": "micro", "islands": 4, "steps": 800, "sync_every": 50,
              "vocab_size": 1024, "seed": 0, "device": "cpu", "precision": "fp32", "tokens": tokens}
    refs = {"size_micro_diloco": diloco, "size_micro_sparseloco": {**diloco, "strategy": "sparseloco"}}
    assert beyond.reference_run(refs, "size_micro_diloco", own["size_micro_diloco"]) is diloco
    # sparseloco is always trained (the change under study), and a run absent from the file too
    assert beyond.reference_run(refs, "size_micro_sparseloco", own["size_micro_sparseloco"]) is None
    assert beyond.reference_run(refs, "size_micro_one_island", own["size_micro_one_island"]) is None
    # a committed run of other settings is refused in one line, before anything trains
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"runs": {"size_micro_diloco": {**diloco, "steps": 400}}}))
    assert beyond.main(["--size-only", "--size-models", "micro", "--size-references", str(path),
                        "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "size_references" in err[0] and "steps 400" in err[0] and "800" in err[0]
    assert not (tmp_path / "out").exists()
