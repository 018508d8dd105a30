"""`nebula local up` tells a user what they need in a few lines; `--json` prints the whole description."""

from __future__ import annotations

from nebula_common.cli.local import summary_lines

DESCRIPTION = {
    "wan_emulator": {"port": 22343, "bandwidth_mbit": 60.0, "delay_ms": 20.0},
    "clusters": {
        cluster: {
            "processes": {
                f"auth-{cluster}": {"service": "auth", "grpc_port": base + 1, "state": "running"},
                f"switch-{cluster}": {
                    "service": "switch",
                    "internal_port": base + 2,
                    "wan_port": base + 3,
                    "state": "running",
                },
                f"trainer-{cluster}": {
                    "service": "trainer",
                    "grpc_port": base + 4,
                    "state": "given up" if cluster == "b" else "running",
                    "stage_isolation": "bwrap: own user, PID and network namespaces",
                    "stage_edges": f"records on the switch's edge socket /run/{cluster}/edges/switch.sock",
                },
            },
            "admin_password_file": f"/run/{cluster}/admin-password",
        }
        for cluster, base in (("a", 10000), ("b", 20000))
    },
}


def test_the_summary_names_ports_states_isolation_and_the_wan() -> None:
    lines = summary_lines(DESCRIPTION)
    assert lines[0] == "cluster a: auth :10001  switch :10002 (WAN :10003)  trainer :10004"
    assert lines[1] == "  stages: bwrap: own user, PID and network namespaces"
    assert lines[2] == "  stage edges: records on the switch's edge socket /run/a/edges/switch.sock"
    assert lines[3] == "  admin password: /run/a/admin-password"
    assert "trainer :20004 GIVEN UP" in lines[4]  # a service that is not running says so
    assert lines[-1] == "WAN emulator: 60 Mbit/s and 20 ms each way"
    assert len(lines) == 9
