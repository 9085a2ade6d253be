"""One source of truth for options: defaults < TOML < environment < CLI, strict everywhere."""

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st
from islands.node.config import (
    ConfigError,
    Option,
    add_arguments,
    build_config,
    coerce,
    options,
    read_toml,
)


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args(argv))


def test_defaults_match_design():
    cfg = build_config({}, environ={})
    assert (cfg.diloco.window, cfg.diloco.alpha, cfg.diloco.outer_lr, cfg.diloco.outer_momentum) == (50, 0.5, 0.7, 0.9)
    assert cfg.diloco.tau == 5
    assert cfg.train.model == "tiny" and cfg.train.inner_opt == "adamw"


def test_precedence_file_env_cli(tmp_path):
    f = tmp_path / "node.toml"
    f.write_text('window = 40\nfragments = 2\nsteps = 7\n[train]\nbatch_size = 4\n')
    env = {"ISLANDS_STEPS": "9", "ISLANDS_JOIN": "/ip4/127.0.0.1/tcp/1/p2p/A,/ip4/127.0.0.1/tcp/2/p2p/B"}
    cfg = build_config(_parse(["--config", str(f), "--window", "30"]), environ=env)
    assert cfg.diloco.window == 30  # CLI over file
    assert cfg.diloco.fragments == 2  # file over default
    assert cfg.train.steps == 9  # env over file
    assert cfg.train.batch_size == 4  # [section] tables work too
    assert cfg.net.join == ["/ip4/127.0.0.1/tcp/1/p2p/A", "/ip4/127.0.0.1/tcp/2/p2p/B"]


def test_config_file_from_environment(tmp_path):
    f = tmp_path / "n.toml"
    f.write_text("steps = 3\n")
    assert build_config({}, environ={"ISLANDS_CONFIG": str(f)}).train.steps == 3


def test_repeatable_flags_and_booleans():
    cfg = build_config(_parse(["--join", "/ip4/1.2.3.4/tcp/5", "--join", "/ip4/1.2.3.4/tcp/6", "--dense"]), environ={})
    assert cfg.net.join == ["/ip4/1.2.3.4/tcp/5", "/ip4/1.2.3.4/tcp/6"] and cfg.train.dense


@pytest.mark.parametrize(
    "toml, message",
    [
        ("windwo = 3", "unknown key 'windwo'"),
        ("window = 'x'", "expected an integer"),
        ("[train]\nwindow = 3", "unknown key train.'window'"),
        ("window = [", "not valid TOML"),
        ("inner_opt = 'sgd'", "expected one of adamw, shampoo"),
        ("dense = 3", "expected true or false"),
    ],
)
def test_bad_config_files_name_the_field(tmp_path, toml, message):
    f = tmp_path / "bad.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        build_config({"config": str(f)}, environ={})


@pytest.mark.parametrize(
    "values, message",
    [
        ({"window": "20", "fragments": "4", "overlap": "5"}, "overlap 5 must be below window/fragments = 5"),
        ({"window": "3", "fragments": "4"}, "cannot be divided into 4 fragments"),
        ({"fragments": "5"}, "fragments 5 exceeds the 4 blocks"),
        ({"alpha": "1.5"}, "alpha must be in"),
        ({"steps": "0"}, "steps must be >= 1"),
        ({"model": "huge"}, "model must be one of"),
        ({"role": "satellite"}, "satellite needs --contact"),
        ({"role": "satellite", "contact": "now and then"}, "contact 'now and then' is not"),
        ({"contact": "up 10s every 30s"}, "contact applies to satellites only"),
        ({"swarm_key": "/nonexistent/islands/key"}, "swarm_key: "),
        ({"metrics_port": "-1"}, "metrics_port must be"),
        ({"join": "not-an-address"}, "is not a multiaddress"),
        ({"run_id": "a b"}, "run_id must be"),
        ({"parallel": "zero3"}, "expected one of ddp, fsdp"),
        ({"parallel": "fsdp", "inner_opt": "shampoo"}, "parallel fsdp works with inner_opt adamw only"),
        ({"data_announce": "nat"}, "data_announce must be HOST:PORT or p2p, got 'nat'"),
        ({"data_listen": "p2p"}, "data_listen must be HOST:PORT, got 'p2p'"),
    ],
)
def test_bad_values_name_the_option(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config({}, environ={f"ISLANDS_{k.upper()}": v for k, v in values.items()})


def test_unknown_environment_variable_is_an_error():
    with pytest.raises(ConfigError, match="ISLANDS_WINDOWS is not an option"):
        build_config({}, environ={"ISLANDS_WINDOWS": "3"})


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        read_toml("/nonexistent/node.toml")


def test_every_option_has_help_and_unique_flat_name():
    opts = options()
    assert all(o.help for o in opts.values())
    for name in ("join", "run_id", "listen", "announce", "identity", "steps", "window", "fragments", "overlap",
                 "alpha", "eval_every", "batch_size", "seq_len", "model", "inner_opt", "data", "role", "contact",
                 "compression", "run_dir", "log_json", "maddr_file", "swarm_key", "metrics_port"):
        assert name in opts, name  # DESIGN.md's CLI


_INT = options()["window"]


@given(st.text(max_size=20))
def test_coerce_int_never_crashes(text):
    try:
        value = coerce(_INT, text, "env")
    except ConfigError as e:
        assert "window" in str(e)
    else:
        assert isinstance(value, int)


@given(st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=8), st.booleans()))
def test_coerce_float_never_crashes(value):
    opt: Option = options()["alpha"]
    try:
        out = coerce(opt, value, "file")
    except ConfigError:
        return
    assert isinstance(out, float)


def test_every_network_bound_is_in_one_timeouts_value():
    import dataclasses

    from islands.node.config import Config
    from islands.node.timeouts import Timeouts

    cfg = Config()
    cfg = dataclasses.replace(cfg, net=dataclasses.replace(cfg.net, match_wait_s=3.0, wait_timeout_s=60.0, leave_timeout_s=4.0, end_wait_s=90.0))
    t = Timeouts.from_config(cfg)
    assert (t.match_wait_s, t.wait_timeout_s, t.leave_timeout_s, t.end_wait_s) == (3.0, 60.0, 4.0, 90.0)
    assert t.last_round_match_s == 12.0 and t.download_s == 30.0
    assert t.ranks_wait_s(4) == 300.0 and Timeouts(wait_timeout_s=400.0).ranks_wait_s(4) == 400.0 + 4 * 30.0 + 60.0
    with pytest.raises(ValueError, match="round_s 100"):
        Timeouts(round_s=100.0)  # below two longest match waits and the all-reduce
