#!/usr/bin/python3
"""Static checks of kvdepot's deployment files: Kubernetes manifests,
Dockerfiles, the compose file and .dockerignore.

No Kubernetes schema checker (kubeconform, kubeval) and no Dockerfile linter
(hadolint) is packaged for Debian 12, and no cluster or image registry is
reachable from CI, so this parses every file and checks what a schema check
and a careful reviewer would: required fields per kind, selectors that match
pod labels, probe and Service ports that exist on the container, mounts that
name declared volumes, a headless Service for the StatefulSet, config keys
that kvdepotd knows, CLI flags the kvdepot CLI knows, and the instructions
each image must have.

    check_deploy.py REPO_ROOT [--kvdepotd BIN] [--kvdepot BIN]

With the binaries, config keys are checked against `kvdepotd --help` and the
flags of probe commands against the CLI's usage text. Prints one line per
problem and exits 1 when there is any.
"""
import argparse
import copy
import os
import re
import subprocess
import sys

import yaml

problems = []


def problem(where, msg):
    problems.append(f"{where}: {msg}")


def load_all(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


# --------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------

KNOWN = {
    ("v1", "ConfigMap"), ("v1", "Service"), ("v1", "Secret"),
    ("apps/v1", "StatefulSet"), ("policy/v1", "PodDisruptionBudget"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
}
QTY = re.compile(r"^([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
MULT = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
        "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(where, v):
    m = QTY.match(str(v))
    if not m:
        problem(where, f"bad resource quantity {v!r}")
        return 0.0
    return float(m.group(1)) * MULT[m.group(2)]


def check_object(where, o):
    if not isinstance(o, dict):
        problem(where, "document is not a mapping")
        return False
    for k in ("apiVersion", "kind"):
        if not isinstance(o.get(k), str) or not o[k]:
            problem(where, f"missing {k}")
            return False
    name = (o.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name):
        problem(where, f"{o['kind']}: metadata.name missing or not a DNS name: {name!r}")
    if (o["apiVersion"], o["kind"]) not in KNOWN:
        problem(where, f"unexpected {o['apiVersion']} {o['kind']}")
    return True


def merge(base, patch):
    """Strategic merge as kubectl does it for what the overlays use:
    mappings merge, lists of named items merge by name, other lists and
    scalars are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and
            all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [copy.deepcopy(x) for x in base]
        for p in patch:
            for i, b in enumerate(out):
                if b["name"] == p["name"]:
                    out[i] = merge(b, p)
                    break
            else:
                out.append(copy.deepcopy(p))
        return out
    return copy.deepcopy(patch)


def kustomize(dirpath, seen=()):
    """The objects a kustomization directory produces (resources, images,
    namespace, patches), enough to check what `kubectl apply -k` applies."""
    kpath = os.path.join(dirpath, "kustomization.yaml")
    where = os.path.relpath(kpath)
    if dirpath in seen:
        problem(where, "kustomization cycle")
        return []
    k = load_all(kpath)[0]
    if k.get("kind") != "Kustomization" or not str(k.get("apiVersion", "")).startswith(
            "kustomize.config.k8s.io/"):
        problem(where, "not a Kustomization")
    objs = []
    for r in k.get("resources", []):
        p = os.path.normpath(os.path.join(dirpath, r))
        if os.path.isdir(p):
            if not os.path.exists(os.path.join(p, "kustomization.yaml")):
                problem(where, f"resource directory {r} has no kustomization.yaml")
                continue
            objs += kustomize(p, seen + (dirpath,))
        elif os.path.isfile(p):
            for i, o in enumerate(load_all(p)):
                if check_object(f"{os.path.relpath(p)}[{i}]", o):
                    objs.append(o)
        else:
            problem(where, f"resource {r} does not exist")
    ns = k.get("namespace")
    for o in objs:
        if ns:
            o.setdefault("metadata", {})["namespace"] = ns
        for lab in k.get("labels", []):
            o.setdefault("metadata", {}).setdefault("labels", {}).update(lab.get("pairs", {}))
    for img in k.get("images", []):
        for o in objs:
            for c in pod_containers(o):
                if c.get("image", "").split(":")[0] == img["name"]:
                    c["image"] = f"{img.get('newName', img['name'])}:{img.get('newTag', 'latest')}"
    for pt in k.get("patches", []):
        p = os.path.join(dirpath, pt.get("path", ""))
        if not os.path.isfile(p):
            problem(where, f"patch {pt.get('path')} does not exist")
            continue
        patch = load_all(p)[0]
        tgt = pt.get("target", {})
        hit = False
        for i, o in enumerate(objs):
            if (o["kind"] == tgt.get("kind", patch.get("kind")) and
                    o["metadata"]["name"] == tgt.get("name", patch["metadata"]["name"])):
                objs[i] = merge(o, {k2: v for k2, v in patch.items() if k2 != "metadata"})
                hit = True
        if not hit:
            problem(where, f"patch {pt['path']} matches no resource")
    return objs


def pod_spec(o):
    if o.get("kind") in ("StatefulSet", "Deployment", "DaemonSet"):
        return ((o.get("spec") or {}).get("template") or {}).get("spec") or {}
    return None


def pod_containers(o):
    ps = pod_spec(o)
    return (ps.get("containers") or []) if ps else []


def labels_match(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_probe(where, probe, ports, cli_flags):
    if probe is None:
        return
    kinds = [k for k in ("exec", "httpGet", "grpc", "tcpSocket") if k in probe]
    if len(kinds) != 1:
        problem(where, "a probe needs exactly one of exec, httpGet, grpc, tcpSocket")
        return
    k = kinds[0]
    if k == "exec":
        cmd = probe["exec"].get("command") or []
        if not cmd:
            problem(where, "exec probe without a command")
        elif cmd[0] not in ("kvdepot", "/usr/local/bin/kvdepot"):
            problem(where, f"exec probe runs {cmd[0]!r}, which the image does not ship")
        elif cli_flags is not None:
            for a in cmd[1:]:
                if a.startswith("--") and a.split("=")[0] not in cli_flags:
                    problem(where, f"the kvdepot CLI has no flag {a}")
        if cmd and cmd[-1] != "health" and "health" not in cmd:
            problem(where, "exec probe does not run `kvdepot health`")
    else:
        port = probe[k].get("port")
        if port not in ports["names"] and port not in ports["numbers"]:
            problem(where, f"{k} probe port {port!r} is not a container port")
    for f in ("periodSeconds", "timeoutSeconds", "failureThreshold"):
        if f in probe and (not isinstance(probe[f], int) or probe[f] < 1):
            problem(where, f"{f} must be a positive integer")
    if probe.get("timeoutSeconds", 1) >= probe.get("periodSeconds", 10):
        problem(where, "timeoutSeconds should be below periodSeconds")


def check_workload(where, o, objs, cli_flags, settings):
    spec = o.get("spec") or {}
    sel = (spec.get("selector") or {}).get("matchLabels") or {}
    tmpl = spec.get("template") or {}
    tlabels = (tmpl.get("metadata") or {}).get("labels") or {}
    if not labels_match(sel, tlabels):
        problem(where, f"selector {sel} does not match template labels {tlabels}")
    ps = tmpl.get("spec") or {}
    if o["kind"] == "StatefulSet":
        svc = [s for s in objs if s["kind"] == "Service" and
               s["metadata"]["name"] == spec.get("serviceName")]
        if not svc:
            problem(where, f"serviceName {spec.get('serviceName')!r} names no Service")
        elif (svc[0].get("spec") or {}).get("clusterIP") != "None":
            problem(where, f"serviceName {spec.get('serviceName')} is not headless (clusterIP: None)")
        if not spec.get("volumeClaimTemplates"):
            problem(where, "no volumeClaimTemplates: pods would share or lose their store")
        for t in spec.get("volumeClaimTemplates") or []:
            s = t.get("spec") or {}
            if not s.get("accessModes") or not ((s.get("resources") or {}).get("requests") or {}).get("storage"):
                problem(where, f"volumeClaimTemplate {t.get('metadata', {}).get('name')} needs accessModes and a storage request")
    sc = ps.get("securityContext") or {}
    if not sc.get("runAsNonRoot") or sc.get("runAsUser", 0) == 0:
        problem(where, "pods must run as a non-root user")
    volumes = {v["name"]: v for v in ps.get("volumes") or []}
    volumes.update({t["metadata"]["name"]: t for t in spec.get("volumeClaimTemplates") or []})
    for v in ps.get("volumes") or []:
        if "configMap" in v:
            cm = [c for c in objs if c["kind"] == "ConfigMap" and
                  c["metadata"]["name"] == v["configMap"].get("name")]
            if not cm:
                problem(where, f"volume {v['name']} names ConfigMap {v['configMap'].get('name')!r}, which is not applied")
    containers = ps.get("containers") or []
    if not containers:
        problem(where, "no containers")
    for c in containers:
        cw = f"{where} container {c.get('name')}"
        if not c.get("image"):
            problem(cw, "no image")
        ports = {"names": set(), "numbers": set()}
        for p in c.get("ports") or []:
            if not isinstance(p.get("containerPort"), int):
                problem(cw, f"port {p} has no numeric containerPort")
                continue
            ports["numbers"].add(p["containerPort"])
            if p.get("name"):
                if len(p["name"]) > 15:
                    problem(cw, f"port name {p['name']} longer than 15 characters")
                ports["names"].add(p["name"])
        if 50051 not in ports["numbers"]:
            problem(cw, "gRPC port 50051 is not a container port")
        if "metrics" not in ports["names"]:
            problem(cw, "no port named metrics (ServiceMonitor selects it by name)")
        c["_ports"] = ports
        for pk in ("livenessProbe", "readinessProbe", "startupProbe"):
            check_probe(f"{cw} {pk}", c.get(pk), ports, cli_flags)
        if not c.get("readinessProbe") or not c.get("livenessProbe"):
            problem(cw, "needs a readiness and a liveness probe")
        mounts = set()
        for m in c.get("volumeMounts") or []:
            if m.get("name") not in volumes:
                problem(cw, f"volumeMount {m.get('name')!r} names no volume")
            mounts.add(m.get("mountPath"))
            if m.get("subPath") and "configMap" in volumes.get(m.get("name"), {}):
                cm = [x for x in objs if x["kind"] == "ConfigMap" and
                      x["metadata"]["name"] == volumes[m["name"]]["configMap"]["name"]]
                if cm and m["subPath"] not in (cm[0].get("data") or {}):
                    problem(cw, f"subPath {m['subPath']} is not a key of ConfigMap {cm[0]['metadata']['name']}")
        if "/data" not in mounts:
            problem(cw, "nothing mounted at /data (the store)")
        args = c.get("args") or []
        if "--config" in args:
            cfg = args[args.index("--config") + 1]
            if cfg not in mounts:
                problem(cw, f"--config {cfg} is not a mounted path")
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        for r in ("cpu", "memory"):
            if r not in req or r not in lim:
                problem(cw, f"needs a {r} request and limit")
            elif quantity(cw, req[r]) > quantity(cw, lim[r]):
                problem(cw, f"{r} request above its limit")
        if "nvidia.com/gpu" in req or "nvidia.com/gpu" in lim:
            if str(lim.get("nvidia.com/gpu")) != str(req.get("nvidia.com/gpu", lim.get("nvidia.com/gpu"))):
                problem(cw, "nvidia.com/gpu request and limit must be equal")
        env = {e["name"]: e for e in c.get("env") or []}
        threads = ((env.get("KVDEPOT_COMPUTE_THREADS") or {}).get("valueFrom") or {}).get(
            "resourceFieldRef") or {}
        if threads.get("resource") != "limits.cpu":
            problem(cw, "KVDEPOT_COMPUTE_THREADS must come from limits.cpu")
        if settings is not None:
            for e in env:
                if e.startswith("KVDEPOT_") and e[8:].lower().replace("_", "-") not in settings:
                    problem(cw, f"{e} is not a kvdepotd setting")


def check_service(where, s, objs):
    spec = s.get("spec") or {}
    sel = spec.get("selector") or {}
    pods = [o for o in objs if pod_spec(o) is not None and
            labels_match(sel, ((o["spec"].get("template") or {}).get("metadata") or {}).get("labels") or {})]
    if not pods:
        problem(where, f"selector {sel} matches no pod template")
    for p in spec.get("ports") or []:
        if not p.get("name"):
            problem(where, "every port needs a name")
        tp = p.get("targetPort", p.get("port"))
        for o in pods:
            for c in pod_containers(o):
                ports = c.get("_ports") or {"names": set(), "numbers": set()}
                if tp not in ports["names"] and tp not in ports["numbers"]:
                    problem(where, f"targetPort {tp!r} is not a port of container {c.get('name')}")


def check_k8s(root, cli_flags, settings, rendered=()):
    """The kustomize variants (base, gpu overlay) and any manifests rendered
    from the Helm chart (NAME=FILE; NAME containing "gpu" is a GPU variant)."""
    kdir = os.path.join(root, "deploy", "k8s")
    base = os.path.join(kdir, "base")
    variants = {"base": kustomize(base), "gpu": kustomize(os.path.join(kdir, "overlays", "gpu"))}
    for spec in rendered:
        vname, _, path = spec.partition("=")
        objs = []
        for i, o in enumerate(load_all(path)):
            if check_object(f"{vname}[{i}]", o):
                objs.append(o)
        variants[vname] = objs
        same_as_kustomize(vname, objs, variants["gpu" if "gpu" in vname else "base"])
    for vname, objs in variants.items():
        kinds = {o["kind"] for o in objs}
        for need in ("StatefulSet", "Service", "ConfigMap"):
            if need not in kinds:
                problem(vname, f"no {need}")
        svcs = [o for o in objs if o["kind"] == "Service"]
        if not any((s.get("spec") or {}).get("clusterIP") == "None" for s in svcs):
            problem(vname, "no headless Service")
        if not any((s.get("spec") or {}).get("clusterIP") != "None" for s in svcs):
            problem(vname, "no regular Service")
        for o in objs:
            w = f"{vname}: {o['kind']}/{o['metadata']['name']}"
            if pod_spec(o) is not None:
                check_workload(w, o, objs, cli_flags, settings)
        for o in objs:
            w = f"{vname}: {o['kind']}/{o['metadata']['name']}"
            if o["kind"] == "Service":
                check_service(w, o, objs)
            elif o["kind"] == "PodDisruptionBudget":
                sel = ((o.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
                if not any(labels_match(sel, ((x["spec"]["template"].get("metadata") or {}).get("labels") or {}))
                           for x in objs if pod_spec(x) is not None):
                    problem(w, "selector matches no pod template")
            elif o["kind"] == "ConfigMap":
                for key, text in (o.get("data") or {}).items():
                    if key.endswith((".yaml", ".yml")):
                        check_config_text(f"{w} {key}", text, settings)
            elif o["kind"] == "ServiceMonitor":
                check_service_monitor(w, o, objs)
        gpus = [c for o in objs for c in pod_containers(o)
                if "nvidia.com/gpu" in ((c.get("resources") or {}).get("limits") or {})]
        if "gpu" in vname:
            if not gpus:
                problem(vname, "no container asks for nvidia.com/gpu")
            if not any("cuda" in c.get("image", "") for o in objs for c in pod_containers(o)):
                problem(vname, "the GPU variant does not use the CUDA image")
        elif gpus:
            problem(vname, "the CPU variant asks for a GPU")
        secret_names = {v["secret"]["secretName"] for o in objs for v in (pod_spec(o) or {}).get("volumes") or []
                        if "secret" in v}
        check_secret(os.path.join(kdir, "secret.example.yaml"), secret_names, objs)
    sm_path = os.path.join(kdir, "servicemonitor.yaml")
    for i, sm in enumerate(load_all(sm_path)):
        w = f"{os.path.relpath(sm_path)}[{i}]"
        if check_object(w, sm):
            check_service_monitor(w, sm, variants["base"])


def check_service_monitor(w, sm, objs):
    sel = ((sm.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    eps = (sm.get("spec") or {}).get("endpoints") or []
    if not eps:
        problem(w, "no endpoints")
    for ep in eps:
        ok = any(labels_match(sel, (s["metadata"].get("labels") or {})) and
                 any(p.get("name") == ep.get("port") for p in s["spec"].get("ports") or [])
                 for s in objs if s["kind"] == "Service")
        if not ok:
            problem(w, f"no selected Service has a port named {ep.get('port')!r}")


# What the Helm chart's pods must share with the kustomize manifests: the two
# ways of deploying kvdepot may differ in names and labels, not in how the
# server runs.
SAME_POD = ("securityContext", "terminationGracePeriodSeconds")
SAME_CONTAINER = ("args", "ports", "resources", "startupProbe", "readinessProbe",
                  "livenessProbe", "volumeMounts", "securityContext", "env")


def same_as_kustomize(vname, objs, kobjs):
    def first(kind, os_):
        return next((o for o in os_ if o["kind"] == kind), None)
    ss, ks = first("StatefulSet", objs), first("StatefulSet", kobjs)
    if not ss or not ks:
        return
    for k in SAME_POD:
        if pod_spec(ss).get(k) != pod_spec(ks).get(k):
            problem(vname, f"pod {k} differs from deploy/k8s's")
    c, kc = pod_containers(ss)[0], pod_containers(ks)[0]
    for k in SAME_CONTAINER:
        if c.get(k) != kc.get(k):
            problem(vname, f"container {k} differs from deploy/k8s's: {c.get(k)!r} vs {kc.get(k)!r}")
    for k in ("nodeSelector", "tolerations"):
        if pod_spec(ss).get(k) != pod_spec(ks).get(k):
            problem(vname, f"pod {k} differs from deploy/k8s's")
    cm, kcm = first("ConfigMap", objs), first("ConfigMap", kobjs)
    if cm and kcm:
        a = yaml.safe_load((cm.get("data") or {}).get("kvdepot.yaml", "")) or {}
        b = yaml.safe_load((kcm.get("data") or {}).get("kvdepot.yaml", "")) or {}
        if a != b:
            problem(vname, f"kvdepotd's config differs from deploy/k8s's: {a} vs {b}")


def check_secret(path, names, objs):
    w = os.path.relpath(path)
    docs = load_all(path)
    if not docs or not check_object(w, docs[0]):
        return
    s = docs[0]
    if s["kind"] != "Secret":
        problem(w, "not a Secret")
        return
    if s["metadata"]["name"] not in names:
        problem(w, f"Secret {s['metadata']['name']} is not the one the pods mount ({names})")
    data = dict(s.get("stringData") or {})
    data.update(s.get("data") or {})
    # Every file the config refers to under the secrets mount must be a key.
    for o in objs:
        if o["kind"] != "ConfigMap":
            continue
        for text in (o.get("data") or {}).values():
            for f in re.findall(r"/etc/kvdepot/secrets/([A-Za-z0-9._-]+)", text):
                if f not in data:
                    problem(w, f"the config reads secrets/{f}, which the Secret lacks")
    # A template only: placeholders, never key material.
    for k, v in data.items():
        if re.search(r"[A-Za-z0-9+/]{40,}", str(v)):
            problem(w, f"{k} looks like real key material; keep the template free of keys")


# --------------------------------------------------------------------------
# kvdepotd config files
# --------------------------------------------------------------------------

def check_config_text(where, text, settings):
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem(where, f"YAML: {e}")
        return
    if not isinstance(cfg, dict):
        problem(where, "config is not a mapping")
        return
    if settings is not None:
        for k in cfg:
            if k not in settings:
                problem(where, f"{k} is not a kvdepotd setting")
    listen = str(cfg.get("listen", ""))
    if listen and not listen.startswith("0.0.0.0:") and not listen.startswith("[::]:"):
        problem(where, f"listen {listen} is not reachable from outside the container")
    if cfg.get("data-dir") not in (None, "/data"):
        problem(where, "data-dir should be the /data volume")


# --------------------------------------------------------------------------
# Dockerfiles, compose, .dockerignore
# --------------------------------------------------------------------------

def dockerfile_instructions(path):
    """(line, INSTRUCTION, arguments) with continuations joined."""
    out, cur, start = [], "", 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            s = line.rstrip("\n")
            if not cur and (not s.strip() or s.lstrip().startswith("#")):
                continue
            if cur and s.lstrip().startswith("#"):
                continue
            if not cur:
                start = n
            if s.endswith("\\"):
                cur += s[:-1] + " "
                continue
            cur += s
            parts = cur.strip().split(None, 1)
            out.append((start, parts[0].upper(), parts[1] if len(parts) > 1 else ""))
            cur = ""
    if cur:
        out.append((start, "?", cur))
    return out


VALID = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
         "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def check_dockerfile(root, rel, runtime_want, build_want, cuda):
    path = os.path.join(root, rel)
    ins = dockerfile_instructions(path)
    args, stages, final = {}, [], None
    env, exposed, volumes, users, entry, cmd = {}, set(), set(), [], None, None
    labels, health = {}, None
    for n, op, a in ins:
        w = f"{rel}:{n}"
        if op not in VALID:
            problem(w, f"unknown instruction {op}")
            continue
        if op == "ARG":
            k, _, v = a.partition("=")
            args.setdefault(k.strip(), v.strip().strip('"'))
        elif op == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", a, re.I)
            if not m:
                problem(w, f"malformed FROM {a}")
                continue
            image = re.sub(r"\$\{(\w+)\}", lambda x: args.get(x.group(1), ""), m.group(1))
            if "${" in image or not image or image.endswith(":") or "-:" in image:
                problem(w, f"FROM {m.group(1)} uses an ARG without a default")
            if ":" not in image.split("/")[-1]:
                problem(w, f"FROM {image} has no tag")
            stages.append(m.group(2))
            final = image
            env, exposed, volumes, users, entry, cmd = {}, set(), set(), [], None, None
            labels, health = {}, None
        elif op == "LABEL":
            for k, v in re.findall(r'([\w.-]+)=("[^"]*"|\S+)', a):
                labels[k] = v.strip('"')
        elif op == "HEALTHCHECK":
            health = (w, a)
        elif op in ("COPY", "ADD"):
            words = a.split()
            frm = [x for x in words if x.startswith("--from=")]
            srcs = [x for x in words if not x.startswith("--")][:-1]
            if frm:
                if frm[0][7:] not in stages:
                    problem(w, f"COPY {frm[0]} names no earlier stage")
            else:
                for s in srcs:
                    if s != "." and not os.path.exists(os.path.join(root, s)):
                        problem(w, f"COPY source {s} does not exist in the repository")
            if op == "ADD":
                problem(w, "use COPY, not ADD")
        elif op == "ENV":
            for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', a):
                env[k] = v.strip('"')
        elif op == "EXPOSE":
            exposed.update(p.split("/")[0] for p in a.split())
        elif op == "VOLUME":
            v = a.strip()
            volumes.update(yaml.safe_load(v) if v.startswith("[") else v.split())
        elif op == "USER":
            users.append(a.strip())
        elif op == "ENTRYPOINT":
            entry = a
        elif op == "CMD":
            cmd = a
        elif op == "RUN" and "apt-get install" in a and "--no-install-recommends" not in a:
            problem(w, "apt-get install without --no-install-recommends")
    if len(stages) < 2:
        problem(rel, "not a multi-stage build")
    if not any(s and s.lower() == "build" for s in stages):
        problem(rel, "no stage named build")
    first = re.sub(r"\$\{(\w+)\}", lambda x: args.get(x.group(1), ""),
                   next(a for _, op, a in ins if op == "FROM").split()[0])
    if not re.match(build_want, first):
        problem(rel, f"build stage from {first}, want {build_want}")
    if not final or not re.match(runtime_want, final):
        problem(rel, f"runtime stage from {final}, want {runtime_want}")
    text = open(path, encoding="utf-8").read()
    want_cuda = "-DKVD_WITH_CUDA=ON" if cuda else "-DKVD_WITH_CUDA=OFF"
    if want_cuda not in text:
        problem(rel, f"the build does not pass {want_cuda}")
    if "cmake --build" not in text:
        problem(rel, "does not build with CMake")
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problem(rel, "the runtime stage must end with a non-root USER")
    for p in ("50051", "9464"):
        if p not in exposed:
            problem(rel, f"does not EXPOSE {p}")
    if "/data" not in volumes:
        problem(rel, "no VOLUME /data")
    # OCI annotations of the runtime image; the version one from the
    # VERSION build argument.
    for k in ("title", "description", "version", "revision", "created", "licenses"):
        if f"org.opencontainers.image.{k}" not in labels:
            problem(rel, f"no LABEL org.opencontainers.image.{k}")
    if "VERSION" not in labels.get("org.opencontainers.image.version", ""):
        problem(rel, "the version label does not come from ARG VERSION")
    if not health:
        problem(rel, "no HEALTHCHECK")
    else:
        w, a = health
        m = re.match(r"((?:--[a-z-]+=\S+\s+)*)CMD\s+(\[.*\])\s*$", a, re.S)
        if not m:
            problem(w, "HEALTHCHECK is not --options CMD [exec form]")
        else:
            opts = dict(o[2:].split("=", 1) for o in m.group(1).split())
            for o in ("interval", "timeout", "start-period", "retries"):
                if o not in opts:
                    problem(w, f"HEALTHCHECK without --{o}")
            probe = " ".join(yaml.safe_load(m.group(2)))
            if "/readyz" not in probe:
                problem(w, "HEALTHCHECK does not probe /readyz")
            if "9464" not in probe:
                problem(w, "HEALTHCHECK does not default to the metrics port 9464")
    if not entry or "kvdepotd" not in entry:
        problem(rel, "ENTRYPOINT is not kvdepotd")
    if entry and not entry.strip().startswith("["):
        problem(rel, "ENTRYPOINT in shell form: kvdepotd would not get SIGTERM")
    if not cmd or "--config" not in cmd:
        problem(rel, "CMD does not pass --config")
    else:
        cfg = yaml.safe_load(cmd)[-1]
        copied = [a for _, op, a in ins if op == "COPY" and a.split()[-1] == cfg]
        if not copied:
            problem(rel, f"CMD reads {cfg}, which no COPY puts there")
        else:
            src = copied[-1].split()[-2]
            with open(os.path.join(root, src), encoding="utf-8") as f:
                check_config_text(f"{rel} {src}", f.read(), SETTINGS)


def check_compose(root, cli_flags):
    rel = "deploy/compose.yaml"
    path = os.path.join(root, rel)
    c = load_all(path)[0]
    base = os.path.dirname(path)
    svcs = c.get("services") or {}
    if len(svcs) != 1:
        problem(rel, "expected exactly one service")
    named = set((c.get("volumes") or {}).keys())
    for name, s in svcs.items():
        w = f"{rel} services.{name}"
        b = s.get("build") or {}
        if b:
            df = os.path.normpath(os.path.join(base, b.get("context", "."), b.get("dockerfile", "Dockerfile")))
            if not os.path.isfile(df):
                problem(w, f"build.dockerfile {df} does not exist")
        if not s.get("image") and not b:
            problem(w, "needs an image or a build")
        ports = [str(p) for p in s.get("ports") or []]
        if not any(p.endswith(":50051") for p in ports):
            problem(w, "does not publish 50051")
        mounts = {}
        has_named = False
        for v in s.get("volumes") or []:
            src, _, rest = str(v).partition(":")
            dst = rest.split(":")[0]
            mounts[dst] = src
            if src.startswith((".", "/")):
                if not os.path.exists(os.path.join(base, src)):
                    problem(w, f"bind mount source {src} does not exist")
            else:
                has_named = True
                if src not in named:
                    problem(w, f"volume {src} is not declared under volumes:")
        if not has_named or mounts.get("/data") not in named:
            problem(w, "the store (/data) is not on a named volume")
        cmd = s.get("command") or []
        if "--config" in cmd:
            cfg = cmd[cmd.index("--config") + 1]
            if cfg not in mounts:
                problem(w, f"--config {cfg} is not mounted")
            else:
                with open(os.path.join(base, mounts[cfg]), encoding="utf-8") as f:
                    check_config_text(f"{w} {mounts[cfg]}", f.read(), SETTINGS)
        else:
            problem(w, "no config file given")
        hc = (s.get("healthcheck") or {}).get("test") or []
        if "health" not in hc:
            problem(w, "healthcheck does not run `kvdepot health`")
        elif cli_flags is not None:
            for a in hc:
                if str(a).startswith("--") and a not in cli_flags:
                    problem(w, f"the kvdepot CLI has no flag {a}")


def check_dockerignore(root):
    path = os.path.join(root, ".dockerignore")
    if not os.path.isfile(path):
        problem(".dockerignore", "missing")
        return
    lines = {l.strip() for l in open(path, encoding="utf-8") if l.strip() and not l.startswith("#")}
    for need in (".git", "build*/", "deploy/compose/secrets/"):
        if need not in lines:
            problem(".dockerignore", f"does not exclude {need}")


# --------------------------------------------------------------------------

def cli_flag_set(binary):
    """Flags named in the CLI's usage text (printed on --help or bad use)."""
    if not binary:
        return None
    r = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    return set(re.findall(r"--[a-z][a-z0-9-]*", r.stdout + r.stderr))


def server_settings(binary):
    if not binary:
        return None
    r = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    names = set(re.findall(r"^\s*--([a-z][a-z0-9-]*)", r.stdout + r.stderr, re.M))
    return names or None


SETTINGS = None


def main():
    global SETTINGS
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--kvdepotd")
    ap.add_argument("--kvdepot")
    ap.add_argument("--rendered", action="append", default=[], metavar="NAME=FILE",
                    help="manifests rendered from the Helm chart with its default values "
                         "(a NAME containing gpu: with gpu.enabled), checked like the "
                         "kustomize variants and compared with them")
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    a.rendered = [f"{n}={os.path.abspath(f)}" for n, _, f in (r.partition("=") for r in a.rendered)]
    os.chdir(root)
    SETTINGS = server_settings(a.kvdepotd)
    cli = cli_flag_set(a.kvdepot)
    check_k8s(root, cli, SETTINGS, a.rendered)
    check_dockerfile(root, "deploy/Dockerfile", r"debian:12-slim$", r"debian:12$", cuda=False)
    check_dockerfile(root, "deploy/Dockerfile.cuda", r"nvidia/cuda:[0-9.]+-runtime-",
                     r"nvidia/cuda:[0-9.]+-devel-", cuda=True)
    check_compose(root, cli)
    check_dockerignore(root)
    for p in problems:
        print(p)
    print(f"check_deploy: {len(problems)} problem(s)"
          f"{'' if SETTINGS else ' (kvdepotd settings not checked)'}"
          f"{'' if cli else ' (CLI flags not checked)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
