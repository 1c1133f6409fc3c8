#!/usr/bin/env python
"""A payment provider simulator: its own HTTP process, its own ledger.

Run it from the repository root with::

    python testproject/provider/server.py --port 8765 --ledger /tmp/provider.sqlite3

or, from ``testproject/``, ``python -m provider --port 8765 --ledger ...``.
Standard library only, so it starts in a fraction of a second and shares
nothing with the Django project but HTTP.

The ledger is an SQLite file of its own: charges survive the simulator's
restarts, and a test (or you, with ``sqlite3``) can inspect it.

API (JSON in, JSON out):

``POST /charges`` ``{"idempotency_id", "amount", "currency", "metadata"?}``
    Creates at most one charge per ``idempotency_id``: the first request
    answers 201 with the new charge, a repeat answers 200 with the existing
    one (its ``attempts`` counts the requests). A repeat whose amount or
    currency differs is refused with 422 ``idempotency_mismatch``, as real
    providers do.
``GET /charges/<idempotency_id>``
    The charge, or 404.
``GET /ledger``
    Every charge, oldest first: ``{"charges": [...], "count": n}``.
``GET /health``
    ``{"ok": true}``.

Failure modes, chosen per request by the header ``X-Simulate: <mode>`` (or a
``"simulate"`` field in the body), with ``X-Simulate-Delay: <seconds>`` (or
``"simulate_delay"``) where a mode waits:

``charge-then-timeout``
    Record the charge, then answer nothing for the delay (default 30 s, more
    than any sane client timeout) and close the connection.
``charge-then-disconnect``
    Record the charge, then close the connection without an answer.
``decline``
    402 ``card_declined``, no charge (a repeat of an already charged
    ``idempotency_id`` still answers the existing charge).
``fail-before-charge``
    500 ``provider_error``, no charge.
``slow``
    Wait the delay (default 3 s), then charge as usual.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sqlite3
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

logger = logging.getLogger("provider")

MODES = ("charge-then-timeout", "charge-then-disconnect", "decline", "fail-before-charge", "slow")
DEFAULT_DELAYS = {"charge-then-timeout": 30.0, "slow": 3.0}
MAX_DELAY = 600.0
MAX_BODY = 64 * 1024
IDEMPOTENCY_ID_MAX_LENGTH = 255

SCHEMA = """
CREATE TABLE IF NOT EXISTS charges (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    idempotency_id TEXT NOT NULL UNIQUE,
    amount INTEGER NOT NULL CHECK (amount > 0),
    currency TEXT NOT NULL,
    status TEXT NOT NULL,
    metadata TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 1,
    created_at TEXT NOT NULL
)
"""


class BadRequest(Exception):
    pass


class Mismatch(Exception):
    pass


class Ledger:
    """The provider's own record of charges: one SQLite file, one writer at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            str(path), isolation_level=None, check_same_thread=False, timeout=30
        )
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @staticmethod
    def _as_dict(row: sqlite3.Row) -> dict[str, Any]:
        charge = {key: row[key] for key in row.keys() if key != "seq"}  # noqa: SIM118
        charge["metadata"] = json.loads(charge["metadata"])
        return charge

    def charge(
        self, idempotency_id: str, amount: int, currency: str, metadata: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """Create the charge for ``idempotency_id``, or return the existing one.

        Returns ``(charge, created)``. The check and the insert run in one
        IMMEDIATE transaction under a lock: there is never a second charge.
        """
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    "SELECT * FROM charges WHERE idempotency_id = ?", [idempotency_id]
                ).fetchone()
                if row is not None:
                    if (row["amount"], row["currency"]) != (amount, currency):
                        raise Mismatch(
                            f"idempotency_id {idempotency_id!r} was used for "
                            f"{row['amount']} {row['currency']}, not {amount} {currency}"
                        )
                    self._db.execute(
                        "UPDATE charges SET attempts = attempts + 1 WHERE seq = ?", [row["seq"]]
                    )
                    created = False
                else:
                    self._db.execute(
                        "INSERT INTO charges (id, idempotency_id, amount, currency, status, "
                        "metadata, attempts, created_at) VALUES (?, ?, ?, ?, ?, ?, 1, ?)",
                        [
                            f"ch_{uuid.uuid4().hex[:24]}",
                            idempotency_id,
                            amount,
                            currency,
                            "succeeded",
                            json.dumps(metadata, sort_keys=True),
                            datetime.now(UTC).isoformat(timespec="microseconds"),
                        ],
                    )
                    created = True
                row = self._db.execute(
                    "SELECT * FROM charges WHERE idempotency_id = ?", [idempotency_id]
                ).fetchone()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return self._as_dict(row), created

    def find(self, idempotency_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM charges WHERE idempotency_id = ?", [idempotency_id]
            ).fetchone()
        return None if row is None else self._as_dict(row)

    def all(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM charges ORDER BY seq").fetchall()
        return [self._as_dict(row) for row in rows]


def parse_charge_request(data: Any) -> tuple[str, int, str, dict[str, Any]]:
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    idempotency_id = data.get("idempotency_id")
    if (
        not isinstance(idempotency_id, str)
        or not idempotency_id
        or len(idempotency_id) > IDEMPOTENCY_ID_MAX_LENGTH
        or "/" in idempotency_id
    ):
        raise BadRequest("idempotency_id: a string of 1 to 255 characters without '/'")
    amount = data.get("amount")
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        raise BadRequest("amount: a positive integer (minor units)")
    currency = data.get("currency")
    if not isinstance(currency, str) or len(currency) != 3 or not currency.isalpha():
        raise BadRequest("currency: a three-letter code")
    metadata = data.get("metadata", {})
    if not isinstance(metadata, dict):
        raise BadRequest("metadata: a JSON object")
    return idempotency_id, amount, currency.upper(), metadata


class ProviderServer(ThreadingHTTPServer):
    daemon_threads = True  # a hanging "charge-then-timeout" never blocks shutdown
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], ledger: Ledger) -> None:
        super().__init__(address, Handler)
        self.ledger = ledger


class Handler(BaseHTTPRequestHandler):
    server: ProviderServer
    server_version = "ProviderSimulator/1.0"
    protocol_version = "HTTP/1.1"

    # -- plumbing -----------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s %s", self.address_string(), format % args)

    def _send(self, status: int, payload: Any) -> None:
        body = json.dumps(payload, sort_keys=True).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(status, {"error": {"code": code, "message": message}})

    def _drop(self) -> None:
        """Close the connection without an answer."""
        self.close_connection = True
        self.wfile.flush()
        self.connection.close()

    def _read_json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise BadRequest("body too large")
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw or b"{}")
        except ValueError as exc:
            raise BadRequest(f"invalid JSON: {exc}") from None

    def _simulation(self, data: Any) -> tuple[str | None, float | None]:
        mode = self.headers.get("X-Simulate")
        delay_text = self.headers.get("X-Simulate-Delay")
        if isinstance(data, dict):
            mode = mode or data.get("simulate")
            if delay_text is None and data.get("simulate_delay") is not None:
                delay_text = str(data["simulate_delay"])
        if mode is not None and mode not in MODES:
            raise BadRequest(f"unknown X-Simulate mode {mode!r}; known: {', '.join(MODES)}")
        delay = None
        if delay_text is not None:
            try:
                delay = float(delay_text)
            except ValueError:
                raise BadRequest(f"X-Simulate-Delay must be a number, not {delay_text!r}") from None
            if not 0 <= delay <= MAX_DELAY:
                raise BadRequest(f"X-Simulate-Delay must be between 0 and {MAX_DELAY:.0f}")
        if mode is not None and delay is None:
            delay = DEFAULT_DELAYS.get(mode, 0.0)
        return mode, delay

    # -- routes -------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send(HTTPStatus.OK, {"ok": True})
        elif path == "/ledger":
            charges = self.server.ledger.all()
            self._send(HTTPStatus.OK, {"charges": charges, "count": len(charges)})
        elif path.startswith("/charges/") and len(path) > len("/charges/"):
            charge = self.server.ledger.find(unquote(path[len("/charges/") :]))
            if charge is None:
                self._error(HTTPStatus.NOT_FOUND, "not_found", "no charge for this idempotency_id")
            else:
                self._send(HTTPStatus.OK, charge)
        else:
            self._error(HTTPStatus.NOT_FOUND, "not_found", f"no route {path}")

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/charges":
            self._error(HTTPStatus.NOT_FOUND, "not_found", f"no route {self.path}")
            return
        try:
            data = self._read_json()
            mode, delay = self._simulation(data)
            idempotency_id, amount, currency, metadata = parse_charge_request(data)
        except BadRequest as exc:
            self._error(HTTPStatus.BAD_REQUEST, "invalid_request", str(exc))
            return
        ledger = self.server.ledger
        tag = f"{idempotency_id[:12]} mode={mode or 'normal'}"

        if mode == "fail-before-charge":
            logger.warning("charge %s: failing before any charge (500)", tag)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "provider_error", "simulated failure")
            return
        if mode == "decline" and ledger.find(idempotency_id) is None:
            logger.warning("charge %s: declined (402), no charge", tag)
            self._error(HTTPStatus.PAYMENT_REQUIRED, "card_declined", "The card was declined.")
            return
        if mode == "slow":
            logger.info("charge %s: sleeping %.1f s before charging", tag, delay)
            time.sleep(delay or 0.0)

        try:
            charge, created = ledger.charge(idempotency_id, amount, currency, metadata)
        except Mismatch as exc:
            self._error(HTTPStatus.UNPROCESSABLE_ENTITY, "idempotency_mismatch", str(exc))
            return
        logger.info(
            "charge %s: %s %s (attempt %d)",
            tag,
            "created" if created else "existing",
            charge["id"],
            charge["attempts"],
        )

        if mode == "charge-then-timeout":
            logger.warning("charge %s: charged, now silent for %.1f s", tag, delay)
            time.sleep(delay or 0.0)
            self._drop()
            return
        if mode == "charge-then-disconnect":
            logger.warning("charge %s: charged, dropping the connection", tag)
            self._drop()
            return
        self._send(HTTPStatus.CREATED if created else HTTPStatus.OK, charge)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="provider", description="Payment provider simulator")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    parser.add_argument(
        "--ledger",
        type=Path,
        default=Path("provider-ledger.sqlite3"),
        help="the SQLite file of charges (created if missing; default: %(default)s)",
    )
    options = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s provider [%(process)d] %(levelname)s %(message)s",
    )
    ledger = Ledger(options.ledger.resolve())
    server = ProviderServer((options.host, options.port), ledger)

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    host, port = str(server.server_address[0]), int(server.server_address[1])
    # One line on stdout, for whoever started us (and picked port 0).
    print(f"provider listening on http://{host}:{port} ledger={ledger.path}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.server_close()
        ledger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
