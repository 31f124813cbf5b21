"""Typed configuration: every field a flag and an environment variable; a boolean flag alone means true."""

import pytest

from services.cli import main
from services.common.config import parse_config
from services.gateway.config import GatewayConfig
from services.launcher import UpConfig, unknown_variables
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


@pytest.mark.parametrize(("config", "argv", "says"), [
    (SchedulerConfig, ["--log-level", "bogus"], "--log-level: one of debug, info, warning, error, critical"),
    (SchedulerConfig, ["--port", "70000"], "--port: a port, 0 to 65535"),  # it listened on 70000 mod 65536
    (GatewayConfig, ["--grpc-port", "-1"], "--grpc-port: a port, 0 to 65535"),
    (UpConfig, ["--port", "31600", "--grpc-port", "31600"], "one port each"),
    (UpConfig, ["--detokenizer-port", "30000"], "one port each"),  # the gateway's default HTTP port
    (UpConfig, ["--gateway-workers", "0"], "--gateway-workers: at least 1"),
])
def test_bad_options_are_usage_errors(capsys, config, argv, says):
    """Said at once, as argparse says its own (exit status 2), not as a traceback or a surprise later."""
    with pytest.raises(SystemExit) as exited:
        parse_config(config, argv)
    assert exited.value.code == 2 and says in capsys.readouterr().err


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


def test_the_flatwire_command_helps_on_stdout_and_refuses_an_unknown_command(capsys):
    main(["--help"])
    assert "commands:" in capsys.readouterr().out
    main(["--version"])
    assert capsys.readouterr().out.startswith("flatwire ")
    with pytest.raises(SystemExit) as exited:
        main(["bogus"])
    assert exited.value.code == 2 and "unknown command 'bogus'" in capsys.readouterr().err


def test_a_misspelt_variable_is_warned_about(monkeypatch, capsys):
    assert unknown_variables({"FLATWIRE_MAX_RUNING_REQUESTS": "8", "FLATWIRE_MAX_RUNNING_REQUESTS": "8",
                              "FLATWIRE_GATEWAY_WORKERS": "2", "FLATWIRE_TAG": "dev", "HOME": "/root"}) == [
        "FLATWIRE_MAX_RUNING_REQUESTS"]
    monkeypatch.setenv("FLATWIRE_MAX_RUNING_REQUESTS", "8")
    with pytest.raises(SystemExit):  # `up` says it at once (a service, once it is up)
        main(["up", "--gateway-workers", "0"])
    assert "FLATWIRE_MAX_RUNING_REQUESTS is no option of any flatwire service" in capsys.readouterr().err
