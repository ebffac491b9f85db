"""Dependency audit of what the service runs on: the installed closure of the `cpu` and `serve`
extras plus the core dependencies (what the Docker image installs), checked with pip-audit.

    python -m tools.audit [--json artifacts/reliability/audit.json]

pip-audit asks PyPI's per-version JSON API for known vulnerabilities. Where that answer is not
available (a package index mirror that serves only the project pages), the package is reported
as "not audited" with pip-audit's reason, and this command additionally checks the project page:
a pinned version that is the newest release with no vulnerability listed there counts as clean;
anything else is listed for a person to look at. Exit 0 only when every package is clean.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOTS = ["numpy", "soundfile", "tqdm", "onnxruntime", "fastapi", "uvicorn", "python-multipart",
         "prometheus-client", "websockets"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots=ROOTS) -> dict[str, str]:
    """name -> installed version of `roots` and everything they require (markers evaluated here)."""
    from packaging.requirements import Requirement

    seen: dict[str, str] = {}
    todo = [(r, frozenset()) for r in roots]
    while todo:
        name, extras = todo.pop()
        key = norm(name)
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return dict(sorted(seen.items()))


def pip_audit(packages: dict[str, str]) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("".join(f"{k}=={v}\n" for k, v in packages.items()))
        reqs = f.name
    r = subprocess.run([sys.executable, "-m", "pip_audit", "-r", reqs, "--no-deps", "--disable-pip", "--format", "json",
                        "--progress-spinner", "off"], capture_output=True, text=True, timeout=600)
    Path(reqs).unlink()
    try:
        return json.loads(r.stdout)
    except ValueError:
        raise SystemExit(f"pip-audit failed ({r.returncode}): {r.stderr[-2000:]}") from None


def project_page(name: str) -> dict | None:
    import httpx

    try:
        r = httpx.get(f"https://pypi.org/pypi/{name}/json", timeout=20)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.audit", description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    packages = closure()
    report = pip_audit(packages)
    rows = []
    for dep in report.get("dependencies", []):
        name, version = dep["name"], dep.get("version") or packages.get(norm(dep["name"]), "?")
        vulns = dep.get("vulns", [])
        if vulns:
            status = "VULNERABLE: " + ", ".join(f"{v['id']} (fixed in {', '.join(v.get('fix_versions', [])) or '-'})"
                                                for v in vulns)
        elif "skip_reason" in dep:
            page = project_page(name)
            if page is None:
                status = f"not audited: {dep['skip_reason']}"
            else:
                latest, listed = page["info"]["version"], page.get("vulnerabilities", [])
                if listed:
                    status = "CHECK: the project lists " + ", ".join(v["id"] for v in listed)
                elif latest == version:
                    status = "clean (newest release, no known vulnerability listed)"
                else:
                    status = f"CHECK: not the newest release ({latest}); per-version data unavailable"
        else:
            status = "clean (no known vulnerability)"
        rows.append({"name": name, "version": version, "status": status})
    for r in rows:
        print(f"{r['name']:24} {r['version']:14} {r['status']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if not r["status"].startswith("clean")]
    print(f"{len(rows)} packages, {len(rows) - len(bad)} clean, {len(bad)} to look at")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
