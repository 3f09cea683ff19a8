"""dtrun and SkyPilot's local API server (providers/skypilot/api.py ``SkyAPI.ensure_server``): a
healthy one reused and never stopped, the one dtrun started stopped once, a half-dead one one
message, and the plugins file a server dtrun starts is given (providers/skypilot/vastquery.py).
SkyPilot's server checks and start/stop are replaced: a real server is never started here."""

from __future__ import annotations

import os

import pytest
import yaml

from providers import errors as perr
from providers.skypilot import vastquery

CLOUDS = ("runpod", "lambda", "vast")

class _Server:
    """SkyPilot's server checks and start/stop, replaced (a real server is never started here)."""

    def __init__(self, monkeypatch, healthy: bool, start_error: str | None = None, port_held: bool = False,
                 home=None):
        import sky
        from sky.client import sdk as sky_sdk
        from sky.server import common as server_common

        from providers.skypilot import api as sky_api

        self.started = self.stopped = 0
        if home is not None:  # dtrun writes SkyPilot's plugins file there before it starts a server
            monkeypatch.setenv("DTRUN_HOME", str(home))
        monkeypatch.setattr(sky_api, "_SERVER", {"checked": False, "started_by_dtrun": False})
        monkeypatch.setattr(sky_api, "HALF_DEAD_WAIT_SECONDS", 0.0)
        monkeypatch.setattr(sky_sdk, "_local_api_server_running", lambda *a, **k: port_held)
        monkeypatch.setattr(server_common, "is_api_server_local", lambda *a, **k: True)
        status = server_common.ApiServerStatus.HEALTHY if healthy else server_common.ApiServerStatus.UNHEALTHY
        monkeypatch.setattr(server_common, "get_api_server_status",
                            lambda *a, **k: server_common.ApiServerInfo(status=status))

        def start(*a, **k):
            self.started += 1
            if start_error:
                raise RuntimeError(start_error)

        monkeypatch.setattr(sky, "api_start", start)
        monkeypatch.setattr(sky, "api_stop", lambda: setattr(self, "stopped", self.stopped + 1))


def test_a_running_api_server_is_reused_and_never_stopped(monkeypatch, tmp_path):
    from providers.skypilot import SkyPilotProvider
    from providers.skypilot.api import SkyAPI

    srv = _Server(monkeypatch, home=tmp_path, healthy=True)
    SkyAPI().ensure_server()
    SkyPilotProvider("runpod").close()
    assert (srv.started, srv.stopped) == (0, 0)


def test_the_server_dtrun_started_is_stopped_once_when_its_controller_exits(monkeypatch, tmp_path):
    from providers.skypilot import SkyPilotProvider
    from providers.skypilot.api import SkyAPI

    srv = _Server(monkeypatch, home=tmp_path, healthy=False)
    SkyAPI().ensure_server()
    SkyAPI().ensure_server()
    assert srv.started == 1
    for cloud in CLOUDS:  # the controller closes each of its providers
        SkyPilotProvider(cloud).close()
    assert srv.stopped == 1


def test_a_half_dead_server_is_one_message_saying_what_to_run(monkeypatch, tmp_path):
    from providers.skypilot import map_sky_error
    from providers.skypilot.api import SkyAPI

    _Server(monkeypatch, home=tmp_path, healthy=False, start_error="SkyPilot API server process exited unexpectedly.\n"
                                                    "View logs at: ~/.sky/api_server/server.log")
    with pytest.raises(RuntimeError) as ei:
        SkyAPI().ensure_server()
    err = map_sky_error(ei.value, "runpod")
    assert isinstance(err, perr.Transient)
    assert "sky api stop" in str(err) and str(err).count("\n") <= 1


def test_a_cli_command_that_started_the_server_stops_it(monkeypatch, tmp_path):
    from providers import registry
    from providers.skypilot.api import SkyAPI

    srv = _Server(monkeypatch, home=tmp_path, healthy=False)
    SkyAPI().ensure_server()  # e.g. `dtrun gc` listing SkyPilot clusters
    registry.close_all()
    assert (srv.started, srv.stopped) == (1, 1)


def test_a_server_holding_the_port_without_answering_is_half_dead_without_a_second_start(monkeypatch, tmp_path):
    from providers.skypilot import map_sky_error
    from providers.skypilot.api import SkyAPI

    srv = _Server(monkeypatch, home=tmp_path, healthy=False, port_held=True)
    with pytest.raises(RuntimeError) as ei:
        SkyAPI().ensure_server()
    assert srv.started == 0
    err = map_sky_error(ei.value, "vast")
    assert isinstance(err, perr.Transient) and "sky api stop" in str(err)


def test_the_api_server_dtrun_starts_gets_the_plugins_file(monkeypatch, tmp_path):
    import sky

    _Server(monkeypatch, home=tmp_path, healthy=False)
    monkeypatch.delenv(vastquery.PLUGINS_ENV, raising=False)
    seen = []
    monkeypatch.setattr(sky, "api_start", lambda *a, **k: seen.append(os.environ.get(vastquery.PLUGINS_ENV)))
    from providers.skypilot.api import SkyAPI

    SkyAPI().ensure_server()
    [path] = seen
    assert path == str(tmp_path / "skypilot" / "plugins.yaml")
    assert yaml.safe_load(open(path))["plugins"] == [{"class": vastquery.PLUGIN_CLASS}]
    assert vastquery.PLUGINS_ENV not in os.environ  # only the server's start saw it
