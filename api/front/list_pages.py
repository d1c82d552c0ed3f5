"""`GET /v1/adapters` answered in the API's front process (issue 41): `LocalPages`.

The front (api/front/read_front.py) used to pass a list page it did not have to the coordinator,
whose interpreter the training loop and the Tinker tenants' calls hold: with 128 Tinker tenants
among 1,024 runs, the first burst of reads after a quiet window waited for those builds (p99 0.93 s
against the 0.5 s bound). Here the front builds the page itself, from the registry's SQLite file
read-only (service/registry/page_reader.py), with the app's own pieces: the caller from `RestAuth`,
the query as `ListQuery`, the body as `page_json` (which the app's route uses too). So the page is
the app's, byte for byte, and costs the coordinator nothing.

Invariants:
  L1 the same answer as the app: a page is answered here only when the app would answer it 200
     (a known credential; every parameter plainly valid: a known state, limits in range, a cursor
     this service gave out, `owner` only from the admin or naming the tenant itself). Anything
     else, a refusal or an odd spelling (repeated parameters, digits with a sign), returns None and
     the request goes to the app, which says what is wrong;
  L2 a tenant sees its own runs only: the tenant is the one `RestAuth` finds for the credential,
     and the registry's own `_visible` rule filters the rows (P3 of page_reader.py);
  L3 a failure here (the file gone, SQLite busy past its timeout) is logged and the app answers:
     the front never turns a page the app could serve into an error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import parse_qsl

from starlette.requests import Request

from api.errors import Unauthorized
from api.models import AdapterList, AdapterOut
from api.public_paths import PublicPaths
from api.rest_auth import RestAuth
from api.tenant_keys import TenantKeys
from service.errors import BadValue
from service.registry.page_reader import PageReader
from service.registry.records import AdapterState
from service.registry.views import DEFAULT_PAGE, MAX_PAGE, ListQuery, Page

log = logging.getLogger(__name__)

MAX_QUERY_LENGTH = 64  # the route's `q` (api/app.py list_adapters)
_STATES = frozenset(s.value for s in AdapterState)
_INTS = {"limit": (1, MAX_PAGE), "offset": (0, 2**62)}  # the route's bounds (offset: SQLite's integer range)


def page_json(page: Page, paths: PublicPaths) -> bytes:
    """The JSON body of one list page, its paths made public: the app's route and the front both send it."""
    listing = AdapterList(adapters=[AdapterOut.from_ref(r) for r in page.refs], total=page.total, next_cursor=page.next_cursor)
    return paths.json_bytes(listing.model_dump_json().encode())


@dataclass(frozen=True)
class PageSource:
    """What the front needs to answer list pages as the app does: the registry file, the API token
    ("" = none), the tenant keys file (or None) and the roots the public paths are cut at. Sent to
    the front on its stdin (the token is no argument that `ps` would show)."""

    db_path: str
    token: str
    keys_file: str | None
    data_roots: list[str]
    state_dir: str

    @classmethod
    def from_settings(cls, settings) -> PageSource:
        token = settings.api_token.get_secret_value().strip() if settings.api_token is not None else ""
        return cls(str(settings.db_path), token, str(settings.tinker_keys_file) if settings.tinker_keys_file else None,
                   [str(p) for p in settings.data_roots], str(settings.state_dir))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PageSource:
        return cls(**json.loads(text))


class LocalPages:
    """List pages built in the front (the module doc). `answer(scope)`: the body, or None for the app."""

    def __init__(self, source: PageSource) -> None:
        keys = TenantKeys.from_file(source.keys_file) if source.keys_file else None
        self.auth = RestAuth(source.token, keys)
        self.paths = PublicPaths([Path(p) for p in source.data_roots], Path(source.state_dir))
        self.reader = PageReader(source.db_path)
        self.built = 0  # pages built here: for tests and benchmarks

    def answer(self, scope: dict) -> bytes | None:
        """Blocking (SQLite and the JSON): the front runs it in a worker thread."""
        try:
            tenant = self.auth.identify(Request(scope)).tenant
        except Unauthorized:
            return None  # L1: the app says 401, with its message
        query = list_query(scope.get("query_string", b""), tenant)
        if query is None:
            return None
        try:
            body = page_json(self.reader.list_page(query, tenant), self.paths)
        except Exception:  # L3
            log.warning("the front could not build a list page; the app answers it", exc_info=True)
            return None
        self.built += 1
        return body

    def close(self) -> None:
        self.reader.close()


def list_query(query_string: bytes, tenant: str | None) -> ListQuery | None:
    """The ListQuery the route would make of this query string for `tenant`, or None where the route
    would refuse it or the spelling is not plainly one the route reads the same way (L1)."""
    try:
        pairs = parse_qsl(query_string.decode("latin-1"), keep_blank_values=True, strict_parsing=False)
    except ValueError:
        return None
    params = dict(pairs)
    if len(params) != len(pairs):
        return None  # a repeated parameter: the app's reading decides
    values: dict = {"limit": DEFAULT_PAGE, "offset": 0}
    for name, (low, high) in _INTS.items():
        if name in params:
            text = params[name]
            if not (text.isascii() and text.isdigit()) or not low <= int(text) <= high:
                return None
            values[name] = int(text)
    if "state" in params:
        if params["state"] not in _STATES:
            return None
        values["state"] = AdapterState(params["state"])
    if "q" in params:
        if len(params["q"]) > MAX_QUERY_LENGTH:
            return None
        values["name_contains"] = params["q"]
    if "owner" in params:
        if tenant is not None and params["owner"] != tenant:
            return None  # the app refuses a tenant's filter on another owner
        values["owner"] = params["owner"]
    if "cursor" in params:
        values["cursor"] = params["cursor"]
    try:
        return ListQuery(**values)
    except BadValue:
        return None
