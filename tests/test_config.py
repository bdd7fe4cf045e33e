"""Daemon settings from a TOML file, the environment and flags, in that order of strength."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

from memd.__main__ import build_parser as memd_parser
from shared.config import ConfigError, Layers


def settle(argv, environ=None, parser=None):
    parser = parser or memd_parser()
    layers = Layers(parser, "MEMD")
    args = layers.resolve(parser.parse_args(argv), environ or {})
    return args, layers


def test_flags_beat_the_environment_which_beats_the_file_which_beats_the_defaults(tmp_path):
    conf = tmp_path / "memd.toml"
    conf.write_text('pool-bytes = "64MiB"\nidle_ttl = 60\nlease-timeout = 5\ndisable-swap = true\n')
    env = {"MEMD_CONFIG": str(conf), "MEMD_IDLE_TTL": "120", "MEMD_LEASE_TIMEOUT": "7"}
    args, layers = settle(["--lease-timeout", "9"], env)
    assert args.pool_bytes == 64 << 20 and layers.sources["pool_bytes"] == str(conf)
    assert args.idle_ttl == 120 and layers.sources["idle_ttl"] == "$MEMD_IDLE_TTL"
    assert args.lease_timeout == 9 and layers.sources["lease_timeout"] == "flag"
    assert args.disable_swap is True
    assert args.heat_decay == 0.9 and layers.sources["heat_decay"] == "default"


def test_print_config_writes_a_file_that_reproduces_the_settings(tmp_path):
    args, layers = settle(["--pool-bytes", "32MiB", "--model", str(tmp_path), "--swap-ratio", "0.5"],
                          {"MEMD_LOG_LEVEL": "debug"})
    printed = tmp_path / "printed.toml"
    printed.write_text(layers.render(args))
    again, _ = settle(["--config", str(printed)])
    assert vars(again) | {"config": None} == vars(args) | {"config": None}


def test_a_flag_overrides_the_file_even_across_exclusive_choices(tmp_path):
    conf = tmp_path / "memd.toml"
    conf.write_text('block-bytes = "4KiB"\n')
    args, _ = settle(["--config", str(conf), "--model", str(tmp_path)])
    assert args.model == tmp_path and args.block_bytes is None
    conf.write_text(f'block-bytes = "4KiB"\nmodel = "{tmp_path}"\n')
    with pytest.raises(ConfigError, match="block-bytes and model exclude each other"):
        settle(["--config", str(conf)])


@pytest.mark.parametrize(("text", "message"), [
    ("pool-byte = 5\n", "unknown setting 'pool-byte'"),
    ('pool-bytes = "lots"\n', "pool-bytes: not a size"),
    ('device = "cpu"\nlog-level = "loud"\n', "'loud' is not one of debug, info, warning, error"),
    ("disable-swap = 3\n", "disable-swap: expected true or false"),
    ("heat-decay = 1.5\n", "heat-decay: must be a number above 0 and at most 1: 1.5"),
    ("pool-bytes = [1, 2]\n", "expected a single value"),
    ("pool-bytes = \n", "is not valid TOML"),
])
def test_bad_settings_in_a_file_are_named(tmp_path, text, message):
    conf = tmp_path / "memd.toml"
    conf.write_text(text)
    with pytest.raises(ConfigError, match=message):
        settle(["--config", str(conf)])


def test_variables_that_set_nothing_are_pointed_out():
    _, layers = settle([])
    environ = {"MEMD_ARGS": "--pool-bytes 1GiB", "MEMD_POOL_BYTES": "1GiB", "MEMD_ADDRESS": "unix:/x",
               "MEMD_CONFIG": "/etc/kvpool/memd.toml"}
    assert layers.unknown_variables(environ) == ["MEMD_ARGS"]


def test_a_bad_environment_value_is_named():
    with pytest.raises(ConfigError, match=r"\$MEMD_SWAP_RATIO: must be a number at least 0: -1"):
        settle([], {"MEMD_SWAP_RATIO": "-1"})


def test_inferd_needs_a_model_from_some_layer(tmp_path):
    from inferd.__main__ import build_parser
    parser, serve = build_parser()
    layers = Layers(serve, "INFERD")
    with pytest.raises(ConfigError, match=r"--model is required \(or \$INFERD_MODEL, or model in the config file\)"):
        layers.resolve(parser.parse_args(["serve"]), {})
    parser, serve = build_parser()
    args = Layers(serve, "INFERD").resolve(parser.parse_args(["serve"]), {"INFERD_MODEL": str(tmp_path)})
    assert args.model == tmp_path and args.max_num_seqs == 16


@pytest.mark.processes
def test_the_daemons_print_their_config_and_refuse_a_bad_file_in_one_line(tmp_path):
    conf = tmp_path / "memd.toml"
    conf.write_text('pool-bytes = "8MiB"\n')
    shown = subprocess.run([sys.executable, "-m", "memd", "--config", str(conf), "--print-config"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0
    line = next(line for line in shown.stdout.splitlines() if line.startswith("pool-bytes "))
    assert line.split() == ["pool-bytes", "=", "8388608", "#", str(conf)]
    missing = subprocess.run([sys.executable, "-m", "inferd", "serve", "--config", str(tmp_path / "nope.toml")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert missing.stderr == f"inferd: cannot read config {tmp_path / 'nope.toml'}: No such file or directory\n"


async def test_memd_serves_the_pool_its_config_file_describes(tmp_path, memd_factory):
    conf = tmp_path / "memd.toml"
    conf.write_text('device = "cpu"\npool-bytes = "128KiB"\nblock-bytes = "4KiB"\nswap-ratio = 0.5\n')
    memd = await memd_factory("--config", str(conf), env={"MEMD_SWAP_RATIO": "0.25"})
    async with memd.admin() as admin:
        stats = await admin.stats()
    assert (stats.total_blocks, stats.block_bytes, stats.swap_total_blocks) == (32, 4096, 8)


def test_print_config_says_an_api_key_is_set_and_never_prints_it(tmp_path):
    from inferd.__main__ import build_parser as inferd_parser
    _, serve = inferd_parser()
    layers = Layers(serve, "INFERD")
    args = layers.resolve(serve.parse_args(["--model", str(tmp_path)]), {"INFERD_API_KEY": "hunter2-secret"})
    assert args.api_key == "hunter2-secret"
    printed = layers.render(args)
    assert "hunter2" not in printed and "# api-key is set (not shown)  # $INFERD_API_KEY" in printed
