#!/usr/bin/python3
"""Checks deploy/monitoring against what a running kvdepotd exports.

    check_monitoring.py METRICS_TEXT ALERTS_YAML DASHBOARD_JSON

METRICS_TEXT is a /metrics scrape of a kvdepotd that has served some calls.
Every metric an alert or a dashboard query reads must be one kvdepotd
exports (a renamed series would otherwise leave an alert that never fires
and a panel that stays empty). Alerts: the ones operators rely on exist,
each with a severity and a summary and description. Dashboard: well-formed
for Grafana (unique ids, a 24-column grid without overlaps, every query on
the datasource variable). Every dashboard query is also written, with
Grafana's variables replaced, into a recording-rule file for `promtool
check rules`, which parses the PromQL. Prints one line per problem and
exits 1 when there is any.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import yaml

problems = []


def problem(where, msg):
    problems.append(f"{where}: {msg}")


def exported(path):
    names = set()
    with open(path, encoding="utf-8") as f:
        for ln in f:
            if ln.startswith("# TYPE "):
                _, _, name, kind = ln.split()
                names.add(name)
                if kind == "histogram":
                    names.update(name + s for s in ("_bucket", "_sum", "_count"))
    return names


METRIC = re.compile(r"\b((?:kvdepot|process)_[a-z0-9_]+)\b")
REQUIRED_ALERTS = {  # what the operator guide promises
    "KvdepotNotReady", "KvdepotChecksumFailures", "KvdepotRocksDBBackgroundErrors",
    "KvdepotTierThrashing", "KvdepotTenantQuotaNearLimit",
}


def check_names(where, expr, names):
    found = METRIC.findall(expr)
    if not found:
        problem(where, f"reads no kvdepot metric: {expr}")
    for m in found:
        if m not in names:
            problem(where, f"reads {m}, which kvdepotd does not export")


def check_alerts(path, names):
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    seen = set()
    for g in doc.get("groups", []):
        for r in g.get("rules", []):
            name = r.get("alert") or r.get("record")
            where = f"{os.path.basename(path)} {name}"
            seen.add(name)
            check_names(where, r.get("expr", ""), names)
            if "alert" in r:
                if r.get("labels", {}).get("severity") not in ("page", "ticket"):
                    problem(where, "severity is not page or ticket")
                for a in ("summary", "description"):
                    if not r.get("annotations", {}).get(a):
                        problem(where, f"no {a} annotation")
    for a in sorted(REQUIRED_ALERTS - seen):
        problem(os.path.basename(path), f"no alert {a}")


def grafana_to_promql(expr):
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def check_dashboard(path, names):
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    base = os.path.basename(path)
    for k in ("title", "uid", "panels", "templating", "schemaVersion"):
        if k not in d:
            problem(base, f"no {k}")
    variables = {v["name"] for v in d.get("templating", {}).get("list", [])}
    if "datasource" not in variables:
        problem(base, "no datasource variable")
    ids, cells, exprs = set(), {}, []
    for p in d.get("panels", []):
        where = f"{base} panel {p.get('id')} '{p.get('title')}'"
        if p.get("id") in ids:
            problem(where, "duplicate id")
        ids.add(p.get("id"))
        g = p.get("gridPos", {})
        if not all(isinstance(g.get(k), int) for k in ("x", "y", "w", "h")):
            problem(where, "gridPos needs integer x, y, w, h")
            continue
        if g["x"] < 0 or g["w"] < 1 or g["x"] + g["w"] > 24:
            problem(where, "outside the 24-column grid")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                if (x, y) in cells:
                    problem(where, f"overlaps panel {cells[(x, y)]}")
                    break
                cells[(x, y)] = p.get("id")
            else:
                continue
            break
        if p.get("type") == "row":
            continue
        if not p.get("targets"):
            problem(where, "no query")
        for t in p.get("targets", []):
            if t.get("datasource", {}).get("uid") != "${datasource}":
                problem(where, "a query not on the ${datasource} variable")
            e = t.get("expr", "")
            for v in re.findall(r"\$\{?(\w+)\}?", e):
                if v not in variables and not v.startswith("__"):
                    problem(where, f"uses ${v}, which the dashboard does not define")
            check_names(where, e, names)
            exprs.append((where, e))
    # PromQL syntax: promtool parses every query as a recording rule.
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"kvdepot_dashboard_query_{i}", "expr": grafana_to_promql(e)}
        for i, (_, e) in enumerate(exprs)]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(rules, f)
    try:
        r = subprocess.run(["promtool", "check", "rules", f.name], capture_output=True, text=True)
        if r.returncode != 0:
            problem(base, "promtool rejects a query:\n" + r.stdout + r.stderr)
    finally:
        os.unlink(f.name)
    return len(exprs)


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    names = exported(sys.argv[1])
    if "kvdepot_ready" not in names:
        sys.exit(f"check_monitoring: {sys.argv[1]} is not a kvdepotd scrape")
    check_alerts(sys.argv[2], names)
    n = check_dashboard(sys.argv[3], names)
    for p in problems:
        print(p)
    print(f"check_monitoring: {len(names)} series names exported, {n} dashboard queries, "
          f"{len(problems)} problem(s)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
