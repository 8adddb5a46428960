"""The typed settings (pdserve/config/): each knob is one field, read alike by the YAML
schema, the `pdserve serve` / `pdserve router` flags and the engine. No model is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.config.fields import default, flag_of
from pdserve.config.node import NODE_SECTIONS
from tests.servers import ROOT
from tests.test_cluster_config import node_engine_config, serve_parser


def test_settings_import_no_torch_and_no_engine():
    code = (
        "import sys, pdserve.config.fields, pdserve.config.node, pdserve.config.router, "
        "pdserve.cluster.schema, pdserve.cluster.nodes\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('pdserve.engine')]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_every_field_is_a_flag_with_its_help():
    flags = {a.option_strings[0]: a for a in serve_parser()._actions if a.option_strings}
    for cls, _ in NODE_SECTIONS:
        for name, field in cls.model_fields.items():
            action = flags[flag_of(cls, name)]
            assert action.help == field.description, name


def test_the_engine_defaults_are_the_settings_defaults():
    cfg = node_engine_config([])
    assert cfg.model.batched_decode is default(NODE_SECTIONS[0][0], "batched_decode")
    assert cfg == node_engine_config(["--batched-decode"])
    assert not node_engine_config(["--no-batched-decode"]).model.batched_decode


def test_older_flag_spellings_and_the_settings_order():
    from pdserve.node.cli import SERVE_CLASSES, NodeSettings, resolve_settings

    old = ["--kv-transfer-timeout", "7", "--kv-store-local-bytes", "2097152", "--no-prefix-caching"]
    new = ["--kv-transfer-timeout-s", "7", "--kv-store-local-cpu-bytes", "2MiB"]
    new += ["--no-enable-prefix-caching"]
    a, b = node_engine_config(old), node_engine_config(new)
    assert a == b and a.kv_transfer.transfer_timeout_s == 7.0
    assert a.kv_store.local_cpu_bytes == 2 << 20 and not a.cache.enable_prefix_caching
    settings = NodeSettings.from_args(resolve_settings(serve_parser().parse_args([])))
    assert [type(s) for s in settings] == list(SERVE_CLASSES)


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--kv-peer-timeout", "0"], "kv_peer_timeout_s: "),
        (["--block-size", "12"], "block_size: must be a power of two"),
        (["--kv-store-local-bytes", "1000"], "kv_store_local_cpu_bytes: "),
    ],
)
def test_a_bad_flag_names_it(argv, field):
    with pytest.raises(ValueError, match=field):
        node_engine_config(argv)


def test_engine_configs_are_checked_by_the_settings():
    from pdserve.common.errors import ConfigError
    from pdserve.engine.config import CacheConfig, KVStoreConfig, KVTransferConfig

    with pytest.raises(ConfigError, match="cache.block_size: must be a power of two"):
        CacheConfig(block_size=12)
    with pytest.raises(ConfigError, match="kv_transfer.on_prefill_failure"):
        KVTransferConfig(on_prefill_failure="retry")
    with pytest.raises(ConfigError, match="kv_store.local_cpu_bytes"):
        KVStoreConfig(local_cpu_bytes=1000)


def test_the_store_url_reaches_the_engine_when_a_store_is_used():
    given = ["--kv-store-url", "redis://h:1", "--kv-backend", "lmcache:load"]
    assert node_engine_config(given).kv_store.remote_url == "redis://h:1"
    redis = ["--redis-url", "redis://r:2"]
    assert node_engine_config([*redis, "--kv-store", "lmcache"]).kv_store.remote_url == (
        "redis://r:2"  # `cluster`, the default: the node's Redis
    )
    assert node_engine_config(redis).kv_store.remote_url is None  # no store: none
