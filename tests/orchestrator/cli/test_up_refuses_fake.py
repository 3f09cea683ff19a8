"""`providers: [fake]` in a job (issue 33 item 17): the fake cloud runs no trainer, so `dtrun up` on
the cloud nothing drives would stay PROVISIONING forever. The fake provider says so through its
credentials check (usable in memory, or as a file a driver configured): `up` refuses with one line
naming the field, exit 5 (no usable provider), nothing rented; a driven cloud file is rented on."""

from __future__ import annotations

import yaml

from orchestrator.cli.app import main
from orchestrator.contract.errors import EXIT_PROVIDER
from providers import registry
from providers import errors as perr
from providers.fake import FakeProvider, default_path


def _job(tmp_path):
    f = tmp_path / "fj.yaml"
    f.write_text(yaml.safe_dump({
        "name": "fj", "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1},
        "trainer": {"model": "tiny", "steps": 100, "batch_size": 8, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run", "every_steps": 50}, "budget": {"max_usd": 100}}))
    return f


def test_up_on_the_undriven_fake_cloud_is_refused_in_one_line(tmp_path, dtrun_home, capsys):
    registry.unregister("fake")
    f = _job(tmp_path)
    assert main(["up", str(f), "--yes"]) == EXIT_PROVIDER
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "resources.providers" in err[0] and "'fake'" in err[0] and "PROVISIONING" in err[0]
    assert "nothing rented" in err[0]
    assert FakeProvider(default_path()).instances() == []
    # the dry run still shows the plan, with the same reason for not renting
    main(["up", str(f), "--dry-run"])
    out = capsys.readouterr().out
    assert "Budget:" in out and "resources.providers: 'fake'" in out
    registry.unregister("fake")


def test_the_fake_cloud_is_usable_in_memory_and_once_a_driver_configured_its_file(tmp_path):
    FakeProvider().check_credentials()  # in memory: whoever made it drives it
    path = tmp_path / "cloud.json"
    bare = FakeProvider(path)  # what `providers: [fake]` gets from the registry
    try:
        bare.check_credentials()
        raise AssertionError("an undriven cloud file was accepted")
    except perr.AuthError as e:
        assert "resources.providers" in str(e)
    FakeProvider(path, provision_seconds=5)  # a test sets the shared cloud up
    bare.check_credentials()
    other = tmp_path / "other.json"
    FakeProvider(other).configure(preemptions_per_hour=0.5)
    FakeProvider(other).check_credentials()
