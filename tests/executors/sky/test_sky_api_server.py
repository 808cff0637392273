"""A cloud launch that has to start SkyPilot's API server says so, keeps SkyPilot's coloured lines out of
our output, and stops the server again when the launch is refused (no enabled cloud).

SkyPilot's API server is faked at the SDK seam: starting a real one takes half a minute and about
1.4 GB; the fake logs through SkyPilot's own logger, coloured, as the real start-up does.
"""

from __future__ import annotations

from typer.testing import CliRunner

from skyspot.cli.main import app

runner = CliRunner()


def fake_server(monkeypatch, clouds: list[str]) -> list[str]:
    import sky
    from sky import sky_logging
    from sky.client import sdk

    from skyspot.executors.sky import sdk as sky_executor

    calls: list[str] = []
    logger = sky_logging.init_logger("sky.server.common")

    def enabled():
        calls.append("enabled_clouds")
        logger.info("\x1b[2mFailed to connect to SkyPilot API server. Starting a local server.\x1b[0m")
        sky_logging.print("\x1b[32m✓ SkyPilot API server started.\x1b[0m")
        return lambda: clouds

    monkeypatch.setattr(sky_executor, "api_server_healthy", lambda: False)
    monkeypatch.setattr(sky_executor, "_started_api_server", False)
    monkeypatch.setattr(sdk, "enabled_clouds", enabled)
    monkeypatch.setattr(sdk, "api_stop", lambda: calls.append("api_stop"))
    monkeypatch.setattr(sky, "get", lambda request: request())
    return calls


def test_a_refused_cloud_launch_says_it_starts_the_server_and_stops_it_again(monkeypatch, capfd):
    calls = fake_server(monkeypatch, clouds=[])
    result = runner.invoke(app, ["launch", "tiny", "--cloud", "-y", "--store", "s3://my-bucket/x"])
    captured = capfd.readouterr()
    said = result.stderr + captured.err + captured.out
    assert result.exit_code == 1
    assert "starting SkyPilot's local API server to ask which clouds are enabled" in said
    assert "SkyPilot has no enabled cloud" in result.stderr
    assert "the SkyPilot API server started for this check is stopped again" in result.stderr
    assert calls == ["enabled_clouds", "api_stop"]
    assert "\x1b[" not in said and "Starting a local server" not in said and "API server started." not in said


def test_a_server_already_running_is_neither_announced_nor_stopped(monkeypatch):
    from skyspot.executors.sky import sdk as sky_executor

    calls = fake_server(monkeypatch, clouds=[])
    monkeypatch.setattr(sky_executor, "api_server_healthy", lambda: True)
    result = runner.invoke(app, ["launch", "tiny", "--cloud", "-y", "--store", "s3://my-bucket/x"])
    assert result.exit_code == 1 and "SkyPilot has no enabled cloud" in result.stderr
    assert "starting SkyPilot's local API server" not in result.stderr and "stopped again" not in result.stderr
    assert calls == ["enabled_clouds"]
