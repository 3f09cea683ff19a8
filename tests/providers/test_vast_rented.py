"""After a Vast launch, dtrun reads back what SkyPilot 0.14.1 rented: its offer search carries no
GPU filter (the vastai SDK drops quoted values; seen on the Vast lab: an RTX 4090 for an H100
job), so a wrong GPU, GPU count or kind (on-demand for a spot offer) is destroyed at once and the
offer refused (providers/skypilot/vastcheck.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from providers import errors as perr
from providers.base import LaunchRequest, Offer

from provider_fakes import FakeSkyAPI

H100 = Offer(provider="vast", region="Texas, US, NA", gpu="H100-SXM", gpus_per_node=1, spot=True,
             price_per_gpu_hour=0.75, instance_type="1x-H100_SXM-32-65536", spot_bid=0.748)


class RentedAPI(FakeSkyAPI):
    """The SkyPilot seam, plus the row Vast lists for the launched cluster."""

    def __init__(self, row):
        super().__init__()
        self.row = row

    def vast_instance(self, cluster_name):
        self.calls.append(("vast_instance", cluster_name))
        return self.row


def _launch(tmp_path, row, offer=H100):
    from providers.skypilot import SkyPilotProvider

    api = RentedAPI(row)
    prov = SkyPilotProvider("vast", api, home=tmp_path / "dtrun-home")
    return api, lambda: prov.launch(LaunchRequest("vj", 1, offer, 1, ["true"]))


def test_the_top_offer_of_the_market_is_destroyed_and_the_offer_refused(tmp_path, credentials):
    api, launch = _launch(tmp_path, {"id": 31000010, "label": "x-head", "gpu_name": "RTX 4090", "num_gpus": 1,
                                     "is_bid": True})
    with pytest.raises(perr.NotSupported) as e:
        launch()
    assert "'RTX 4090', not 'H100 SXM'" in str(e.value) and "31000010" in str(e.value), e.value
    assert ("down", "dtrun-vj-a1") in api.calls  # not left running (or billing storage)


@pytest.mark.parametrize("row, why", [
    ({"gpu_name": "H100 SXM", "num_gpus": 1, "is_bid": False}, "on-demand, not an interruptible bid"),
    ({"gpu_name": "H100 SXM", "num_gpus": 8, "is_bid": True}, "8 GPUs, not 1"),
])
def test_wrong_kind_or_count_is_refused(tmp_path, credentials, row, why):
    api, launch = _launch(tmp_path, {"id": 1, **row})
    with pytest.raises(perr.NotSupported, match=why):
        launch()
    assert ("down", "dtrun-vj-a1") in api.calls


def test_the_offer_rented_as_quoted_is_kept(tmp_path, credentials):
    api, launch = _launch(tmp_path, {"id": 1, "gpu_name": "H100 SXM", "num_gpus": 1, "is_bid": True})
    h = launch()
    assert h.data["vast_check"] == "ok: 1x H100 SXM, bid"
    assert not [c for c in api.calls if c[0] == "down"]


def test_instance_row_pages_like_the_sdk(monkeypatch):
    """GET /api/v1/instances/ with the bearer key, following next_token → after_token."""
    from providers.skypilot import vastcheck

    seen = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            u = urlsplit(self.path)
            q = {k: v[-1] for k, v in parse_qs(u.query).items()}
            seen.append((u.path, q.get("after_token"), self.headers.get("Authorization")))
            rows = [{"id": i, "label": f"c{i}-head"} for i in range(1, 31)]
            after = int(q.get("after_token") or 0)
            page = [r for r in rows if r["id"] > after][: int(q["limit"])]
            body = json.dumps({"instances": page, "next_token": str(page[-1]["id"]) if page[-1]["id"] < 30 else None})
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("VAST_URL", f"http://127.0.0.1:{srv.server_port}")
        assert vastcheck.instance_row("c27", "k3y")["id"] == 27
        assert vastcheck.instance_row("nope", "k3y") is None
    finally:
        srv.shutdown()
    assert seen[0] == ("/api/v1/instances/", None, "Bearer k3y") and seen[1][1] == "25", seen


def test_expected_gpu_is_skypilots_parse():
    from providers.skypilot.vastcheck import expected_gpu

    assert expected_gpu("1x-H100_SXM-32-65536") == "H100 SXM" and expected_gpu("2x-RTX_4090-32-65536") == "RTX 4090"
    assert expected_gpu(None) is None
