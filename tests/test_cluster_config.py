"""Cluster config files: the shipped configs load; invalid ones fail before anything starts,
naming the field and its line; `pdserve serve --config` sees the same settings as the
launcher; the reference in docs/configuration.md matches the schema. No model is loaded.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cluster.config_file import ConfigFileError, load_config
from pdserve.cluster.nodes import cluster_nodes, find_node, node_settings
from tests.servers import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))

GOOD = """\
model:
  name: smollm2-135m-instruct
prefill:
  count: 2
  port: 9101
  kv_port: 9201
  connector: {kind: nixl}
decode:
  port: 9301
  connector: {kind: nixl}
router:
  port: 9000
"""


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    cfg = load_config(path)
    nodes = cluster_nodes(cfg)
    assert {n.role for n in nodes} == {"prefill", "decode"}
    for node in nodes:
        if node.role == "decode":
            assert node_settings(cfg, node)["prefill_node"] == [
                n.control_address for n in nodes if n.role == "prefill"
            ]


def test_local_yaml_is_the_embedded_default():
    cfg = load_config(ROOT / "configs" / "local.yaml")
    assert cfg.redis.embedded and cfg.model.name == "smollm2-135m-instruct"
    assert [n.name for n in cluster_nodes(cfg)] == ["prefill-0", "decode-0"]
    hosts = {cfg.router.host} | {n.host for n in cluster_nodes(cfg)}
    assert hosts == {"127.0.0.1"}
    assert all(n.group.num_threads == 1 for n in cluster_nodes(cfg))  # 2-core box


def test_groups_expand_to_ports_and_control_addresses(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    nodes = {n.name: n for n in cluster_nodes(cfg)}
    assert nodes["prefill-1"].url == "http://127.0.0.1:9102"
    assert nodes["prefill-1"].control_address == "tcp://127.0.0.1:9202"
    settings = node_settings(cfg, nodes["decode-0"], redis_url="redis://127.0.0.1:1")
    assert settings["prefill_node"] == ["tcp://127.0.0.1:9201", "tcp://127.0.0.1:9202"]
    assert settings["redis_url"] == "redis://127.0.0.1:1" and settings["role"] == "decode"


INVALID = {
    "unknown key": (GOOD.replace("  count: 2", "  cont: 2"), "prefill.cont", "cont: 2"),
    "wrong type": (GOOD.replace("  count: 2", "  count: two"), "prefill.count", "count: two"),
    "wrong type in a list": (
        GOOD.replace("  port: 9301", "  port: [9301, x]"),
        "decode.port",
        "port: [9301, x]",
    ),
    "port clash": (GOOD.replace("  port: 9301", "  port: 9102"), "decode.port", "port: 9102"),
    "port clash with the router": (
        GOOD.replace("  kv_port: 9201", "  kv_port: 9000"),
        "prefill.kv_port",
        "kv_port: 9201",
    ),
    "prefill group without a connector": (
        GOOD.replace("  kv_port: 9201\n  connector: {kind: nixl}\n", "  kv_port: 9201\n"),
        "prefill.connector",
        "prefill:",
    ),
    "missing model": (GOOD.replace("model:\n  name: smollm2-135m-instruct\n", ""), "model", ""),
    "model without a name": (
        GOOD.replace("  name: smollm2-135m-instruct\n", "  dtype: float32\n"),
        "model.name",
        "model:",
    ),
    "unknown model": (
        GOOD.replace("smollm2-135m-instruct", "no-such-model"),
        "model.name",
        "name:",
    ),
    "bad policy": (
        GOOD + "  prefill_policy: fastest\n",
        "router.prefill_policy",
        "prefill_policy",
    ),
    "block size": (
        GOOD.replace("smollm2-135m-instruct", "smollm2-135m-instruct\n  block_size: 12"),
        "model.block_size",
        "block_size",
    ),
    "host auto without ray": (
        GOOD.replace("  port: 9301", "  port: 9301\n  host: auto"),
        "decode.host",
        "host: auto",
    ),
    "ttl not above heartbeat": (
        GOOD + "launcher:\n  heartbeat_s: 5\n  node_ttl_s: 5\n",
        "launcher.node_ttl_s",
        "node_ttl_s",
    ),
    "duplicate key": (GOOD + "router:\n  port: 9001\n", "router", "port: 9001"),
}


@pytest.mark.parametrize("case", INVALID, ids=list(INVALID))
def test_invalid_config_names_field_and_line(tmp_path, case):
    text, field, needle = INVALID[case]
    if case == "port clash with the router":
        needle = "kv_port: 9000"
    path = write(tmp_path, text)
    with pytest.raises(ConfigFileError) as e:
        load_config(path)
    if case == "duplicate key":
        needle, field = "router:", "router"
        line = max(i for i, x in enumerate(text.splitlines(), 1) if x.startswith(needle))
    else:
        line = line_of(text, needle)
    assert e.value.field == field, str(e.value)
    assert f"{path}:{line}: {field}: " in str(e.value)


def test_set_overrides_and_their_errors(tmp_path):
    path = write(tmp_path, GOOD)
    cfg = load_config(path, ["router.port=9500", "redis=redis://10.0.0.1:6379"])
    assert cfg.router.port == 9500 and cfg.redis.url == "redis://10.0.0.1:6379"
    with pytest.raises(ConfigFileError, match=r"--set decode.count=-1: decode.count: "):
        load_config(path, ["decode.count=-1"])


def run_pdserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pdserve", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_launch_of_invalid_config_starts_nothing(tmp_path):
    runs = tmp_path / "runs"
    text = GOOD.replace("  kv_port: 9201\n  connector: {kind: nixl}\n", "  kv_port: 9201\n")
    path = write(tmp_path, text + f"launcher:\n  run_dir: {runs}\n")
    out = run_pdserve("launch", str(path))
    assert out.returncode == 2
    assert "nothing was started" in out.stderr and "prefill.connector" in out.stderr
    assert not runs.exists()  # no run directory: no process was started
    check = run_pdserve("config", "check", str(path))
    assert check.returncode == 2 and f"{path}:3: prefill.connector" in check.stderr
    assert run_pdserve("config", "check", str(ROOT / "configs" / "local.yaml")).returncode == 0


def test_launch_refuses_a_port_already_in_use(tmp_path):
    runs = tmp_path / "runs"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        path = write(tmp_path, GOOD + f"launcher:\n  run_dir: {runs}\n")
        out = run_pdserve("launch", str(path), "--set", f"router.port={port}")
    assert out.returncode == 2 and "router.port" in out.stderr, out.stderr
    assert not runs.exists()


def serve_parser() -> argparse.ArgumentParser:
    from pdserve.node.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def node_engine_config(argv: list[str]):
    """The EngineConfig `pdserve serve ARGV` would run (flags, or a node of a --config file)."""
    from pdserve.node.cli import engine_config_from_args, resolve_settings

    return engine_config_from_args(resolve_settings(serve_parser().parse_args(argv)))


# Node flags that deliberately have no YAML key: per-process plumbing, not cluster config.
NOT_IN_YAML = {"help", "config", "node", "set", "log_level", "engine_address", "serve_defaults"}


def test_every_node_flag_can_live_in_yaml(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    settings = node_settings(cfg, find_node(cfg, "decode-0"))
    dests = {a.dest for a in serve_parser()._actions} - NOT_IN_YAML
    assert dests <= set(settings), f"flags without a YAML key: {sorted(dests - set(settings))}"


def test_serve_config_node_takes_the_yaml_and_flags_win(tmp_path):
    from pdserve.node.cli import resolve_settings

    path = write(tmp_path, GOOD.replace("  port: 9301", "  port: 9301\n  num_threads: 2"))
    parser = serve_parser()
    args = resolve_settings(
        parser.parse_args(["--config", str(path), "--node", "decode-0", "--port", "9999"])
    )
    assert args.port == 9999  # the flag wins
    assert args.num_threads == 2 and args.role == "decode" and args.node_id == "decode-0"
    assert args.prefill_node == ["tcp://127.0.0.1:9201", "tcp://127.0.0.1:9202"]
    plain = resolve_settings(parser.parse_args(["--port", "9998"]))
    assert plain.role == "colocated" and plain.prefill_node == [] and plain.kv_cache_bytes > 0
    out = run_pdserve("serve", "--config", str(path), "--node", "decode-7")
    assert out.returncode != 0 and "decode-7" in out.stderr and "prefill-0" in out.stderr


def test_kv_store_section_points_nodes_at_the_cluster_redis(tmp_path):
    from pdserve.node.cli import engine_config_from_args, resolve_settings

    text = GOOD + "kv_store: {backend: lmcache, chunk_size: 64, local_cpu_bytes: 64MiB}\n"
    path = write(tmp_path, text)
    argv = ["--config", str(path), "--node", "prefill-1", "--redis-url", "redis://10.0.0.5:6400"]
    cfg = engine_config_from_args(resolve_settings(serve_parser().parse_args(argv)))
    st = cfg.kv_store
    assert (st.backend, st.remote_url, st.chunk_size) == ("lmcache", "redis://10.0.0.5:6400", 64)
    assert st.local_cpu_bytes == 64 << 20
    other = write(tmp_path, GOOD + "kv_store: {backend: lmcache, url: 'redis://h:1'}\n", "o.yaml")
    argv = ["--config", str(other), "--node", "decode-0"]
    assert (
        engine_config_from_args(
            resolve_settings(serve_parser().parse_args(argv))
        ).kv_store.remote_url
        == "redis://h:1"
    )
    bad = GOOD + "kv_store: {backend: lmcache, url: 'http://x'}\n"
    with pytest.raises(ConfigFileError, match=r"kv_store\.url"):
        load_config(write(tmp_path, bad, "bad.yaml"))


def test_lmcache_connector_moves_kv_through_the_cluster_redis(tmp_path):
    from pdserve.node.cli import engine_config_from_args, resolve_settings

    text = GOOD.replace("{kind: nixl}", "{kind: lmcache}") + "kv_store: {chunk_size: 64}\n"
    path = write(tmp_path, text)
    argv = ["--config", str(path), "--node", "decode-0", "--redis-url", "redis://10.0.0.5:6400"]
    cfg = engine_config_from_args(resolve_settings(serve_parser().parse_args(argv)))
    assert cfg.kv_transfer.connector == "lmcache" and cfg.kv_store.backend is None
    assert (cfg.kv_store.remote_url, cfg.kv_store.chunk_size) == ("redis://10.0.0.5:6400", 64)
    mixed = GOOD.replace("connector: {kind: nixl}\nrouter", "connector: {kind: lmcache}\nrouter")
    with pytest.raises(ConfigFileError, match=r"decode\.connector\.kind"):
        load_config(write(tmp_path, mixed, "mixed.yaml"))


def test_kv_backends_list_becomes_the_nodes_composed_connector(tmp_path):
    from pdserve.node.cli import engine_config_from_args, resolve_settings

    backends = (
        "  kv_backends:\n"
        "    - {kind: nixl, roles: [transfer]}\n"
        "    - {kind: lmcache, roles: [load, save]}\n"
        "    - {kind: lmcache, roles: [load], url: 'redis://10.0.0.9:6379'}\n"
    )
    text = GOOD.replace(
        "  connector: {kind: nixl}\nrouter", "  connector: {kind: nixl}\n" + backends + "router"
    )
    path = write(tmp_path, text + "kv_store: {chunk_size: 64}\n")
    argv = ["--config", str(path), "--node", "decode-0", "--redis-url", "redis://10.0.0.5:6400"]
    cfg = engine_config_from_args(resolve_settings(serve_parser().parse_args(argv)))
    assert [(b.kind, b.roles, b.remote_url) for b in cfg.backends] == [
        ("nixl", ("transfer",), None),
        ("lmcache", ("load", "save"), "redis://10.0.0.5:6400"),  # `cluster`: the node's Redis
        ("lmcache", ("load",), "redis://10.0.0.9:6379"),
    ]
    assert cfg.transfer_kind == "nixl" and cfg.has_prefix_store
    bad = text.replace("{kind: nixl, roles: [transfer]}", "{kind: nixl, roles: [transfer, load]}")
    with pytest.raises(ConfigFileError, match=r"decode\.kv_backends\[0\]\.roles"):
        load_config(write(tmp_path, bad, "bad.yaml"))
    # A block-major cache with LMCache in kv_backends, or as the PD transfer, is accepted:
    # the LMCache adapter copies chunks from block-major blocks too (kv_transfer/kv_slots.py).
    block_major = "smollm2-135m-instruct\n  kv_layout: block_major"
    for name, yaml in (
        ("bm_store.yaml", text.replace("smollm2-135m-instruct", block_major)),
        (
            "bm_pd.yaml",
            GOOD.replace("{kind: nixl}", "{kind: lmcache}").replace(
                "smollm2-135m-instruct", block_major
            ),
        ),
    ):
        path = write(tmp_path, yaml + "kv_store: {chunk_size: 64}\n", name)
        argv[1] = str(path)
        cfg = engine_config_from_args(resolve_settings(serve_parser().parse_args(argv)))
        assert cfg.cache.kv_layout == "block_major"
        assert (cfg.transfer_kind, cfg.has_prefix_store) == (
            ("nixl", True) if name == "bm_store.yaml" else ("lmcache", False)
        )
    both = text + "kv_store: {backend: lmcache}\n"
    with pytest.raises(ConfigFileError, match=r"decode\.kv_backends"):
        load_config(write(tmp_path, both, "both.yaml"))


def test_docs_reference_is_up_to_date():
    from pdserve.cluster.docs import DOCS_FILE, updated_text

    text = DOCS_FILE.read_text()
    assert updated_text(text) == text, "run: pdserve config docs --write"


def test_every_router_flag_comes_from_yaml(tmp_path, monkeypatch):
    from pdserve.cluster.nodes import router_argv, router_env
    from pdserve.router.cli import API_KEY_ENV, add_arguments, config_from_args

    router = (
        "router:\n  port: 9000\n  prefill_policy: round_robin\n  decode_policy: least_loaded\n"
        "  api_key: k\n  overlap_weight: 2.5\n  max_retries: 3\n  health_interval_s: 0.5\n"
        "  request_timeout_s: 30\n  breaker_failures: 7\n  breaker_cooldown_s: 9\n"
    )
    text = GOOD.replace("router:\n  port: 9000\n", router)
    text = text.replace(
        "  name: smollm2-135m-instruct", "  name: smollm2-135m-instruct\n  served_name: m"
    )
    cfg = load_config(write(tmp_path, text))
    argv = router_argv(cfg, "redis://127.0.0.1:1", cluster_nodes(cfg), "warning")
    assert "k" not in argv  # the API key goes by environment, not the process list
    monkeypatch.setenv(API_KEY_ENV, router_env(cfg)[API_KEY_ENV])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert argv[1:4] == ["-m", "pdserve", "router"]
    got = config_from_args(parser.parse_args(argv[4:]))
    section = cfg.router.model_dump(exclude={"enabled"})
    assert {k: getattr(got, k) for k in section} == section
    assert got.served_name == "m" and got.redis_url == "redis://127.0.0.1:1"
    assert got.prefill_urls == ("http://127.0.0.1:9101", "http://127.0.0.1:9102")
    assert got.decode_urls == ("http://127.0.0.1:9301",) and got.cluster == "pdserve"


def test_a_config_open_to_the_network_needs_a_secret(tmp_path):
    """Router, nodes or embedded Redis beyond loopback without `secret_file`: refused, naming
    the field and saying why; `secret_file` (or the loud override) allows it."""
    text = GOOD.replace("  port: 9000", "  port: 9000\n  host: 0.0.0.0")
    text = text.replace("decode:\n", "decode:\n  host: 10.0.0.7\n") + "redis: {host: 10.0.0.7}\n"
    path = write(tmp_path, text)
    with pytest.raises(ConfigFileError) as e:
        load_config(path)
    fields = {i.field for i in e.value.issues}
    assert fields == {"router.host", "decode.host", "redis.host"}, str(e.value)
    assert "beyond loopback" in str(e.value) and "no secret_file" in str(e.value)
    secret = write(tmp_path, "0123456789abcdef0123", "secret")
    assert load_config(path, [f"secret_file={secret}"]).secret_file == str(secret)
    cfg = load_config(path, ["insecure_open_network=true"])
    from pdserve.cluster.checks import insecure_warning

    assert "WITHOUT a cluster secret" in insecure_warning(cfg)
    assert insecure_warning(load_config(write(tmp_path, GOOD, "good.yaml"))) is None
