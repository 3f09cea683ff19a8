from orchestrator.contract import runuri


def test_moto_round_trip_through_runuri(s3_bucket):
    uri = runuri.join(s3_bucket, "run", "progress.json")
    assert runuri.read_json(uri) is None
    runuri.write_json(uri, {"step": 3})
    assert runuri.read_json(uri) == {"step": 3}
    assert runuri.list_dir(runuri.join(s3_bucket, "run")) == ["progress.json"]
