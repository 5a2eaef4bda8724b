"""PTStore's settings from the HiCache storage extra config: strict keys and JSON types."""

from __future__ import annotations

import pytest
from sglang_pic.launcher.launch_server import ptstore_args
from sglang_pic.store.config import SGLANG_KEYS, PTStoreConfig

SERVERS = {"servers": ["tcp://127.0.0.1:7400"]}


def test_defaults_and_sglangs_own_keys_pass():
    c = PTStoreConfig.from_extra({**SERVERS, "backend_name": "ptstore", "interface_v1": 1,
                                  "allocator": "shm", "prefetch_threshold": 256})
    assert c.servers == ("tcp://127.0.0.1:7400",)
    assert c.interface_v1 is True and c.data_tls is False and c.shm is True
    assert c.timeout_ms == 2000 and c.data_plane == "auto" and c.shm_mb == 256.0
    assert {"backend_name", "module_path", "class_name", "allocator"} <= SGLANG_KEYS


@pytest.mark.parametrize("extra, message", [
    ({"data_tsl": True}, "unknown key"),  # a misspelt TLS switch is not silently ignored
    ({"data_tls": "false"}, "data_tls must be a JSON bool"),
    ({"shm": "no"}, "shm must be a JSON bool"),
    ({"timeout_ms": "2000"}, "timeout_ms must be a JSON int"),
    ({"timeout_ms": 2.5}, "timeout_ms must be a JSON int"),
    ({"data_streams": True}, "data_streams must be a JSON int"),
    ({"data_streams": 0}, "data_streams must be within 1..64"),
    ({"timeout_ms": -1}, "timeout_ms must be within"),
    ({"data_plane": "rdma"}, "data_plane must be one of"),
    ({"gil_switch_ms": 0}, "gil_switch_ms must be within"),
    ({"server_key": 7}, "server_key must be a JSON str"),
    ({"token": "secret"}, "get_server_info"),
])
def test_bad_settings_are_refused_naming_the_key(extra, message):
    with pytest.raises(ValueError, match=message):
        PTStoreConfig.from_extra({**SERVERS, **extra})


@pytest.mark.parametrize("servers", [None, [], "tcp://a:1", [""], [7]])
def test_servers_must_be_a_list_of_endpoints(servers):
    extra = {} if servers is None else {"servers": servers}
    with pytest.raises(ValueError, match="'servers'"):
        PTStoreConfig.from_extra(extra)


def test_serve_refuses_a_bad_user_extra_config_at_start():
    """``sglang-pic serve --ptstore`` merges the user's extra config over its own and checks the
    result before SGLang starts: the error names the flag and the key."""
    argv = ["--hicache-storage-backend-extra-config", '{"data_tsl": true}']
    with pytest.raises(SystemExit, match="extra-config: .*unknown key.*data_tsl"):
        ptstore_args(argv, "tcp://127.0.0.1:7400", None, on_cpu=True)
    argv = ["--hicache-storage-backend-extra-config", '{"timeout_ms": 500, "data_tls": true}']
    out = ptstore_args(argv, "tcp://127.0.0.1:7400", None, on_cpu=True)
    assert any('"data_tls": true' in a for a in out)
