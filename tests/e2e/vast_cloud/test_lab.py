"""The Vast lab on first contact with SkyPilot 0.14.1's own Vast code, in-process: its keys
registered with the account, what its optimizer and template make of a ``use_spot`` H100 job, its
provisioner's ``run_instances`` (the offer search and the create body as the vastai SDK sends
them), a real instance over SSH as root on the port the API reports, an outbid instance as
SkyPilot's status query sees it, and the bill stopping at destroy.

It records which of the research's predictions (``shared/research/runpod-vast-launch-path.md``
§2, the short answer's findings 2 and 3) held on the wire:
* the GPU filter never reaches ``POST /bundles/`` (the SDK's pre-parser drops quoted values), so
  SkyPilot rents the top offer of the whole market — not the H100 asked for;
* ``use_spot`` never reaches the template (``Preemptible: None``): an on-demand instance, while
  SkyPilot's optimizer priced it at the catalog's spot price $0.00;
* had ``Preemptible`` been true, SkyPilot would bid the offer's ``min_bid``, which the SDK's
  chunked post-processing has zeroed: a $0 bid, refused;
* only ``vast.create_instance_kwargs.price`` makes an interruptible instance (at that price).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.e2e.clouds.vastlab import api as vapi
from tests.e2e.clouds.vastlab import lab as lablib
from tests.e2e.clouds.vastlab import machine
from tests.e2e.vast_cloud.conftest import REPO
from tests.e2e.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BID = 1.2  # $/h per instance, as dtrun would pass it (vast.create_instance_kwargs.price)
PROBE = r"""
import json, os, sys, time
import jinja2, yaml, sky
from sky import clouds
from sky.authentication import setup_vast_authentication
from sky.provision import common
from sky.provision.vast import instance, utils
from sky.utils import auth_utils, resources_utils

out = {}
auth = setup_vast_authentication({"auth": {"ssh_user": "root"}})  # GET /ssh/, then POST /ssh/
out["private_key"], pub = auth_utils.get_or_generate_keys()
# what SkyPilot makes of `accelerators: H100:1, use_spot: true`
r = sky.Resources(infra="vast", accelerators="H100:1", use_spot=True)
feasible = clouds.Vast()._get_feasible_launchable_resources(r).resources_list
out["optimizer_cost"] = {x.instance_type: x.get_cost(3600) for x in feasible}
best = min(feasible, key=lambda x: (x.get_cost(3600), x.instance_type))
region = clouds.Vast.regions_with_offering(best.instance_type, None, True, None, None)[0]
v = clouds.Vast().make_deploy_resources_variables(best.copy(region=region.name),
                                                 resources_utils.ClusterName("c", "c"), region, None, 1)
out["deploy_keys"] = sorted(v)
tpl = open(os.path.join(os.path.dirname(sky.__file__), "templates", "vast-ray.yml.j2")).read()
y = yaml.safe_load(jinja2.Template(tpl).render(**v, num_nodes=1, cluster_name_on_cloud="c", disk_size=256,
                                               credentials={}))
node, provider = y["available_node_types"]["ray_head_default"]["node_config"], y["provider"]
out["instance_type"], out["preemptible"] = node["InstanceType"], node["Preemptible"]

def launch(name, node_over=None, kwargs=None):
    prov = dict(provider, **({"create_instance_kwargs": kwargs} if kwargs else {}))
    cfg = common.ProvisionConfig(provider_config=prov, authentication_config={"ssh_public_key": pub},
                                 docker_config={}, node_config=dict(node, **(node_over or {})), count=1, tags={},
                                 resume_stopped_nodes=True, ports_to_open_on_launch=None)
    t0 = time.time()
    try:
        rec = instance.run_instances(prov["region"], name, name, cfg)
    except Exception as e:
        body = getattr(getattr(e, "response", None), "text", "")
        return {"error": f"{type(e).__name__}: {e} {body}"}
    info = instance.get_cluster_info(prov["region"], name, prov)
    created = rec.created_instance_ids[0]  # an int: show_instance's id; list_instances keys are str
    [i] = info.instances[str(created)]
    return {"id": str(created), "created_id_type": type(created).__name__, "seconds": time.time() - t0, "ssh_port": i.ssh_port,
            "external_ip": i.external_ip, "internal_ip": i.internal_ip,
            "query": {k: s.value for k, (s, _) in instance.query_instances(name, name, prov).items()}}

out["as_rendered"] = launch("vt-od")                                  # what `sky launch --use-spot` does
out["preemptible_true"] = launch("vt-zero", {"Preemptible": True})    # what the code means to do
out["low_bid"] = launch("vt-low", kwargs={"price": 0.05})
out["bid"] = launch("vt-bid", kwargs={"price": float(sys.argv[1])})   # the config route dtrun can use
print(json.dumps(out))
"""
AFTER = r"""
import json
from sky.provision.vast import instance, utils
prov = {"region": "x"}
out = {"listed": {k: v["status"] for k, v in utils.list_instances().items()},
       "query_bid": {k: s.value for k, (s, _) in instance.query_instances("vt-bid", "vt-bid", prov).items()}}
for name in ("vt-od", "vt-bid"):
    instance.terminate_instances(name, prov)
out["after_terminate"] = utils.list_instances()
print(json.dumps(out))
"""


def _py(code: str, env: dict, *args: str) -> dict:
    p = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _ssh(key: str, host: str, port: int, cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-i", key, "-p", str(port), "-o", "StrictHostKeyChecking=no",
                           "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
                           "-o", "ConnectTimeout=3", f"root@{host}", cmd], capture_output=True, text=True, timeout=60)


def _rows() -> dict[str, dict]:
    return {i["label"]: i for i in lablib.call("status")["instances"]}


def test_skypilots_vast_path_first_contact(vs_lab):
    lablib.write_home()  # SkyPilot's Vast catalog as shipped (a `dtrun prices --refresh` rewrites it)
    assert not lablib.call("status")["no_capacity"]  # the whole market (another test may have left it)
    t0, since = time.monotonic(), time.time()
    out = _py(PROBE, vs_lab, str(BID))
    held: dict[str, bool] = {}

    # the optimizer: an H100 spot job priced at the catalog's SpotPrice, $0.00 (fetch_vast's zeroed min_bid)
    assert out["optimizer_cost"] and set(out["optimizer_cost"].values()) == {0.0}, out["optimizer_cost"]
    # use_spot never reaches the template: no `use_spot` deploy variable, `Preemptible:` renders to null
    assert "use_spot" not in out["deploy_keys"] and out["preemptible"] is None, out
    held["use_spot dropped: on-demand, priced $0.00"] = True
    assert out["instance_type"].split("-")[1].startswith("H100"), out

    # what reached the API: the SDK's defaults only, no GPU/count/disk/geolocation filter
    qs = [q for q in lablib.call("queries")["queries"] if q["t"] >= since]  # this probe's
    searches = [q["body"] for q in qs if q["route"] == "bundles"]
    assert searches and all(set(s) == {"verified", "external", "rentable", "order", "type", "allocated_storage"}
                            for s in searches), searches
    assert all(s["type"] == "on-demand" for s in searches), searches  # even for the spot launches
    asks = {q["body"]["label"]: q["body"] for q in qs if q["route"] == "asks"}

    rows = _rows()
    od, bid = out["as_rendered"], out["bid"]
    assert "error" not in od and "error" not in bid, out
    # filters dropped → the market's top offer (after the SDK's chunking), not the H100 asked for
    assert rows["vt-od-head"]["gpu_name"] == vapi.TOP_GPU, rows["vt-od-head"]
    held["GPU filter dropped: the top offer rented, not an H100"] = True
    assert rows["vt-od-head"]["is_bid"] is False and asks["vt-od-head"]["price"] is None  # on-demand
    # Preemptible true would bid min_bid — zeroed by the SDK's chunked search: a $0 bid, refused
    assert "invalid_price" in out["preemptible_true"]["error"] and "$0.0000/hr" in out["preemptible_true"]["error"], out
    assert asks["vt-zero-head"]["price"] == 0, asks
    held["chunked search zeroes min_bid: Preemptible=true bids $0"] = True
    assert "below the current minimum bid" in out["low_bid"]["error"], out
    # the config route: an interruptible bid at the price passed (but still on the wrong GPU)
    assert rows["vt-bid-head"]["is_bid"] is True and asks["vt-bid-head"]["price"] == BID, rows["vt-bid-head"]
    assert rows["vt-bid-head"]["gpu_name"] != "H100 SXM", rows["vt-bid-head"]

    # SSH as root on the port the API reports (both fields agree, not 22), the instance's own root
    r = rows["vt-od-head"]
    assert od["ssh_port"] == r["ssh_port"] == int(r["ports"]["22/tcp"][0]["HostPort"]) != 22, (od, r)
    assert od["external_ip"] == machine.NET.host_ip and od["internal_ip"] == r["local_ipaddrs"], od
    assert od["query"] == {od["id"]: "UP"}, od
    key = out["private_key"]
    wait_until(lambda: _ssh(key, od["external_ip"], od["ssh_port"], "true").returncode == 0, 60,
               "no SSH on the instance's reported port")
    ssh_after = time.monotonic() - t0
    s = _ssh(key, od["external_ip"], od["ssh_port"],
             "id -un; hostname; ls -A ~ | sort | tr '\\n' ' '; echo; ps -e --no-headers | wc -l; "
             f"ls -A {REPO} 2>/dev/null | wc -l; "
             "wc -c < ~/.vast_api_key; readlink ~/skypilot-runtime; "
             "tr '\\0' '\\n' < /proc/$(pgrep -xo sleep)/environ | grep ^__SOURCE=")
    user, host, home, nproc, work, keylen, rt, source = s.stdout.splitlines()
    assert (user, host) == ("root", f"C.{od['id']}"), s.stdout
    # a clean /root: the image's dotfiles, the runtime, and what onstart wrote (key, api key, .no_auto_tmux)
    assert home.split() == [".bashrc", ".local", ".no_auto_tmux", ".profile", ".ssh", ".vast_api_key",
                            "onstart.sh", "skypilot-runtime"], home
    assert int(nproc) < 15 and work == "0" and int(keylen) > 20 and rt.endswith("skypilot-runtime"), s.stdout
    assert source == "__SOURCE=skypilot", s.stdout  # the create body's env: the instance's main process's

    # outbid: stopped without notice; SkyPilot's query maps `exited` to STOPPED; storage still billing
    assert lablib.call("outbid", {"name": "vt-bid-head"})["outbid"] == ["vt-bid-head"]
    b1 = {b["label"]: b for b in lablib.call("bill")["instances"]}["vt-bid-head"]
    time.sleep(1.5)
    after = _py(AFTER, vs_lab)
    assert after["listed"][bid["id"]] == "EXITED" and after["query_bid"] == {bid["id"]: "STOPPED"}, after
    assert after["after_terminate"] == {}, after
    assert machine.all_netns() == []
    bill = {b["label"]: b for b in lablib.call("bill")["instances"]}
    b2 = bill["vt-bid-head"]
    assert b2["how"] == "outbid" and b2["price_per_hour"] == BID and b2["exists_seconds"] > b1["exists_seconds"] + 1
    assert b2["running_seconds"] == pytest.approx(b1["running_seconds"], abs=1e-3)  # no compute while exited
    assert b2["storage_usd"] > b1["storage_usd"]
    assert bill["vt-od-head"]["how"] == "destroyed" and bill["vt-od-head"]["price_per_hour"] == r["dph_base"]
    # destroyed → billing stopped
    total = lablib.call("bill")
    assert total["billing"] == 0
    time.sleep(1.0)
    assert lablib.call("bill")["total_usd"] == total["total_usd"]
    for b in bill.values():
        assert b["compute_usd"] == pytest.approx(b["running_seconds"] / 3600 * b["price_per_hour"], rel=1e-3, abs=2e-6)
    print(f"vast first contact: predictions held {held}; launch → instance listed RUNNING with a port "
          f"{od['seconds']:.1f} s (SkyPilot polls every 10 s), → SSH login {ssh_after:.1f} s after the probe started; "
          f"on-demand got {rows['vt-od-head']['gpu_name']} at ${r['dph_base']}/h, the bid {rows['vt-bid-head']['gpu_name']} "
          f"at ${BID}/h")
