"""Pages of the adapter list read by another process than the registry's owner: `PageReader` (issue 41).

The registry (service/registry/registry.py) is one process's: the coordinator's, which writes it
beside the training loop. The API's front process (api/front/read_front.py) answers
`GET /v1/adapters` itself from the same SQLite file, so that a list page costs the coordinator
nothing: built there, a cold page waited for the interpreter behind the loop and the Tinker
tenants' calls (measured with 128 Tinker tenants among 1,024 runs: the first burst after a quiet
window built its pages at p50 314 ms, max 1.1 s, where a warm page answered at p99 86 ms).

Invariants:
  P1 read-only: the connection is opened `mode=ro`; this module writes nothing, takes no lock
     file and never migrates (the owner made the schema before the API started);
  P2 one page is one snapshot: its rows, its total and the queue positions are read in one
     transaction (WAL: the owner's commits meanwhile are not seen halfway), as the owner reads them
     under its lock;
  P3 the same page as the owner's: the SQL, the order, the cursor and the refs are the views' own
     (`page_rows`, `page_of`, `_ref`); only the connection differs.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from urllib.parse import quote

from service.registry.records import ConfigCache, _ref
from service.registry.views import ListQuery, Page, page_of, page_rows


class PageReader:
    """`list_page(query, tenant)` over the registry file `db_path`, read-only. Thread-safe (one lock
    around one connection)."""

    def __init__(self, db_path: str | Path) -> None:
        path = Path(db_path).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no registry at {path}: the service creates it before its API starts")
        self._db = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, isolation_level=None,
                                   check_same_thread=False, timeout=10.0)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._configs = ConfigCache()  # parsed configs by registration id: a run's never changes

    def list_page(self, query: ListQuery, tenant: str | None = None) -> Page:
        """The page the registry's `list_page(query, tenant)` answers at this moment (P2, P3)."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                rows, total, positions = page_rows(self._db, query, tenant)
            finally:
                self._db.execute("COMMIT")
        return page_of(rows, total, query, lambda row: _ref(row, positions.get(row["registration_id"]), self._configs))

    def close(self) -> None:
        with self._lock:
            self._db.close()
