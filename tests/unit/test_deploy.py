"""deploy/: the Kubernetes manifests validated offline against the Kubernetes schemas (kubernetes-validate
ships them), the Prometheus config checked by the real promtool, the systemd unit by systemd-analyze, and the
daemon's command lines in all of them accepted by heapscope's own parser."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.cli import build_parser
from agent.errors import HeapscopeError

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFEST = DEPLOY / "kubernetes" / "heapscope.yaml"
ALERTS = DEPLOY / "prometheus" / "heapscope-alerts.yml"


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def daemonset() -> dict[str, Any]:
    [ds] = [d for d in documents() if d["kind"] == "DaemonSet"]
    return ds


def test_manifests_are_valid_kubernetes() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    kinds = []
    for doc in documents():
        # strict: unknown fields are errors too (a typo in a field name would otherwise pass silently).
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["ConfigMap", "DaemonSet", "Service", "ServiceAccount"]


def test_a_broken_manifest_is_caught() -> None:
    """The validator really checks: the same DaemonSet with a misspelt field fails."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    ds = daemonset()
    ds["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, kubernetes_validate.latest_version(), strict=True)


def test_daemonset_has_what_bpf_needs() -> None:
    pod = daemonset()["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    [c] = pod["containers"]
    caps = set(c["securityContext"]["capabilities"]["add"])
    assert {"BPF", "PERFMON", "SYS_PTRACE", "SYS_ADMIN"} <= caps
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    for path in ("/sys/kernel/debug", "/sys/kernel/tracing"):
        assert path in mounts, path
    # The image's own kernel headers, linked by its entry point for the node's kernel: the node's folders mounted
    # over them would hide them (a node without prepared headers: the container exits).
    for path in ("/lib/modules", "/usr/src"):
        assert not any(m == path or m.startswith(path + "/") for m in mounts), path
    volumes = {v["name"]: v for v in pod["volumes"]}
    for m in mounts.values():
        assert "hostPath" in volumes[m["name"]] or m["name"] == "selectors"
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    # Listening on the pod IP: the token must come with it (the daemon refuses to start otherwise).
    assert any(e["name"] == "HEAPSCOPE_TOKEN" and "secretKeyRef" in e["valueFrom"] for e in c["env"])


def configmap_args(tmp_path: Path) -> tuple[list[str], Path]:
    """The container's arguments with its @FILE pointing at the ConfigMap's serve.args, written to tmp_path."""
    [c] = daemonset()["spec"]["template"]["spec"]["containers"]
    [cm] = [d for d in documents() if d["kind"] == "ConfigMap"]
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["selectors"]
    volume = {v["name"]: v for v in daemonset()["spec"]["template"]["spec"]["volumes"]}["selectors"]
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    local = tmp_path / "serve.args"
    local.write_text(cm["data"]["serve.args"])
    [at] = [a for a in c["args"] if a.startswith("@")]
    assert at == f"@{mount}/serve.args"
    return [f"@{local}" if a == at else a for a in c["args"]], local


def test_the_command_lines_parse(tmp_path: Path) -> None:
    args, _ = configmap_args(tmp_path)
    ns = build_parser().parse_args(args)
    assert ns.command == "serve" and ns.http == "0.0.0.0:7411"
    unit = (DEPLOY / "systemd" / "heapscope.service").read_text()
    [exec_start] = [ln.split("=", 1)[1] for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    ns = build_parser().parse_args(shlex.split(exec_start)[1:])
    assert ns.command == "serve" and ns.http.startswith("127.0.0.1:")


@pytest.mark.needs("promtool")
def test_prometheus_config_is_valid(tmp_path: Path) -> None:
    token = tmp_path / "heapscope.token"
    token.write_text("t0ken\n")
    config = tmp_path / "prometheus.yml"
    config.write_text((DEPLOY / "prometheus" / "prometheus.yml").read_text().replace(
        "/etc/prometheus/heapscope.token", str(token)))
    shutil.copy(ALERTS, tmp_path / ALERTS.name)  # its rule_files, beside it
    done = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = [j["job_name"] for j in yaml.safe_load(config.read_text())["scrape_configs"]]
    assert jobs == ["heapscope", "heapscope-kubernetes"]
    assert "SUCCESS: 2 rules found" in done.stdout, done.stdout


@pytest.mark.needs("promtool")
def test_growth_alerts_pass_promtool_and_fire(tmp_path: Path) -> None:
    """`promtool check rules`, then `promtool test rules`: made-up series of a target with a leak suspect from
    minute 2 on, a site adding 50,000 B/s, and the other sites' sum (never alerted on), evaluated by Prometheus's
    own rule engine."""
    done = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "SUCCESS: 2 rules found" in done.stdout, done.stdout + done.stderr
    target = 'pid="42",command="svc",cgroup="/system.slice/svc.service",unit="svc.service",container="",pod=""'
    labels = {"pid": "42", "command": "svc", "cgroup": "/system.slice/svc.service", "unit": "svc.service",
              "severity": "warning"}  # Prometheus drops the labels whose value is empty
    leak = "leak_one (svc.c:40)"
    cases = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": f"heapscope_leak_suspects{{{target}}}", "values": "0 0 1x60"},
                {"series": f'heapscope_site_growth_bytes_per_second{{{target},site="{leak}"}}', "values": "50000x90"},
                {"series": f'heapscope_site_growth_bytes_per_second{{{target},site="cache (svc.c:60)"}}',
                 "values": "100x90"},
                {"series": f'heapscope_site_growth_bytes_per_second{{{target},site="(other sites)"}}',
                 "values": "1000000x90"},
            ],
            "alert_rule_test": [
                {"eval_time": "20m", "alertname": "HeapscopeLeakSuspect", "exp_alerts": []},  # pending: for 30m
                {"eval_time": "40m", "alertname": "HeapscopeLeakSuspect", "exp_alerts": [{
                    "exp_labels": labels,
                    "exp_annotations": {
                        "summary": "svc (pid 42): 1 leak suspect site(s)",
                        "description": "heapscope sees steady growth made of bytes that stay at 1 allocation site(s) "
                                       "of svc (pid 42). The sites, their rates and stacks: GET /targets/42/growth on "
                                       "the daemon, or `heapscope growth STORE --pid 42`.",
                    },
                }]},
                {"eval_time": "50m", "alertname": "HeapscopeSiteGrowsFast", "exp_alerts": []},
                {"eval_time": "70m", "alertname": "HeapscopeSiteGrowsFast", "exp_alerts": [{
                    "exp_labels": {**labels, "site": leak},
                    "exp_annotations": {
                        "summary": f"svc (pid 42): {leak} grows fast",
                        "description": f"{leak} in svc (pid 42) has grown by 171.7MiB an hour for an hour. GET "
                                       "/targets/42/growth says whether it is a leak suspect, a cache still "
                                       "filling, or churn.",
                    },
                }]},
            ],
        }],
    }
    test_file = tmp_path / "alerts_test.yml"
    test_file.write_text(yaml.safe_dump(cases))
    done = subprocess.run(["promtool", "test", "rules", str(test_file)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


@pytest.mark.needs("systemd-analyze")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    exe = REPO / ".venv" / "bin" / "heapscope"
    if not exe.exists():
        pytest.skip("the venv's heapscope is not installed")
    unit = tmp_path / "heapscope.service"
    unit.write_text((DEPLOY / "systemd" / "heapscope.service").read_text().replace(
        "/opt/heapscope/venv/bin/heapscope", str(exe)))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False)
    problems = [ln for ln in done.stderr.splitlines() if "heapscope.service" in ln]
    assert done.returncode == 0 and not problems, done.stderr


def test_the_configmap_gives_the_daemon_its_limits_and_example_selectors(tmp_path: Path) -> None:
    """serve.args is read as arguments (comments left out) into the fleet's limits; each example selector in its
    comments is one the daemon accepts."""
    from agent.daemon.fleetopts import fleet_config_from

    args, local = configmap_args(tmp_path)
    config = fleet_config_from(build_parser().parse_args(args))
    assert config.limits.max_targets == 32 and config.limits.max_memory == 900 << 20
    assert config.keep_exited == 3600 and config.max_exited == 256 and config.output_max_age == 7 * 86400
    examples = [ln.strip().removeprefix("# ") for ln in local.read_text().splitlines()
                if ln.strip().startswith("# --attach-")]
    assert len(examples) >= 4
    for example in examples:
        chosen = fleet_config_from(build_parser().parse_args(["serve", example])).selectors
        assert len(chosen) == 1, example
    # A bad selector in the ConfigMap is one clear error, as on the command line.
    local.write_text("--attach-cgroup=kubepods\n")
    with pytest.raises(HeapscopeError, match="--attach-cgroup"):
        fleet_config_from(build_parser().parse_args(["serve", f"@{local}"]))
