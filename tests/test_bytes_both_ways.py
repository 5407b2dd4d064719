"""Bytes sent and bytes received per island, both counted, each against its formula, for every strategy.

Lockstep strategies exchange over ring collectives (Patarasuk & Yuan 2009): in an all-reduce of B bytes over K
islands each island sends 2(K-1)/K*B and receives as much; in an all-gather of B per island it sends and
receives (K-1)*B. A decoupled island pushes its codec's payload of each fragment and pulls the merged fragment
back in float32: 4 bytes per parameter of the fragment per pull (arXiv:2604.21428; docs/decoupled.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atoll.analysis.cost import Setting, codec_bits
from atoll.analysis.projection import project, project_run
from atoll.config import build_config
from atoll.config.applies import applicable
from atoll.runtime.network import ring_allgather_bytes, ring_allreduce_bytes
from atoll.runtime.sim_state import SimState


def test_projection_charges_the_decoupled_pull_at_float32() -> None:
    # 12B over 2 Gbit/s: the pull (32 bits per parameter per H steps) outweighs the int4 push about 7x
    s = Setting(params=12e9, step_compute_s=1.0, islands=4, bandwidth_mbps=2000, latency_ms=35)
    from atoll.strategies.registry import spec

    own = spec("decoupled").config(sync_every=100, fragments=4, codec="int4", pull_codec="fp32")
    p = project(s, "decoupled", own)
    b = codec_bits("int4")  # 4 bits and the scales
    assert p.bytes_per_step == pytest.approx(12e9 * b / 8 / 100)
    assert p.bytes_received_per_step == pytest.approx(12e9 * 4 / 100)
    assert p.step_s == pytest.approx(12e9 * 4 / 100 * 8 / 2e9)  # the downlink, not compute (1 s), sets the pace
    assert p.exchange_s == pytest.approx(12e9 * (b + 32) / 4 / 2e9 + 2 * 0.035)
    run = project_run(s, "decoupled", 1000, own)
    assert run["bytes_received"] == pytest.approx(1000 * 12e9 * 4 / 100)
    # a ring collective's receive half equals its send half
    d = project(s, "diloco", spec("diloco").config(sync_every=100, codec="fp32"))
    assert d.bytes_received_per_step == d.bytes_per_step == pytest.approx(
        ring_allreduce_bytes(4 * 12e9, 4) / 100)


def test_a_simulation_checkpoint_from_before_the_pulls_were_counted_restores() -> None:
    state = SimState.new(3, 2).state_dict()
    del state["bytes_received"]
    assert SimState.from_state(state).bytes_received == [0.0, 0.0, 0.0]


def _summary(fast_config: dict, **settings) -> tuple[dict, object]:
    from atoll import train

    config = build_config(overrides=applicable({**fast_config, **settings}))
    summary = train(config)
    assert json.loads((Path(fast_config["out"]) / "summary.json").read_text())["bytes_received_per_island"] == \
        summary["bytes_received_per_island"]
    return summary, config


def _named_shapes(out: str, step: int) -> list[tuple[str, tuple[int, ...]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(out) / "checkpoints" / f"step_{step:07d}" / "model")
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def _check_ring(summary: dict, expected: float) -> None:
    """Both directions equal the ring formula's; the reductions against ddp follow."""
    assert summary["bytes_sent_per_island"] == pytest.approx(expected, rel=1e-12)
    assert summary["bytes_received_per_island"] == summary["bytes_sent_per_island"]
    ddp = summary["ddp_bytes_per_island"]
    assert summary["reduction_vs_ddp_received"] == summary["reduction_vs_ddp"] == pytest.approx(ddp / expected)
    assert summary["reduction_vs_ddp_total"] == pytest.approx(ddp / expected)


@pytest.mark.slow
def test_ddp_and_diloco_both_ways(fast_config: dict) -> None:
    k, steps, h = fast_config["islands"], fast_config["steps"], fast_config["sync_every"]
    summary, _ = _summary(fast_config, strategy="ddp")
    model_bytes = 4 * summary["params"]
    _check_ring(summary, steps * ring_allreduce_bytes(model_bytes, k))  # a gradient all-reduce per step
    summary, _ = _summary({**fast_config, "out": fast_config["out"] + "_diloco"}, strategy="diloco", codec="fp32")
    _check_ring(summary, steps // h * ring_allreduce_bytes(model_bytes, k))  # a Δ all-reduce per H steps


@pytest.mark.slow
def test_streaming_both_ways(fast_config: dict) -> None:
    from atoll.algorithms.fragments import fragment_sync_steps
    from atoll.strategies.base import model_fragments

    k, steps, h, p = fast_config["islands"], fast_config["steps"], fast_config["sync_every"], 2
    summary, _ = _summary(fast_config, strategy="streaming", codec="fp32", fragments=p)
    numels = [sum(b - a for a, b in f.ranges) for f in model_fragments(_named_shapes(fast_config["out"], steps), p)]
    expected = 0.0
    for off, n in zip(fragment_sync_steps(p, h), numels, strict=True):
        syncs = (steps - off) // h + 1
        syncs += int(off + (syncs - 1) * h != steps)  # the end syncs a fragment trained since its last sync
        expected += syncs * ring_allreduce_bytes(4 * n, k)
    _check_ring(summary, expected)


@pytest.mark.slow
def test_demo_both_ways(fast_config: dict) -> None:
    from atoll.algorithms.demo_payload import payload_bytes

    k, steps = fast_config["islands"], 4
    summary, config = _summary({**fast_config, "steps": steps, "eval_every": 4, "checkpoint_every": 4},
                               strategy="demo")
    own = config.strategy_config
    per_step = sum(payload_bytes(shape, own.demo_chunk, own.demo_topk, own.demo_sign_values)
                   for _, shape in _named_shapes(fast_config["out"], steps))
    _check_ring(summary, steps * ring_allgather_bytes(per_step, k))  # an all-gather of the payloads per step


@pytest.mark.slow
def test_sparseloco_both_ways(fast_config: dict) -> None:
    from atoll.algorithms.sparse import SparseCompressor
    from atoll.strategies.sparseloco import WEIGHT_BYTES

    k, steps, h = fast_config["islands"], fast_config["steps"], fast_config["sync_every"]
    summary, config = _summary(fast_config, strategy="sparseloco")
    own = config.strategy_config
    compressor = SparseCompressor([shape for _, shape in _named_shapes(fast_config["out"], steps)],
                                  own.sparseloco_chunk, own.sparseloco_topk, own.sparseloco_bits,
                                  own.sparseloco_layout, own.sparseloco_tile_k)
    _check_ring(summary, steps // h * ring_allgather_bytes(compressor.payload_bytes() + WEIGHT_BYTES, k))


@pytest.mark.slow
def test_decoupled_pushes_by_codec_and_pulls_in_float32(fast_config: dict) -> None:
    from atoll.algorithms.fragments import fragment_sync_steps
    from atoll.strategies.base import codec_of, model_fragments

    k, steps, h, p = fast_config["islands"], fast_config["steps"], fast_config["sync_every"], 2
    summary, config = _summary(fast_config, strategy="decoupled", fragments=p, codec="int4", pull_codec="fp32")
    assert summary["deferred_pushes"] == 0 and not any(summary["failures"])  # the formula's premises
    codec = codec_of(config.strategy_config)
    numels = [sum(b - a for a, b in f.ranges) for f in model_fragments(_named_shapes(fast_config["out"], steps), p)]
    sent, received = [], []
    for s in summary["steps_per_island"]:
        up = down = 0.0
        for off, n in zip(fragment_sync_steps(p, h), numels, strict=True):
            pushes = (s - off) // h + 1 if s >= off else 0  # on the schedule: each answered with a pull
            last = off + (pushes - 1) * h if pushes else 0
            up += (pushes + int(last != s and s > 0)) * codec.payload_bytes(n)  # + the end's push, not answered
            down += pushes * 4 * n
        sent.append(up)
        received.append(down)
    assert summary["bytes_sent_by_island"] == sent
    assert summary["bytes_received_by_island"] == received
    assert summary["bytes_sent_per_island"] == pytest.approx(sum(sent) / k)
    assert summary["bytes_received_per_island"] == pytest.approx(sum(received) / k)
    # the pull is float32: 4 bytes per parameter against about half a byte pushed (int4 and its scales)
    assert summary["bytes_received_per_island"] > 6 * summary["bytes_sent_per_island"]
    ddp = summary["ddp_bytes_per_island"]
    assert summary["reduction_vs_ddp_received"] == pytest.approx(ddp / summary["bytes_received_per_island"])
    assert summary["reduction_vs_ddp_total"] == pytest.approx(
        2 * ddp / (summary["bytes_sent_per_island"] + summary["bytes_received_per_island"]))
