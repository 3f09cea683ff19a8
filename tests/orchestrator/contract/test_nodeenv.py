"""The node environment contract (orchestrator/contract/nodeenv.py): one record, one formatting,
read back by the node as it was written, and the same variables from the controller's launch and
from ``dtrun export``."""

from __future__ import annotations

import textwrap

import pytest

from orchestrator.contract import nodeenv
from orchestrator.contract.nodeenv import NodeEnv, budget_left_per_node, for_launch, from_env, to_env


def _full() -> NodeEnv:
    return NodeEnv(run_uri="s3://b/r", job="j", attempt=3, nproc_per_node=8, nnodes=2, node_rank=1,
                   master_addr="10.0.0.5", master_port=29600, price_per_hour=23.92, budget_left_usd=1234567.125,
                   deadline=1712345678.125, launched_at=1712340000.5, node_timeout_seconds=86400,
                   restart_grace_seconds=1200, controller_lost_minutes=30, idle_minutes=1 / 120,
                   watchdog_seconds=0.5, stop_grace_seconds=120, kill_grace_seconds=40,
                   self_terminate="runpodctl pod delete $RUNPOD_POD_ID", pip_cache_dir="/vol/pip",
                   job_yaml="name: j\ntrainer: {steps: 1}\n", trainer_module="fake_trainer",
                   trainer_cmd=["/usr/bin/python3", "/tmp/a b/fake.py"])


def test_every_field_round_trips():
    rec = _full()
    env = to_env(rec)
    assert set(env) == set(nodeenv.NAMES)  # every field set: every name written
    assert from_env(env) == rec
    assert to_env(from_env(env)) == env


def test_one_formatting():
    env = to_env(_full())
    assert env["DTRUN_BUDGET_LEFT_USD"] == "1234567.125000"  # money: six decimals, never an exponent
    assert env["DTRUN_PRICE_PER_HOUR"] == "23.920000"
    assert env["DTRUN_DEADLINE"] == "1712345678.125" and env["DTRUN_LAUNCHED_AT"] == "1712340000.500"
    assert env["DTRUN_CONTROLLER_LOST_MINUTES"] == "30" and env["DTRUN_WATCHDOG_SECONDS"] == "0.5"
    assert float(env["DTRUN_IDLE_MINUTES"]) == 1 / 120  # the shortest exact text, all digits kept
    assert env["DTRUN_ATTEMPT"] == "3" and env["DTRUN_TRAINER_CMD"] == "/usr/bin/python3 '/tmp/a b/fake.py'"


def test_unset_values_are_not_written_and_other_variables_are_ignored():
    env = to_env(NodeEnv(run_uri="file:///r", job="j"))
    assert env == {"DTRUN_RUN_URI": "file:///r", "DTRUN_JOB": "j"}
    rec = from_env({**env, "DTRUN_DEADLINE": " ", "PATH": "/bin", "DTRUN_HOME": "/h"})
    assert rec == NodeEnv(run_uri="file:///r", job="j")


@pytest.mark.parametrize("env, msg", [
    ({"DTRUN_JOB": "j"}, "DTRUN_RUN_URI is not set"),
    ({"DTRUN_RUN_URI": "u"}, "DTRUN_JOB is not set"),
    ({"DTRUN_RUN_URI": "u", "DTRUN_JOB": "j", "DTRUN_PRICE_PER_HOUR": "cheap"}, "DTRUN_PRICE_PER_HOUR='cheap'"),
    ({"DTRUN_RUN_URI": "u", "DTRUN_JOB": "j", "DTRUN_ATTEMPT": "1.5"}, "DTRUN_ATTEMPT='1.5' is not an integer"),
])
def test_a_bad_environment_is_named(env, msg):
    with pytest.raises(nodeenv.NodeEnvError, match=msg):
        from_env(env)


def test_budget_left_is_each_nodes_share_of_what_is_left():
    assert budget_left_per_node(None, 5.0, 2) is None
    assert budget_left_per_node(100.0, 20.0, 2) == 40.0
    assert budget_left_per_node(100.0, 120.0, 4) == 0.0  # overspent: nothing, never negative


def test_bootstrap_command_and_trainer_args():
    assert nodeenv.bootstrap_command() == ["python", "infra/node_bootstrap.py"]
    assert nodeenv.bootstrap_command("/venv/bin/python", "/repo/") == ["/venv/bin/python",
                                                                       "/repo/infra/node_bootstrap.py"]
    assert nodeenv.trainer_args("/tmp/j.yaml", "s3://b/r") == ["--job", "/tmp/j.yaml", "--run-uri", "s3://b/r"]


def _controller_env(spec, attempt: int, price_per_hour: float, spent: float, now: float,
                    deadline: float | None) -> dict[str, str]:
    """What the controller's launch writes (``Controller._launch_request``) for one attempt."""
    s = spec
    return to_env(for_launch(run_uri=s.run_uri, job=s.name, attempt=attempt, gpus_per_node=s.resources.gpus_per_node,
                             nodes=s.resources.nodes, idle_minutes=s.teardown.idle_minutes,
                             price_per_hour=price_per_hour, max_usd=s.budget.max_usd, spent_usd=spent,
                             deadline=deadline, controller_lost_minutes=s.teardown.controller_lost_minutes,
                             launched_at=now))


def test_export_and_controller_write_the_same_environment(tmp_path):
    from orchestrator.cli.export import skypilot_task
    from orchestrator.plan.spec import load_spec

    job = tmp_path / "big.yaml"
    job.write_text(textwrap.dedent("""
        name: big
        resources: {providers: [lambda], gpu: H100, gpus_per_node: 8, nodes: 2}
        trainer: {model: gpt2-124m, steps: 100, batch_size: 16}
        checkpoint: {uri: "s3://b/{name}"}
        budget: {max_usd: 100.5}
        teardown: {idle_minutes: 7.5, controller_lost_minutes: 45}
    """))
    spec = load_spec(job)
    cfg, _notes = skypilot_task(spec)
    exported = cfg["envs"]
    price = float(exported["DTRUN_PRICE_PER_HOUR"])  # the export's price: the highest catalog one
    ctl = _controller_env(spec, attempt=1, price_per_hour=price, spent=0.0, now=1.7e9, deadline=None)
    # the controller adds when it launched; the export carries the spec for a node started without dtrun
    assert set(exported) - set(ctl) == {"DTRUN_JOB_YAML"}
    assert set(ctl) - set(exported) == {"DTRUN_LAUNCHED_AT"}
    assert {k: v for k, v in exported.items() if k in ctl} == {k: v for k, v in ctl.items() if k in exported}
    assert exported["DTRUN_BUDGET_LEFT_USD"] == "50.250000"  # per node, one format on both sides
    assert from_env(exported).job_yaml is not None
