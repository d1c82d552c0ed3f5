"""Tinker sampling's durable records (a mixin of `Registry`, in its SQLite file): the sampling sessions
and the stability records of sampled sequences (stable_reinforce, docs/tinker.md).

  tinker_sampling_sessions  a sampling session's tenant and what it samples (the sampler checkpoint's
                            tinker:// path and its folder, or none: the base model), so a session
                            outlives a restart of the service (its adapter is loaded again on demand)
  tinker_sample_requests    one sample request made with ``record_stability_info``: its tenant, its
                            session, the sampler that drew it (the checkpoint path, or ``base``) and
                            its prompt (int32 tokens)
  tinker_sampled_sequences  each sequence of such a request, under its ``sequence_id``
                            (``<request id>-<i>``, the acknowledgement's ``sample_sequence_ids``): the
                            sampled tokens (int32) and the engine's log-probability of each (float32)

Invariants:
  S1 every read takes the caller's tenant: another tenant's session or sequence reads as absent;
  S2 lifetime (RECORD_TTL_S, one day): a record lives one day after its last use (sampling it, or a
     training call that names it), each use restarting the day; past that it reads as absent and
     `sweep_sampling_records` deletes it (a request goes with its last sequence);
  S3 a sequence's record is written whole (prompt, tokens, log-probs) in one transaction, before the
     sample's result is answered: a client never holds a sequence_id whose record is missing.

Times are wall-clock seconds (time.time()): they outlive the process. Every method runs in one of the
registry's transactions (`_tx`) or under its lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

RECORD_TTL_S = 86400.0  # S2: one day after the last use

_SAMPLING_SCHEMA = """
CREATE TABLE IF NOT EXISTS tinker_sampling_sessions (
    session_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    model_path TEXT,                -- tinker://<model>/sampler_weights/<name>; NULL: the base model
    folder TEXT,                    -- the checkpoint's folder on this service
    created_at REAL NOT NULL,
    used_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS tinker_sampling_sessions_used ON tinker_sampling_sessions(used_at);
CREATE TABLE IF NOT EXISTS tinker_sample_requests (
    request_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    sampler TEXT NOT NULL,          -- the checkpoint path that sampled, or 'base'
    prompt BLOB NOT NULL,           -- int32 tokens
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tinker_sampled_sequences (
    sequence_id TEXT PRIMARY KEY,
    request_id TEXT NOT NULL REFERENCES tinker_sample_requests(request_id) ON DELETE CASCADE,
    tokens BLOB NOT NULL,           -- int32
    logprobs BLOB NOT NULL,         -- float32, one per token
    used_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS tinker_sampled_sequences_used ON tinker_sampled_sequences(used_at);
CREATE INDEX IF NOT EXISTS tinker_sampled_sequences_request ON tinker_sampled_sequences(request_id);
"""


@dataclass(frozen=True)
class SamplingSessionRecord:
    session_id: str
    tenant: str
    model_path: str | None
    folder: str | None


@dataclass(frozen=True)
class SampledSequenceRecord:
    """What the server recorded when it sampled one sequence."""

    sequence_id: str
    session_id: str
    sampler: str  # the sampler checkpoint's tinker:// path, or 'base'
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


class SamplingRecords:
    """The sampling records' methods (mixed into Registry, which provides _db, _lock and _tx)."""

    def _create_sampling_tables(self) -> None:
        self._db.executescript(_SAMPLING_SCHEMA)

    # -- sampling sessions --------------------------------------------------------------------------------

    def record_sampling_session(self, session_id: str, tenant: str, model_path: str | None, folder: str | None,
                                now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._tx():
            self._db.execute("INSERT INTO tinker_sampling_sessions VALUES (?, ?, ?, ?, ?, ?)",
                             (session_id, tenant, model_path, folder, now, now))

    def sampling_session(self, tenant: str, session_id: str, now: float | None = None) -> SamplingSessionRecord | None:
        """The tenant's live session (S1, S2), its day restarted; None otherwise."""
        now = time.time() if now is None else now
        with self._tx():
            row = self._db.execute("SELECT * FROM tinker_sampling_sessions WHERE session_id = ? AND tenant = ? AND used_at >= ?",
                                   (session_id, tenant, now - RECORD_TTL_S)).fetchone()
            if row is None:
                return None
            self._db.execute("UPDATE tinker_sampling_sessions SET used_at = ? WHERE session_id = ?", (now, session_id))
        return SamplingSessionRecord(row["session_id"], row["tenant"], row["model_path"], row["folder"])

    # -- stability records ----------------------------------------------------------------------------------

    def record_samples(self, request_id: str, tenant: str, session_id: str, sampler: str, prompt: list[int],
                       sequences: list[tuple[list[int], list[float]]], now: float | None = None) -> list[str]:
        """S3: the request's sequences under ``<request_id>-<i>``; returns those ids."""
        now = time.time() if now is None else now
        ids = [f"{request_id}-{i}" for i in range(len(sequences))]
        for i, (tokens, logprobs) in enumerate(sequences):
            if len(tokens) != len(logprobs):
                raise ValueError(f"sequence {i}: {len(tokens)} tokens but {len(logprobs)} log-probabilities")
        with self._tx():
            self._db.execute("INSERT INTO tinker_sample_requests VALUES (?, ?, ?, ?, ?, ?)",
                             (request_id, tenant, session_id, sampler, np.asarray(prompt, dtype=np.int32).tobytes(), now))
            self._db.executemany("INSERT INTO tinker_sampled_sequences VALUES (?, ?, ?, ?, ?)", [
                (sid, request_id, np.asarray(tokens, dtype=np.int32).tobytes(), np.asarray(logprobs, dtype=np.float32).tobytes(), now)
                for sid, (tokens, logprobs) in zip(ids, sequences)])
        return ids

    def sampled_sequences(self, tenant: str, sequence_ids: list[str], now: float | None = None,
                          touch: bool = True) -> dict[str, SampledSequenceRecord]:
        """The tenant's live records among ``sequence_ids`` (S1, S2); ``touch``: each one found is used
        (its day restarts). A caller that may still refuse the call reads with touch=False first."""
        now = time.time() if now is None else now
        wanted = sorted(set(sequence_ids))
        found: dict[str, SampledSequenceRecord] = {}
        with self._tx():
            for i in range(0, len(wanted), 500):  # SQLite's bound on host parameters
                part = wanted[i:i + 500]
                rows = self._db.execute(
                    "SELECT s.sequence_id, s.tokens, s.logprobs, r.session_id, r.sampler, r.prompt "
                    "FROM tinker_sampled_sequences s JOIN tinker_sample_requests r ON r.request_id = s.request_id "
                    f"WHERE s.sequence_id IN ({','.join('?' * len(part))}) AND r.tenant = ? AND s.used_at >= ?",
                    (*part, tenant, now - RECORD_TTL_S)).fetchall()
                for row in rows:
                    found[row["sequence_id"]] = SampledSequenceRecord(
                        row["sequence_id"], row["session_id"], row["sampler"],
                        tuple(np.frombuffer(row["prompt"], dtype=np.int32).tolist()),
                        tuple(np.frombuffer(row["tokens"], dtype=np.int32).tolist()),
                        tuple(np.frombuffer(row["logprobs"], dtype=np.float32).tolist()))
            if found and touch:
                self._db.executemany("UPDATE tinker_sampled_sequences SET used_at = ? WHERE sequence_id = ?",
                                     [(now, sid) for sid in found])
        return found

    def sweep_sampling_records(self, now: float | None = None) -> int:
        """S2: delete what expired; returns the sequences deleted."""
        cutoff = (time.time() if now is None else now) - RECORD_TTL_S
        with self._tx():
            gone = self._db.execute("DELETE FROM tinker_sampled_sequences WHERE used_at < ?", (cutoff,)).rowcount
            self._db.execute("DELETE FROM tinker_sample_requests WHERE NOT EXISTS "
                             "(SELECT 1 FROM tinker_sampled_sequences s WHERE s.request_id = tinker_sample_requests.request_id)")
            self._db.execute("DELETE FROM tinker_sampling_sessions WHERE used_at < ?", (cutoff,))
        return gone
