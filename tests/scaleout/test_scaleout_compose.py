"""docker-compose.yml read against the settings it feeds (no Docker engine here to run it).

Every name and port one service expects of another is checked: nginx's
upstreams are the chatsvc services on CHATSVC_PORT, the Sentinel URL names the
Sentinel services and the primary they monitor, replicas follow that primary,
every Redis node keeps an fsynced append-only file, and each chatsvc
environment is a valid ``Settings`` with a replica id of its own.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from chatsvc.config import Settings
from chatsvc.store.connection import make_client
from chatsvc.store.sentinel import parse_sentinel_url

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _services(compose: dict, prefix: str) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if name.startswith(prefix)}


def _env(service: dict) -> dict[str, str]:
    """The service's environment after compose's ${VAR:?msg} / ${VAR:-default} substitution."""
    given = {
        "CHATSVC_API_KEYS": "acme:a-long-secret-key-01",
        "CHATSVC_ADMIN_KEY": "admin-key-0000000123",
    }

    def substitute(m: re.Match) -> str:
        name, op, default = m[1], m[2], m[3] or ""
        assert op != "?" or name in given, f"{name} must be set"
        return given.get(name, default)

    pattern = re.compile(r"\$\{(\w+)(?::([?-])([^}]*))?\}")
    return {k: pattern.sub(substitute, str(v)) for k, v in service["environment"].items()}


def _sentinel_conf(service: dict) -> str:
    script = service["command"][-1]
    return script.split("<<EOF", 1)[1].split("\nEOF", 1)[0]


def test_nginx_sends_to_every_chatsvc_replica_on_its_port(compose):
    nginx = compose["services"]["nginx"]
    mount_src, mount_dst = nginx["volumes"][0].split(":")[:2]
    assert (REPO / mount_src / "nginx.conf").is_file()
    command = nginx["command"]
    assert command[command.index("-c") + 1] == f"{mount_dst}/nginx.conf"
    upstreams = (REPO / mount_src / "chatsvc-upstreams.conf").read_text()
    servers = re.findall(r"^server (\S+):(\d+) max_fails=\d+ fail_timeout=\w+;", upstreams, re.M)
    replicas = _services(compose, "chatsvc-")
    assert {host for host, _ in servers} == set(replicas)
    for host, port in servers:
        assert _env(replicas[host])["CHATSVC_PORT"] == port
    listen = re.search(r"listen (\d+);", (REPO / mount_src / "chatsvc-listen.conf").read_text())
    assert nginx["ports"] == [f"{listen[1]}:{listen[1]}"]
    assert set(nginx["depends_on"]) == set(replicas)


def test_each_replica_is_valid_settings_with_its_own_id(compose):
    replicas = _services(compose, "chatsvc-")
    assert len(replicas) == 2
    ids = set()
    for name, service in replicas.items():
        settings = Settings.from_env(_env(service))
        assert settings.replica_id == name
        ids.add(settings.replica_id)
        assert settings.turn_lock_ttl_s <= 10
    assert len(ids) == len(replicas)


def test_the_sentinel_url_names_the_sentinels_and_what_they_monitor(compose):
    sentinels = _services(compose, "sentinel-")
    url = _env(compose["services"]["chatsvc-1"])["CHATSVC_REDIS_URL"]
    spec = parse_sentinel_url(url)
    make_client(url)  # a wait shorter than the socket timeout, known options only
    assert {host for host, _ in spec.sentinels} == set(sentinels)
    assert spec.wait_replicas >= 1
    for service in sentinels.values():
        conf = _sentinel_conf(service)
        port = int(re.search(r"^port (\d+)", conf, re.M)[1])
        assert all(p == port for _, p in spec.sentinels)
        name, host, primary_port, quorum = re.search(
            r"^sentinel monitor (\S+) (\S+) (\d+) (\d+)", conf, re.M
        ).groups()
        assert name == spec.service_name and host == "redis-primary"
        assert len(sentinels) // 2 < int(quorum) <= len(sentinels)
        assert "sentinel resolve-hostnames yes" in conf
        assert primary_port == "6379"


def test_every_redis_node_is_durable_and_replicas_follow_the_primary(compose):
    nodes = _services(compose, "redis-")
    assert len([n for n in nodes if n.startswith("redis-replica")]) >= 2
    for name, service in nodes.items():
        args = shlex.join(service["command"])
        assert "--appendonly yes" in args and "--appendfsync always" in args
        assert f"--replica-announce-ip {name}" in args
        if name != "redis-primary":
            assert "--replicaof redis-primary 6379" in args


def test_the_redis_nodes_and_sentinels_run_the_valkey_the_tests_run(compose):
    from chatsvc.store.embedded import server_binary

    banner = subprocess.run([server_binary(), "--version"], capture_output=True, text=True)
    tested = re.search(r"v=(\d+\.\d+\.\d+)", banner.stdout)[1]
    nodes = {**_services(compose, "redis-"), **_services(compose, "sentinel-")}
    assert len(nodes) >= 6
    for name, service in nodes.items():
        image, _, tag = service["image"].partition(":")
        assert image == "valkey/valkey", (name, service["image"])
        assert tag.split("-")[0] == tested, (name, service["image"], tested)


def test_the_load_balancer_runs_the_nginx_the_tests_run(compose, nginx_binary):
    banner = subprocess.run([nginx_binary, "-v"], capture_output=True, text=True)
    tested = re.search(r"nginx/(\d+\.\d+\.\d+)", banner.stderr)[1]
    image, _, tag = compose["services"]["nginx"]["image"].partition(":")
    assert image == "nginx" and tag.split("-")[0] == tested, (compose["services"]["nginx"], tested)
