"""Router config: defaults, the handle TTL rule, precise errors, JSON/YAML, reload watcher."""

import json
import os

import pytest

from bidirkv.router.config import ConfigError, load_config, parse_config
from bidirkv.router.server.reload import ConfigWatcher, file_signature

BASE = {"prefill": ["http://p:8100"], "decode": ["http://d:8200/"]}


def test_defaults_and_ttl():
    cfg = parse_config(BASE)
    assert cfg.decode == ["http://d:8200"]
    assert cfg.bidirectional is True and cfg.max_conversations == 100_000
    assert cfg.prefill_only_fallback is True
    assert parse_config({**BASE, "prefillOnlyFallback": False}).prefill_only_fallback is False
    assert cfg.kv_recompute_threshold == 64 and cfg.tenant_header == "Authorization"
    assert cfg.max_body_bytes == 4 * 1024 * 1024 and cfg.max_inflight_body_bytes == 32 * 1024 * 1024
    assert cfg.handle_ttl_seconds == 420  # min(420, 480 - 10)
    cfg = parse_config({**BASE, "conversationTtlSeconds": 600, "decoderKvBlocksTtlSeconds": 300,
                        "safetyMarginSeconds": 20})
    assert cfg.handle_ttl_seconds == 280


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        ({"timeouts": {"connectSeconds": -1}}, ["timeouts.connectSeconds", "-1",
                                                "greater than 0"]),
        ({"bidirectional": "yes"}, ["bidirectional", "'yes'", "valid boolean"]),
        ({"prefillOnlyFallback": "false"}, ["prefillOnlyFallback", "'false'",
                                            "valid boolean"]),
        ({"maxConversations": "10"}, ["maxConversations", "'10'"]),
        ({"prefill": ["ftp://x"]}, ["prefill", "ftp://x", "http://host:port"]),
        ({"prefill": ["http://a:1", "http://a:1/"]}, ["listed twice"]),
        ({"decoderKvBlocksTtl": 5}, ["decoderKvBlocksTtl", "unknown key",
                                     "decoderKvBlocksTtlSeconds"]),
        ({"timeouts": {"read": 1}}, ["timeouts.read", "connectSeconds"]),
        ({"decoderKvBlocksTtlSeconds": 10, "safetyMarginSeconds": 10}, ["must be positive"]),
        ({"tenantHeader": "X Bad"}, ["tenantHeader", "'X Bad'"]),
        # The knobs the CRD shares, with its types and bounds (bidirkv/knobs.py).
        ({"ownerLeaseSeconds": 30.5}, ["ownerLeaseSeconds", "30.5", "valid integer"]),
        ({"decoderKvBlocksTtlSeconds": 480.5}, ["decoderKvBlocksTtlSeconds", "valid integer"]),
        ({"retentionWatermark": 0.01}, ["retentionWatermark", "greater than or equal to 0.05"]),
        ({"kvRecomputeThreshold": 10_000_001}, ["kvRecomputeThreshold", "less than or equal"]),
        ({"ownerLeaseSeconds": 9}, ["ownerLeaseSeconds (9) must be at least twice "
                                    "healthCheckIntervalSeconds (5.0)"]),
        ({"placement": {"localPrefillTokens": 9, "maxLocalPrefillTokens": 8}},
         ["placement.localPrefillTokens (9) must be at most placement.maxLocalPrefillTokens (8)"]),
        ({"maxBodyBytes": 4096, "maxInflightBodyBytes": 2048},
         ["maxInflightBodyBytes (2048) must be at least maxBodyBytes (4096)"]),
    ],
)
def test_errors_name_key_value_and_rule(data, needles):
    with pytest.raises(ConfigError) as exc:
        parse_config({**BASE, **data})
    for needle in needles:
        assert needle in str(exc.value)


def test_file_json_yaml_and_overrides(tmp_path):
    f = tmp_path / "router.yaml"
    f.write_text("prefill: [http://p:1]\ndecode: [http://d:1]\nmodel: m\n")
    cfg = load_config(f, {"decode": ["http://other:2"]})
    assert cfg.prefill == ["http://p:1"] and cfg.decode == ["http://other:2"] and cfg.model == "m"
    f.write_text(json.dumps({"prefill": ["http://p:1"]}))
    with pytest.raises(ConfigError, match="no decode URL"):
        load_config(f)
    f.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(f)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.json")


def test_watcher_applies_good_and_keeps_old_on_bad(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps(BASE))
    applied, results = [], []
    w = ConfigWatcher(f, {}, applied.append, results.append)
    assert w.poll() is False
    f.write_text(json.dumps({**BASE, "maxConversations": 5}) + " ")
    assert w.poll() is True and applied[-1].max_conversations == 5
    f.write_text(json.dumps({**BASE, "maxConversations": 0}))
    assert w.poll() is False and len(applied) == 1 and results == ["applied", "rejected"]
    f.unlink()
    assert w.poll() is False


def test_watcher_sees_kubernetes_symlink_swap(tmp_path):
    # ConfigMap volume layout: file -> ..data/file, ..data -> ..<timestamp>
    v1, v2 = tmp_path / "..2024_1", tmp_path / "..2024_2"
    v1.mkdir()
    v2.mkdir()
    (v1 / "router.json").write_text(json.dumps(BASE))
    (v2 / "router.json").write_text(json.dumps({**BASE, "model": "swapped"}))
    os.utime(v1 / "router.json", ns=(10**18, 10**18))
    os.utime(v2 / "router.json", ns=(10**18, 10**18))  # same mtime: only the target moves
    (tmp_path / "..data").symlink_to(v1.name)
    (tmp_path / "router.json").symlink_to("..data/router.json")
    applied = []
    w = ConfigWatcher(tmp_path / "router.json", {}, applied.append)
    before = file_signature(tmp_path / "router.json")
    tmp_link = tmp_path / "..data_tmp"
    tmp_link.symlink_to(v2.name)
    os.replace(tmp_link, tmp_path / "..data")
    assert file_signature(tmp_path / "router.json") != before
    assert w.poll() is True and applied[0].model == "swapped"


@pytest.mark.parametrize(("url", "needle"), [
    ("redis://user:secret@valkey:6379/0", "no credentials in the URL"),
    ("http://valkey:6379", "expected redis://HOST:PORT/DB"),
    ("redis://valkey:6379/cache", "database 'cache' must be a number"),
])
def test_handle_store_url_is_checked(url, needle):
    from bidirkv.router.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="handleStore") as err:
        parse_config({"handleStore": url})
    assert needle in str(err.value) and "secret" not in str(err.value)
    assert parse_config({"handleStore": "rediss://valkey:6379/1"}).handle_store
