"""The 5-D mesh ``(pp, dp_replicate, dp_shard, cp, tp)`` of ``build_meshes`` (trainer/parallel_dims.py)
under real torchrun/gloo on 4 ranks: each view's process group holds the ranks the rank maths
(``ParallelDims.dp_rank``/``cp_rank``/``pp_rank``) says, cp is folded into the FSDP mesh, and a
pp = cp = 1 job keeps the meshes it had before; ep with cp is refused by ``build_meshes``."""

from __future__ import annotations

import ast

import pytest
from conftest import torchrun_script

pytestmark = pytest.mark.slow

_SCRIPT = '''
import os, sys
import torch.distributed as dist
from trainer.errors import ConfigError
from trainer.parallel_dims import ParallelDims, build_meshes
dist.init_process_group("gloo")
r = dist.get_rank()
def ranks(m):
    return None if m is None else sorted(dist.get_process_group_ranks(m.get_group()))
CASES = {"pp2dp2": dict(dp_shard=2, pp=2), "pp2tp2": dict(dp_shard=1, tp=2, pp=2),
         "pp2rep2": dict(dp_shard=1, dp_replicate=2, pp=2), "cp2dp2": dict(dp_shard=2, cp=2),
         "pp2cp2": dict(dp_shard=1, pp=2, cp=2), "rep2cp2": dict(dp_shard=1, dp_replicate=2, cp=2)}
out = {}
for name, kw in CASES.items():
    d = ParallelDims(**{"tp": 1, "ep": 1, "world_size": 4, **kw})
    m = build_meshes(d, "cpu")
    out[name] = {"names": m.dense.mesh_dim_names, "pp": ranks(m.pp), "cp": ranks(m.cp), "tp": ranks(m.tp),
                 "fsdp": None if m.fsdp is None else (m.fsdp.mesh_dim_names, m.fsdp.mesh.tolist()),
                 "dp_rank": d.dp_rank(r), "cp_rank": d.cp_rank(r), "pp_rank": d.pp_rank(r)}
m = build_meshes(ParallelDims(2, 2, 1, 4), "cpu")
out["dp2tp2"] = {"names": m.dense.mesh_dim_names, "pp": m.pp, "cp": m.cp, "fsdp": m.fsdp.mesh_dim_names}
try:
    build_meshes(ParallelDims(2, 1, 2, 4, cp=2), "cpu")
except ConfigError as e:
    out["cp_refused"] = str(e)
# One file per rank: four ranks printing long lines to one pipe interleave them (seen here).
with open(os.path.join(sys.argv[1], f"meshes{r}.txt"), "w") as f:
    f.write(repr(out))
dist.destroy_process_group()
'''


def test_nd_mesh_groups_follow_the_rank_maths(tmp_path):
    got = torchrun_script(tmp_path, _SCRIPT, 4, str(tmp_path)).stdout
    by = {r: ast.literal_eval((tmp_path / f"meshes{r}.txt").read_text()) for r in range(4)
          if (tmp_path / f"meshes{r}.txt").exists()}
    assert set(by) == {0, 1, 2, 3}, got[-2000:]
    nd = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    for r, out in by.items():
        # rank = (((pp·R + rep)·S + s)·C + c)·T + t
        assert out["pp2dp2"] == {"names": nd, "pp": [r % 2, r % 2 + 2], "cp": None, "tp": None,
                                 "fsdp": (("dp_shard",), [r // 2 * 2, r // 2 * 2 + 1]),
                                 "dp_rank": r % 2, "cp_rank": 0, "pp_rank": r // 2}
        assert out["pp2tp2"]["tp"] == [r // 2 * 2, r // 2 * 2 + 1] and out["pp2tp2"]["fsdp"] is None
        assert out["pp2tp2"]["pp"] == [r % 2, r % 2 + 2]
        assert out["pp2rep2"]["fsdp"] == (("dp_replicate", "dp_shard"), [[r // 2 * 2], [r // 2 * 2 + 1]])
        # cp folded into the FSDP/gradient mesh: the cp ranks of a batch slice shard it too.
        assert out["cp2dp2"]["fsdp"] == (("dp_shard_cp",), [0, 1, 2, 3])
        assert out["cp2dp2"]["cp"] == [r // 2 * 2, r // 2 * 2 + 1] and out["cp2dp2"]["dp_rank"] == r // 2
        assert out["cp2dp2"]["cp_rank"] == r % 2
        assert out["pp2cp2"]["fsdp"] == (("dp_shard_cp",), [r // 2 * 2, r // 2 * 2 + 1])
        assert out["pp2cp2"]["pp"] == [r % 2, r % 2 + 2]
        assert out["rep2cp2"]["fsdp"] == (("dp_replicate", "dp_shard_cp"), [[0, 1], [2, 3]])
        # pp = cp = 1: the meshes of before, no 5-D mesh.
        assert out["dp2tp2"] == {"names": ("dp_shard", "tp"), "pp": None, "cp": None, "fsdp": ("dp_shard",)}
        # ep has no place in the 5-D mesh: refused.
        assert "ep (2) > 1 with pp (1) or cp (2) > 1 is not supported" in out["cp_refused"]
