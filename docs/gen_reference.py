"""Generate the reference pages in docs/reference/ from the code, so they cannot drift.

  docs/reference/job-file.md   from the pydantic models of the job file (service.config.job.JobConfig)
                               and the service settings (service.config.settings.ServiceSettings)
  docs/reference/rest.md       from the FastAPI app's OpenAPI document (api/)

Usage (from the repository root):
  .venv/bin/python docs/gen_reference.py          # rewrite the pages
  .venv/bin/python docs/gen_reference.py --check  # exit 1 and name the stale pages

tests/unit/test_docs_reference.py runs the same rendering and fails on any difference.
Rendering is deterministic: input order of the models, no timestamps.
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
REGENERATE = ".venv/bin/python docs/gen_reference.py"


# ---------------------------------------------------------------- JSON Schema -> Markdown


def _anchor(name: str) -> str:
    return name.lower()


def _code(value: Any) -> str:
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    """One Markdown table cell: no newlines, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def type_of(schema: dict[str, Any]) -> str:
    """A reader's type name for one JSON Schema node; models link to their section."""
    if "$ref" in schema:  # "#/$defs/X" (pydantic) or "#/components/schemas/X" (OpenAPI)
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_anchor(name)})"
    if "anyOf" in schema or "oneOf" in schema:
        return " or ".join(type_of(s) for s in schema.get("anyOf", schema.get("oneOf")))
    if "enum" in schema:
        return " or ".join(_code(v) for v in schema["enum"])
    if "const" in schema:
        return _code(schema["const"])
    kind = schema.get("type")
    if kind == "array":
        return f"list of {type_of(schema.get('items', {}))}"
    if kind == "object":
        extra = schema.get("additionalProperties")
        return f"map of string to {type_of(extra)}" if isinstance(extra, dict) and extra else "mapping"
    if kind == "string" and schema.get("format") == "password":
        return "secret string"
    if kind == "string" and schema.get("format") == "path":
        return "path"
    return {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean", "null": "null"}.get(
        kind, "any"
    )


def constraints(schema: dict[str, Any]) -> list[str]:
    """Value-range rules of a node (and of its non-null alternatives)."""
    out = []
    for s in [schema, *[a for a in schema.get("anyOf", []) if a.get("type") != "null"]]:
        for key, fmt in (
            ("minimum", ">= {}"),
            ("exclusiveMinimum", "> {}"),
            ("maximum", "<= {}"),
            ("exclusiveMaximum", "< {}"),
            ("minLength", "length >= {}"),
            ("maxLength", "length <= {}"),
            ("minItems", "at least {} items"),
            ("pattern", "matches `{}`"),
        ):
            if key in s:
                out.append(fmt.format(s[key]))
    return out


def default_of(name: str, schema: dict[str, Any], required: set[str]) -> str:
    if name in required:
        return "**required**"
    if "default" in schema:
        return _code(schema["default"])
    if "$ref" in schema:
        return "its defaults"
    return {"object": "`{}`", "array": "`[]`"}.get(schema.get("type"), "none")


def model_table(schema: dict[str, Any], key_header: str = "key") -> list[str]:
    required = set(schema.get("required", []))
    rows = [f"| {key_header} | type | default | description |", "|---|---|---|---|"]
    for name, prop in schema.get("properties", {}).items():
        rules = constraints(prop)
        desc = prop.get("description", "")
        if rules:
            desc = f"{desc} ({'; '.join(rules)})" if desc else "; ".join(rules)
        rows.append(f"| `{name}` | {_cell(type_of(prop))} | {_cell(default_of(name, prop, required))} | {_cell(desc)} |")
    return rows


def defs_in_reference_order(schema: dict[str, Any]) -> list[str]:
    """Definitions in the order a reader meets them: breadth first from the top level."""
    defs = schema.get("$defs", {})
    order: list[str] = []

    def refs(node: Any) -> list[str]:
        found: list[str] = []
        if isinstance(node, dict):
            if "$ref" in node:
                found.append(node["$ref"].rsplit("/", 1)[-1])
            for key, value in node.items():
                if key != "$defs":
                    found += refs(value)
        elif isinstance(node, list):
            for value in node:
                found += refs(value)
        return found

    queue = refs(schema)
    while queue:
        name = queue.pop(0)
        if name not in order and name in defs:
            order.append(name)
            queue += refs(defs[name])
    return order + sorted(set(defs) - set(order))


def models_section(schema: dict[str, Any], level: str = "##") -> list[str]:
    lines: list[str] = []
    for name in defs_in_reference_order(schema):
        d = schema["$defs"][name]
        lines += ["", f"{level} {name}", ""]
        if d.get("description"):
            lines += [" ".join(d["description"].split()), ""]
        if d.get("properties"):
            lines += model_table(d)
        elif "enum" in d:
            lines.append(f"One of: {', '.join(_code(v) for v in d['enum'])}.")
        else:
            lines.append(f"Type: {type_of(d)}.")
    return lines


# ---------------------------------------------------------------- pages


HEADER = "<!-- Generated by docs/gen_reference.py from {source}. Do not edit: run `{cmd}`. -->"


def render_job_file() -> str:
    from service.config.job import JobConfig
    from service.config.settings import ServiceSettings

    job = JobConfig.model_json_schema()
    settings = ServiceSettings.model_json_schema()
    env_prefix = ServiceSettings.model_config.get("env_prefix", "")
    lines = [
        HEADER.format(source="service/config/job.py and service/config/settings.py (JobConfig, ServiceSettings)", cmd=REGENERATE),
        "",
        "# Job file reference",
        "",
        "A job file is one YAML document that `lorafleet run JOB.yaml` (batch mode) and",
        "`lorafleet serve` (service mode) validate once at start. Unknown keys are errors that",
        "name the key. Relative paths in a job file are relative to the job file's folder.",
        "Worked examples: `examples/tiny/` (CPU) and `examples/gpu/job.yaml` (GPU recipe).",
        "",
        "## Top level",
        "",
    ]
    if job.get("description"):
        lines += [" ".join(job["description"].split()), ""]
    lines += model_table(job)
    lines += models_section(job)
    lines += [
        "",
        "## Service settings",
        "",
        "The job file's `service:` section holds any of these settings. The environment",
        f"(`{env_prefix}<NAME>`) overrides the section, and explicit command-line values override both.",
        "",
        "| setting | environment variable | type | default | description |",
        "|---|---|---|---|---|",
    ]
    required = set(settings.get("required", []))
    for name, prop in settings.get("properties", {}).items():
        rules = constraints(prop)
        desc = prop.get("description", "") + (f" ({'; '.join(rules)})" if rules else "")
        default = default_of(name, prop, required)
        lines.append(
            f"| `{name}` | `{env_prefix}{name.upper()}` | {_cell(type_of(prop))} | {_cell(default)} | {_cell(desc)} |"
        )
    if settings.get("$defs"):
        lines += models_section(settings, level="###")
    return "\n".join(lines) + "\n"


PROBE_TENANT_KEY = "tml-docs-probe-tenant"


def _docs_app(token: str | None):
    """The real app, as `lorafleet serve` builds it, with one tenant key and without a controller
    behind it (rendering the OpenAPI document and probing auth never reach the controller)."""
    from api.app import create_app
    from api.tenant_keys import TenantKeys
    from service.config.settings import ServiceSettings

    return create_app(None, ServiceSettings(host="127.0.0.1", api_token=token, data_roots=["/"]),
                      tenant_keys=TenantKeys({"docs-probe": PROBE_TENANT_KEY}))


def auth_required(app: Any, method: str, path: str) -> str:
    """Ask the real app: "open" (answers without a credential), "token" (401 without one; a tenant
    key will do) or "admin token" (403 with a tenant key)? (So the page says what the code does,
    not what someone remembered.)"""
    import re

    from fastapi.testclient import TestClient

    url = re.sub(r"\{[^}]+\}", "example", path)
    with TestClient(app, raise_server_exceptions=False) as client:
        if client.request(method, url).status_code != 401:
            return "open"
        as_tenant = client.request(method, url, headers={"Authorization": f"Bearer {PROBE_TENANT_KEY}"})
        return "admin token" if as_tenant.status_code == 403 else "token"


_AUTH_LINE = {"open": "none", "token": "bearer token (the admin token, or a tenant key: that tenant's runs only)",
              "admin token": "the admin bearer token (a tenant key: 403)"}


def render_rest() -> str:
    app = _docs_app("docs-probe-token")
    spec = app.openapi()
    schema = {"$defs": spec.get("components", {}).get("schemas", {})}
    info = spec["info"]
    ops = [(path, method.upper(), op) for path, item in spec["paths"].items() for method, op in item.items()]
    auth = {(path, method): auth_required(app, method, path) for path, method, _ in ops}
    lines = [
        HEADER.format(source="the FastAPI app's OpenAPI document (api/app.py, api/models.py)", cmd=REGENERATE),
        "",
        "# REST API reference",
        "",
        f"{info['title']} {info['version']}: {info.get('summary', '')}",
        "",
        "The control plane listens on `LORAFLEET_HOST:LORAFLEET_PORT` (default `127.0.0.1:8000`).",
        "Bodies are JSON. Routes marked *token* need `Authorization: Bearer <token>` whenever a",
        "token is configured (`LORAFLEET_API_TOKEN`; mandatory when binding beyond loopback): the",
        "admin token, or a tenant's key from the keys file (`tinker_keys_file`; also as `X-API-Key`),",
        "which sees and manages only that tenant's runs (another tenant's is 404). Routes marked",
        "*admin token* are the operator's: a tenant key gets 403. See docs/concepts.md, Tenants.",
        "Every error body is an [ErrorOut](#errorout): what was wrong and what is allowed; a",
        "refused request changes nothing. The live OpenAPI document is served at `/openapi.json`",
        "and browsable at `/docs`.",
        "",
        "## Endpoints",
        "",
        "| method | path | summary | auth |",
        "|---|---|---|---|",
    ]
    for path, method, op in ops:
        link = _anchor(f"{method} {path}".replace("/", "").replace("{", "").replace("}", "").replace(" ", "-"))
        lines.append(
            f"| {method} | [`{path}`](#{link}) | {_cell(op.get('summary', ''))} | {auth[(path, method)]} |"
        )
    for path, method, op in ops:
        lines += ["", f"### {method} {path}", ""]
        if op.get("summary"):
            lines += [f"{op['summary']}.", ""]
        if op.get("description"):
            lines += [" ".join(op["description"].split()), ""]
        lines += [f"Auth: {_AUTH_LINE[auth[(path, method)]]}.", ""]
        params = op.get("parameters", [])
        if params:
            lines += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
            for p in params:
                desc = p.get("description", p.get("schema", {}).get("description", ""))
                lines.append(
                    f"| `{p['name']}` | {p['in']} | {_cell(type_of(p.get('schema', {})))} | "
                    f"{'yes' if p.get('required') else 'no'} | {_cell(desc)} |"
                )
            lines.append("")
        body = op.get("requestBody")
        if body:
            media = body.get("content", {})
            for kind, content in media.items():
                lines += [f"Request body ({kind}): {type_of(content.get('schema', {}))}.", ""]
        lines += ["| status | meaning | body |", "|---|---|---|"]
        for status, resp in sorted(op.get("responses", {}).items()):
            content = resp.get("content", {})
            body_type = ", ".join(
                f"{type_of(c.get('schema', {}))} ({kind})" if kind != "application/json" else type_of(c.get("schema", {}))
                for kind, c in content.items()
            )
            lines.append(f"| {status} | {_cell(resp.get('description', ''))} | {_cell(body_type) or 'none'} |")
    lines += ["", "## Schemas"]
    lines += models_section(schema, level="###")
    return "\n".join(lines) + "\n"


# Page -> renderer.
PAGES: dict[str, Callable[[], str]] = {
    "reference/job-file.md": render_job_file,
    "reference/rest.md": render_rest,
}


def render_all() -> dict[Path, str]:
    return {DOCS / page: render() for page, render in PAGES.items()}


def stale_pages(rendered: dict[Path, str]) -> dict[Path, str]:
    """Pages whose file differs from the rendering -> a short unified diff."""
    stale = {}
    for path, text in rendered.items():
        current = path.read_text() if path.exists() else ""
        if current != text:
            diff = difflib.unified_diff(
                current.splitlines(), text.splitlines(), f"{path.name} (on disk)", f"{path.name} (from code)", lineterm="", n=1
            )
            stale[path] = "\n".join(list(diff)[:40])
    return stale


def main(argv: list[str]) -> int:
    check = "--check" in argv
    rendered = render_all()
    if check:
        stale = stale_pages(rendered)
        for path, diff in stale.items():
            print(f"stale: {path.relative_to(DOCS.parent)}\n{diff}\n", file=sys.stderr)
        if stale:
            print(f"regenerate with: {REGENERATE}", file=sys.stderr)
        return 1 if stale else 0
    for path, text in rendered.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(DOCS.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
