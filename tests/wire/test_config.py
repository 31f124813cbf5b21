"""Typed configuration: every field a flag and an environment variable; a boolean flag alone means true."""

import pytest

from services.common.config import parse_config
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig


def test_flags_environment_and_booleans(monkeypatch, capsys):
    assert parse_config(GatewayConfig, ["--incremental-streaming-output"]).incremental_streaming_output is True
    assert parse_config(GatewayConfig, ["--incremental-streaming-output", "off"]).incremental_streaming_output is False
    assert parse_config(GatewayConfig, []).incremental_streaming_output is False
    monkeypatch.setenv("FLATWIRE_STREAM_INTERVAL", "4")
    assert parse_config(GatewayConfig, []).stream_interval == 4
    assert parse_config(GatewayConfig, ["--stream-interval", "2"]).stream_interval == 2  # the flag wins
    with pytest.raises(SystemExit):
        parse_config(GatewayConfig, ["--incremental-streaming-output", "maybe"])
    with pytest.raises(SystemExit):  # a check across options: argparse's exit, with the message on stderr
        parse_config(GatewayConfig, ["--stream-interval", "0"])
    assert "--stream-interval: must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(GatewayConfig, ["--ssl-keyfile", "key.pem"])
    assert "give both" in capsys.readouterr().err


def test_help_gives_each_default_and_variable(capsys):
    with pytest.raises(SystemExit):
        parse_config(GatewayConfig, ["--help"], "flatwire gateway")
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in ("[default 30000; env FLATWIRE_PORT]", "[default 127.0.0.1:30010; env FLATWIRE_SCHEDULERS]",
                  "[default false; env FLATWIRE_INCREMENTAL_STREAMING_OUTPUT]", "[env FLATWIRE_API_KEY]"):
        assert shown in help_text


def test_services_started_alone_find_each_other_on_their_default_ports():
    assert parse_config(SchedulerConfig, []).port == 30010
    assert parse_config(GatewayConfig, []).schedulers == ["127.0.0.1:30010"]
