"""deploy/: the Kubernetes manifests and the HAProxy configuration, checked without a cluster.

Each kustomization is rendered by a small renderer below (the subset of kustomize the overlays
use: resources, namespace, images, strategic-merge patches and `$patch: delete`), compared with
`kubectl kustomize` where kubectl is installed, and every manifest, raw and rendered, is validated
against the Kubernetes schemas (kubernetes-validate, strict: unknown fields fail). Then the parts
that must agree: the shutdown budget, the probes, ports, the autoscaler's target and metric, the
GPU overlay, the arguments against the real `enhancer serve` parser, and HAProxy's configuration
(`haproxy -c`, and a run against fake replicas) where haproxy is installed.
"""
from __future__ import annotations

import argparse
import copy
import csv
import http.server
import io
import re
import shutil
import socket
import socketserver
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.tls import certificate, haproxy_crt, with_certificate

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = ["base", "gpu", "keda", "prometheus-adapter"]
K8S_VERSIONS = ["1.30.0", kv.latest_version()]  # the oldest supported minor we target, and the newest
NAME = "tim-enhancer"
DRAIN_ENV = "TIM_ENHANCER_DRAIN_TIMEOUT_S"
AGENT_ENV = "TIM_ENHANCER_AGENT_PORT"
SUPPORTED_KEYS = {"apiVersion", "kind", "namespace", "resources", "images", "patches"}
CLUSTER_SCOPED = {"Namespace"}


# --- a tiny kustomize ------------------------------------------------------------------------

def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def merge(base, patch):
    """Strategic merge as the overlays use it: maps merge, lists of named maps (containers, env)
    merge by name with the patch's new entries first (as kustomize orders them), other lists are
    replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if named(base) and named(patch):
        by_name = {p["name"]: p for p in patch}
        kept = [merge(b, by_name.pop(b["name"])) if b["name"] in by_name else b for b in base]
        return [copy.deepcopy(p) for p in by_name.values()] + kept
    return copy.deepcopy(patch)


def named(xs) -> bool:
    return isinstance(xs, list) and bool(xs) and all(isinstance(x, dict) and "name" in x for x in xs)


def key(doc: dict) -> tuple:
    return doc["kind"], doc["metadata"]["name"]


def render(directory: Path) -> list[dict]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(k) <= SUPPORTED_KEYS, f"{directory}: the test's renderer does not know {set(k) - SUPPORTED_KEYS}"
    docs: list[dict] = []
    for r in k.get("resources", []):
        p = directory / r
        docs += render(p) if p.is_dir() else load_docs(p)
    for entry in k.get("patches", []):
        assert set(entry) == {"path"}, entry
        for patch in load_docs(directory / entry["path"]):
            i = next(i for i, d in enumerate(docs) if key(d) == key(patch))
            if patch.get("$patch") == "delete":
                del docs[i]
            else:
                docs[i] = merge(docs[i], patch)
    for img in k.get("images", []):
        for d in docs:
            for c in pod_spec(d).get("containers", []) if d["kind"] == "Deployment" else []:
                name, _, tag = c["image"].partition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    if "namespace" in k:
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = k["namespace"]
    return docs


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}(s)"
    return found[0]


def container(docs: list[dict]) -> dict:
    (c,) = pod_spec(one(docs, "Deployment"))["containers"]
    return c


def env(c: dict) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(DEPLOY / name) for name in KUSTOMIZATIONS}


# --- rendering and schemas -------------------------------------------------------------------

@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_renderer_agrees_with_kustomize(name, rendered):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (the renderer's output is still validated below)")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / name)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    theirs = {key(d): d for d in yaml.safe_load_all(out.stdout) if d}
    ours = {key(d): d for d in rendered[name]}
    assert ours == theirs


def manifests() -> list[tuple[str, dict]]:
    """Every whole manifest in deploy/ (patches are checked in the overlays they patch)."""
    out = []
    for name in KUSTOMIZATIONS:
        k = yaml.safe_load((DEPLOY / name / "kustomization.yaml").read_text())
        for r in k.get("resources", []):
            p = DEPLOY / name / r
            if p.is_file():
                out += [(f"{name}/{r}", d) for d in load_docs(p)]
    return out


def check_scaled_object(doc: dict) -> None:
    """KEDA's ScaledObject is a CRD kubernetes-validate has no schema for: its essentials by hand."""
    assert doc["apiVersion"] == "keda.sh/v1alpha1"
    spec = doc["spec"]
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod",
                         "idleReplicaCount", "advanced", "triggers", "fallback", "initialCooldownPeriod"}
    assert spec["scaleTargetRef"]["name"] and 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    for t in spec["triggers"]:
        assert t["type"] == "prometheus" and t["metricType"] in ("Value", "AverageValue")
        assert {"serverAddress", "query", "threshold"} <= set(t["metadata"])
        assert all(isinstance(v, str) for v in t["metadata"].values())  # KEDA's metadata is map[string]string
        float(t["metadata"]["threshold"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_is_valid(version, rendered):
    docs = manifests() + [(f"{n} (rendered)", d) for n in KUSTOMIZATIONS for d in rendered[n]]
    checked = set()
    for where, doc in docs:
        if doc["kind"] == "ScaledObject":
            check_scaled_object(doc)
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{where}: {doc['kind']} {doc['metadata']['name']}: {e.message} at {list(e.path)}")
        checked.add(doc["kind"])
    assert checked >= {"Namespace", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                       "ConfigMap", "Ingress"}


# --- what must agree -------------------------------------------------------------------------

def test_shutdown_budget_and_probes(rendered):
    for name in ("base", "gpu", "keda"):
        docs = rendered[name]
        spec, c = pod_spec(one(docs, "Deployment")), container(docs)
        pre = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre[0] == "sleep"
        drain = float(env(c)[DRAIN_ENV]["value"])
        # the streams' drain, then (today's server) the REST requests in flight, each up to the drain timeout
        assert spec["terminationGracePeriodSeconds"] > float(pre[1]) + 2 * drain + 5
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["startupProbe"]["httpGet"]["path"] == "/healthz"


def test_ports_and_services(rendered):
    docs = rendered["base"]
    ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
    args = container(docs)["args"]
    assert ports["http"] == int(args[args.index("--port") + 1])
    assert ports["agent"] == int(env(container(docs))[AGENT_ENV]["value"])
    selector = one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert selector.items() <= one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
    services = [d for d in docs if d["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {NAME, f"{NAME}-pods"}
    for s in services:
        assert s["spec"]["selector"] == selector
        for p in s["spec"]["ports"]:
            target = p["targetPort"]
            assert (ports[target] if isinstance(target, str) else target) in ports.values()
    assert one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == selector
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["http"] and annotations["prometheus.io/path"] == "/metrics"


def test_ingress_terminates_tls_for_streams_and_uploads(rendered):
    """https and wss at the edge of the cluster: every host of the Ingress is covered by its TLS
    Secret, plain http is redirected, the backend is the Service's http port, and the controller's
    limits let a live stream stay open and an upload of max_upload_bytes through unbuffered."""
    from server.settings import Settings

    for name in ("base", "gpu", "keda"):
        docs = rendered[name]
        ing = one(docs, "Ingress")
        spec, notes = ing["spec"], ing["metadata"]["annotations"]
        hosts = {r["host"] for r in spec["rules"]}
        assert hosts and hosts <= {h for t in spec["tls"] for h in t["hosts"]}
        assert all(t["secretName"] for t in spec["tls"])
        service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == NAME)
        for rule in spec["rules"]:
            (path,) = rule["http"]["paths"]
            assert (path["path"], path["pathType"]) == ("/", "Prefix")
            backend = path["backend"]["service"]
            assert backend["name"] == NAME and backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
        prefix = "nginx.ingress.kubernetes.io/"
        assert notes[prefix + "ssl-redirect"] == notes[prefix + "force-ssl-redirect"] == "true"
        assert notes[prefix + "proxy-request-buffering"] == "off"
        size = notes[prefix + "proxy-body-size"]
        assert size.endswith("m") and int(size[:-1]) * 2**20 >= Settings().max_upload_bytes
        for timeout in ("proxy-read-timeout", "proxy-send-timeout"):  # seconds: an hour's stream, a long upload
            assert int(notes[prefix + timeout]) >= 3600


def test_workers_follow_the_cpu_limit(rendered):
    for name in ("base", "gpu"):
        c = container(rendered[name])
        args = c["args"]
        assert args[args.index("--workers") + 1] == "$(CPU_LIMIT)"
        ref = env(c)["CPU_LIMIT"]["valueFrom"]["resourceFieldRef"]
        assert ref == {"containerName": c["name"], "resource": "limits.cpu", "divisor": "1"}
        assert c["resources"]["requests"] == c["resources"]["limits"]  # Guaranteed QoS


def serve_parser() -> argparse.ArgumentParser:
    from server.cli import add_serve

    top = argparse.ArgumentParser(prog="enhancer")
    add_serve(top.add_subparsers(dest="command"))
    return top


@pytest.mark.parametrize("name", ["base", "gpu"])
def test_arguments_parse_with_enhancer_serve(name, rendered):
    c = container(rendered[name])
    assert c["command"] == ["enhancer"]
    args = [a.replace("$(CPU_LIMIT)", "4") for a in c["args"]]
    a = serve_parser().parse_args(args)
    assert a.command == "serve" and a.host == "0.0.0.0" and a.workers == 4
    assert a.device == ("cuda" if name == "gpu" else "cpu")


def test_gpu_overlay(rendered):
    c = container(rendered["gpu"])
    assert c["args"][c["args"].index("--device") + 1] == "cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["image"].endswith("-gpu") and container(rendered["base"])["image"] != c["image"]
    tolerations = pod_spec(one(rendered["gpu"], "Deployment"))["tolerations"]
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)
    # everything else is the base's
    assert env(c).keys() - {"CUDA_CACHE_PATH"} == env(container(rendered["base"])).keys()
    assert c["readinessProbe"] == container(rendered["base"])["readinessProbe"]


def metric_names() -> set[str]:
    """Gauge names in server/metrics.py: the autoscaling rules must use real ones."""
    return set(re.findall(r'Gauge\(\s*"(\w+)"', (ROOT / "server" / "metrics.py").read_text()))


def test_autoscaling_on_stream_utilisation(rendered):
    gauges = {"tim_active_streams", "tim_capacity_streams"}
    assert gauges <= metric_names()
    hpa = one(rendered["base"], "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", NAME)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and 0 < kv_quantity(metric["pods"]["target"]["averageValue"]) < 1
    # the adapter's rule (ConfigMap and Helm values alike) serves that metric from the two gauges
    cm = one(rendered["prometheus-adapter"], "ConfigMap")
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    assert rules == yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    (rule,) = rules
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    assert all(g in rule["metricsQuery"] for g in gauges) and "<<.LabelMatchers>>" in rule["metricsQuery"]
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    # KEDA: the same ratio, no second HPA
    keda = rendered["keda"]
    assert not [d for d in keda if d["kind"] == "HorizontalPodAutoscaler"]
    so = one(keda, "ScaledObject")
    assert so["spec"]["scaleTargetRef"]["name"] == NAME and so["metadata"]["namespace"] == NAME
    (trigger,) = so["spec"]["triggers"]
    assert all(g in trigger["metadata"]["query"] for g in gauges)
    assert trigger["metadata"]["threshold"] == str(kv_quantity(metric["pods"]["target"]["averageValue"]))
    assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["spec"]["behavior"]
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (hpa["spec"]["minReplicas"],
                                                                              hpa["spec"]["maxReplicas"])


def kv_quantity(q) -> float:
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


# --- HAProxy ---------------------------------------------------------------------------------

HAPROXY_CFG = DEPLOY / "haproxy.cfg"


def test_haproxy_config_is_websocket_and_readiness_aware():
    text = HAPROXY_CFG.read_text()
    lines = [ln.split("#")[0].strip() for ln in text.splitlines()]
    assert "balance leastconn" in lines
    assert "option httpchk" in lines and any(ln.startswith("http-check send meth GET uri /readyz") for ln in lines)
    assert "http-check expect status 200" in lines
    assert any(re.fullmatch(r"timeout tunnel \d+[smh]", ln) for ln in lines)
    default = next(ln for ln in lines if ln.startswith("default-server"))
    assert " check" in default and "agent-check" in default
    servers = [ln for ln in lines if ln.startswith("server ")]
    active = [ln for ln in servers if " backup" not in ln]
    spill = [ln for ln in servers if " backup" in ln]
    assert len(active) == 3 and all("agent-port" in s for s in active)
    # the spill-over backups: the same replicas without the agent (a full cluster answers 1013, not 503)
    assert sorted(s.split()[2] for s in spill) == sorted(s.split()[2] for s in active)
    assert all("no-agent-check" in s for s in spill) and "option redispatch" in lines


def test_haproxy_terminates_tls():
    """https and wss at the edge: a TLS bind with a certificate, TLS 1.2 at least, HTTP/1.1 (which
    websockets upgrade from), the scheme passed on, HSTS on TLS answers; plain HTTP stays for the
    network inside (tests/server/test_tls.py streams and uploads through it)."""
    text = HAPROXY_CFG.read_text()
    lines = [ln.split("#")[0].strip() for ln in text.splitlines()]
    tls = [ln for ln in lines if ln.startswith("bind ") and " ssl " in f"{ln} "]
    assert len(tls) == 1 and haproxy_crt(text).endswith(".pem") and "alpn http/1.1" in tls[0], tls
    assert any(ln.startswith("ssl-default-bind-options") and "ssl-min-ver TLSv1.2" in ln for ln in lines)
    assert "http-request set-header X-Forwarded-Proto https if { ssl_fc }" in lines
    assert any(ln.startswith("http-response set-header Strict-Transport-Security") and ln.endswith("if { ssl_fc }")
               for ln in lines)


def test_haproxy_accepts_the_config(tmp_path):
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("haproxy not installed")
    text = with_certificate(HAPROXY_CFG.read_text(), certificate(tmp_path / "tls").pem)  # a certificate to load
    (tmp_path / "haproxy.cfg").write_text(text)
    out = subprocess.run([haproxy, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # the Kubernetes variant from its comments: server-template through the cluster DNS
    templates = re.findall(r"#\s+(server-template .*)", text)
    assert len(templates) == 2 and "backup" in templates[1]
    resolvers = re.search(r"#\s+(resolvers k8s\n(?:\s*#\s{5,}.*\n)+)", text).group(1)
    k8s = re.sub(r"\n[ \t]*server [rs]\d .*", "", text) + "\n" + re.sub(r"#\s+", "    ", resolvers)
    k8s = k8s.replace("\nbackend enhancer\n", "\nbackend enhancer\n" + "".join(f"    {t}\n" for t in templates))
    (tmp_path / "k8s.cfg").write_text(k8s)
    out = subprocess.run([haproxy, "-c", "-f", str(tmp_path / "k8s.cfg")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """A fake replica: HTTP (GET /readyz with `ready`'s status, anything else answers its name)
    and an agent port answering `agent` (the contract in deploy/README.md)."""

    def __init__(self, name: str, ready: int, agent: bytes):
        self.name, self.port, self.agent_port = name, free_port(), free_port()
        replica = self

        class Http(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status = ready if self.path == "/readyz" else 200
                body = replica.name.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        class Agent(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.sendall(agent)

        self.servers = [http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Http),
                        socketserver.ThreadingTCPServer(("127.0.0.1", self.agent_port), Agent)]
        for s in self.servers:
            s.daemon_threads = True
            threading.Thread(target=s.serve_forever, daemon=True).start()

    def close(self):
        for s in self.servers:
            s.shutdown()
            s.server_close()


def test_haproxy_sends_new_connections_to_free_capacity(tmp_path):
    """deploy/haproxy.cfg run against four fake replicas: 75 % free, full (0 %), draining, and not
    ready (/readyz 503, agent still up): only the first gets requests."""
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("haproxy not installed")
    replicas = [Replica("free", 200, b"75% ready up\n"), Replica("full", 200, b"0% ready up\n"),
                Replica("draining", 200, b"drain\n"), Replica("unready", 503, b"100% ready up\n")]
    front, stats = free_port(), free_port()
    cfg = with_certificate(HAPROXY_CFG.read_text(), certificate(tmp_path / "tls").pem, f"127.0.0.1:{free_port()}")
    cfg = re.sub(r"maxconn \d+", "maxconn 256", cfg)  # within this machine's open-file limit
    cfg = cfg.replace("bind :8000", f"bind 127.0.0.1:{front}").replace("bind 127.0.0.1:8404", f"bind 127.0.0.1:{stats}")
    servers = "".join(f"\n    server {r.name} 127.0.0.1:{r.port} agent-port {r.agent_port}" for r in replicas)
    cfg = re.sub(r"(\n[ \t]*server r\d [^\n]*)+", lambda m: servers, cfg, count=1)
    cfg = re.sub(r"\n[ \t]*server s\d [^\n]*", "", cfg)  # no spill-over here: one replica has room
    (tmp_path / "h.cfg").write_text(cfg)
    proc = subprocess.Popen([haproxy, "-f", str(tmp_path / "h.cfg")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        want = {"free": ("UP", "75"), "full": ("UP", "0"), "draining": ("DRAIN", None), "unready": ("DOWN", None)}
        deadline, state = time.monotonic() + 20, {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{stats}/;csv", timeout=2).read().decode()
            except OSError:
                time.sleep(0.3)
                continue
            rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
            state = {r["svname"]: (r["status"].split()[0], r["weight"]) for r in rows if r["svname"] in want}
            if all(state.get(n, ("",))[0] == s and (w is None or state[n][1] == w) for n, (s, w) in want.items()):
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"servers never reached {want}: {state}")
        got = {urllib.request.urlopen(f"http://127.0.0.1:{front}/x", timeout=5).read().decode() for _ in range(12)}
        assert got == {"free"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for r in replicas:
            r.close()
