"""The placement line each pipeline rank logs at start (trainer.pipeline.placement): the stage and
layers a global rank runs and the node it is on, so a multi-node pp job shows where its stages
landed (the Lambda lab's two-node pipeline test reads it from each node's log)."""

from __future__ import annotations

from trainer.pipeline import PPConfig, placement, stage_ids


def test_pp2_one_stage_per_rank_names_node_stage_and_layers():
    cfg = PPConfig(pp=2, schedule="1f1b", v=1, microbatches=4, rows=1)
    env = {"GROUP_RANK": "1", "LOCAL_RANK": "0"}
    assert placement(2, stage_ids(1, cfg), cfg, 2, env) == (
        "pipeline: rank 2 (node 1, local rank 0) runs stage 1 of 2 (layers 1-1 of 2)")


def test_v_schedule_lists_both_stages_and_unknown_node():
    cfg = PPConfig(pp=2, schedule="zbv", v=2, microbatches=4, rows=1)
    assert placement(0, stage_ids(0, cfg), cfg, 8, {}) == (
        "pipeline: rank 0 (node ?, local rank ?) runs stage 0, 3 of 4 (layers 0-1, 6-7 of 8)")
