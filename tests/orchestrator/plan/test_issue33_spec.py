"""Issue 33, the job file: a cross-field error points at the field it names (15), and a key
written twice is refused with its line instead of silently keeping the last (16)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.contract.errors import SpecError
from orchestrator.plan.spec import load_spec

ROOT = Path(__file__).resolve().parents[3]

HEAD = "# a job\n# with comments\nname: gpn3tp2\n"


def refused(tmp_path, text: str) -> str:
    f = tmp_path / "job.yaml"
    f.write_text(text)
    with pytest.raises(SpecError) as exc:
        load_spec(f)
    return str(exc.value).replace(str(f), "job.yaml")


# ---- 15: the field's line, not the `name:` line ----------------------------------------------

def test_cross_field_error_points_at_the_field_it_names(tmp_path):
    msg = refused(tmp_path, HEAD + "resources:\n  providers: [runpod]\n  gpu: H100\n  gpus_per_node: 3\n"
                  "trainer:\n  model: gpt2-124m\n  steps: 100\n  batch_size: 48\n  parallel:\n    tp: 2\n")
    # old: "job.yaml:3: (top level): trainer.parallel.tp (2) must divide …"
    assert msg.startswith("job.yaml:13: trainer.parallel.tp (2) must divide the job's GPUs"), msg


@pytest.mark.parametrize("body,line,start", [
    # the batch that does not split over the data-parallel ranks: the batch_size line
    ("resources:\n  providers: [runpod]\n  gpu: H100\n  gpus_per_node: 8\ntrainer:\n  model: gpt2-124m\n"
     "  steps: 100\n  batch_size: 12\n  parallel: {dp_shard: 8}\n", 11, "trainer.batch_size (12)"),
    # a cpu job on a cloud: the gpu line
    ("resources:\n  providers: [runpod]\n  gpu: cpu\ntrainer:\n  model: tiny\n  steps: 10\n", 6,
     "resources.gpu: cpu runs only"),
    # a field the message names that the file leaves out (a default): the deepest part it gives
    ("resources:\n  providers: [runpod]\n  gpu: H100\n  gpus_per_node: 3\ntrainer:\n  model: gpt2-124m\n"
     "  steps: 100\n  parallel: {dp_shard: 3}\n", 8, "trainer.batch_size (8) must be divisible"),
])
def test_cross_field_errors_name_the_line_of_their_field(tmp_path, body, line, start):
    msg = refused(tmp_path, HEAD + body)
    assert msg.startswith(f"job.yaml:{line}: {start}"), msg
    assert "(top level)" not in msg


def test_a_field_error_keeps_its_own_line(tmp_path):
    msg = refused(tmp_path, HEAD + "resources:\n  providers: [runpod]\n  gpu: H100\n  gpuz: 8\ntrainer:\n"
                  "  model: tiny\n  steps: 10\n")
    assert msg.startswith("job.yaml:7: resources.gpuz: unknown key"), msg


# ---- 16: a key written twice -----------------------------------------------------------------

def test_duplicate_top_level_key_is_refused(tmp_path):
    msg = refused(tmp_path, "name: dup\nname: dup2\nresources:\n  providers: [runpod]\n  gpu: H100\n"
                  "trainer:\n  model: gpt2-124m\n  steps: 100\n")
    assert msg == ("job.yaml:2: name: given twice (first at line 1); YAML would keep only the last one "
                   "silently — remove one")


def test_duplicate_nested_key_names_its_path(tmp_path):
    msg = refused(tmp_path, "name: dupn\nresources:\n  providers: [runpod]\n  gpu: H100\ntrainer:\n"
                  "  model: gpt2-124m\n  steps: 100\n  lr: 0.001\n  steps: 200\n")
    assert msg.startswith("job.yaml:9: trainer.steps: given twice (first at line 7)"), msg


def test_a_merge_key_still_overrides(tmp_path):
    """`<<: *base` then a key of the base: YAML's override, not a key written twice."""
    f = tmp_path / "job.yaml"
    f.write_text("name: mrg\nresources: &r {providers: [runpod], gpu: H100}\ncheckpoint:\n  uri: /tmp/x\n"
                 "trainer:\n  model: tiny\n  steps: 10\nbudget:\n  <<: {max_usd: 5}\n  max_usd: 7\n")
    assert load_spec(f).budget.max_usd == 7


def test_duplicate_key_exits_2_with_one_line(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("name: dup\nname: dup2\nresources:\n  providers: [runpod]\n  gpu: H100\n"
                 "trainer:\n  model: gpt2-124m\n  steps: 100\n")
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "up", str(f), "--dry-run"],
                       capture_output=True, text=True, cwd=ROOT,
                       env={"PATH": "/usr/bin:/bin", "DTRUN_HOME": str(tmp_path / "home")})
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr + p.stdout
    assert len(p.stderr.strip().splitlines()) == 1
    assert f"{f}:2: name: given twice" in p.stderr
