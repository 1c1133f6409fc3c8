#!/usr/bin/env python
"""A scripted tour of django-idempotency over real HTTP.

Run from the repository root::

    .venv/bin/python testproject/demo.py

It recreates a throw-away SQLite database (``testproject/demo.sqlite3``,
never your ``DATABASE_URL``), migrates it, seeds the demo users, starts the
payment provider simulator (its own process and ledger,
``testproject/demo-provider.sqlite3``) and the test project under gunicorn
(3 processes x 4 threads) on free ports, and plays a client against them: a
double click, a lost response, a reused key, two tenants, the domain guard,
refunds, a provider that charged but never answered (settled by recovery),
a declined card and a refund through the Django Ninja API. Every
expectation is checked; the exit status is 0 when all of them hold, 1 when
one fails, 2 when the servers could not be set up. The servers are always
stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent  # testproject/
REPO = HERE.parent
VENV_PYTHON = REPO / ".venv" / "bin" / "python"


def _reexec_in_venv_if_needed() -> None:
    """``python testproject/demo.py`` with a Python lacking the packages: use the venv's."""
    try:
        import django  # noqa: F401
        import gunicorn  # noqa: F401
        import requests  # noqa: F401
    except ImportError:
        # The venv's python is usually a symlink to this very binary, so a
        # flag (not a path comparison) prevents a loop.
        if VENV_PYTHON.exists() and not os.environ.get("DEMO_REEXECUTED"):
            os.environ["DEMO_REEXECUTED"] = "1"
            os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), __file__, *sys.argv[1:]])
        raise


_reexec_in_venv_if_needed()

import requests  # noqa: E402

sys.path.insert(0, str(HERE))
from payments.demo_data import DEMO_TOKENS  # noqa: E402

CONCURRENT_CLICKS = 10
REQUEST_TIMEOUT = 30
STARTUP_TIMEOUT = 30
#: How long the API waits for the provider (PAYMENTS_PROVIDER_TIMEOUT).
PROVIDER_TIMEOUT = 2
SHOWN_HEADERS = ("Idempotency-Key", "Idempotent-Replayed", "Location", "Retry-After")


class ExpectationFailed(Exception):
    """The server did not behave as the contract says."""


class SetupFailed(Exception):
    """The demo server could not be prepared or started."""


# -- transcript -----------------------------------------------------------------


def say(text: str = "") -> None:
    print(text, flush=True)


def heading(title: str) -> None:
    say()
    say(f"=== {title} " + "=" * max(0, 72 - len(title)))


def compact(data: Any) -> str:
    return json.dumps(data, separators=(", ", ": "))


def short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def show_request(user: str, method: str, path: str, key: str | None, body: Any) -> None:
    key_text = f"Idempotency-Key: {key}" if key is not None else "(no Idempotency-Key)"
    say(f"-> {method} {path}  as {user}  {key_text}")
    if body is not None:
        say(f"   {compact(body)}")


def response_headers(response: requests.Response) -> str:
    return "  ".join(
        f"{name}: {response.headers[name]}" for name in SHOWN_HEADERS if name in response.headers
    )


def show_response(response: requests.Response) -> None:
    say(f"<- {response.status_code} {response.reason}  {response_headers(response)}".rstrip())
    if response.content:
        say(f"   {short(response.text)}")


class Checks:
    def __init__(self) -> None:
        self.passed: list[str] = []

    def __call__(self, condition: bool, message: str, detail: str = "") -> None:
        if not condition:
            raise ExpectationFailed(f"{message}{': ' + detail if detail else ''}")
        self.passed.append(message)
        say(f"   [ok] {message}")


check = Checks()


# -- the client -----------------------------------------------------------------


class Client:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def request(
        self,
        user: str,
        method: str,
        path: str,
        *,
        key: str | None = None,
        body: Any = None,
        show: bool = True,
        extra_headers: Mapping[str, str] | None = None,
    ) -> requests.Response:
        headers = {"Authorization": f"Token {DEMO_TOKENS[user]}", "Accept": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        headers.update(extra_headers or {})
        if show:
            show_request(user, method, path, key, body)
            for name, value in (extra_headers or {}).items():
                say(f"   {name}: {value}")
        try:
            # A new connection per request, like separate clicks or retries.
            response = requests.request(
                method,
                self.base_url + path,
                json=body,
                headers=headers,
                timeout=REQUEST_TIMEOUT,
            )
        except requests.RequestException as exc:
            raise ExpectationFailed(f"{method} {path} got no answer: {exc}") from exc
        if show:
            show_response(response)
        return response

    def payments_for_order(self, user: str, order_id: str) -> list[dict[str, Any]]:
        response = self.request(user, "GET", f"/v1/payments?order_id={order_id}")
        check(
            response.status_code == 200,
            f"{user} can list the payments of {order_id}",
            f"status {response.status_code}",
        )
        payments: list[dict[str, Any]] = response.json()
        return payments


def new_key(label: str) -> str:
    """A client makes one key per logical operation and reuses it only for retries."""
    return f"{label}-{uuid.uuid4().hex[:12]}"


def is_replay(response: requests.Response) -> bool:
    return response.headers.get("Idempotent-Replayed") == "true"


def check_refusal(response: requests.Response, status: int, code: str, why: str = "") -> None:
    """Check that ``response`` is ``status`` with the error ``code`` (``why``: what it means)."""
    check(
        response.status_code == status and code_of(response) == code,
        f"{status} {code}{why}",
        f"{response.status_code} {response.text}",
    )


def code_of(response: requests.Response) -> str | None:
    try:
        data = response.json()
    except ValueError:
        return None
    return data.get("code") if isinstance(data, dict) else None


# -- scenarios --------------------------------------------------------------------


def double_click(client: Client) -> dict[str, Any]:
    heading(f"a. Double click: {CONCURRENT_CLICKS} identical POSTs at once, one key")
    key = new_key("double-click")
    body = {"order_id": "ORD-1001", "amount": 4200, "currency": "EUR"}
    show_request("alice", "POST", "/v1/payments", key, body)
    say(
        f"   ... sent {CONCURRENT_CLICKS} times by {CONCURRENT_CLICKS} threads released "
        "together by a barrier"
    )
    barrier = threading.Barrier(CONCURRENT_CLICKS)
    answers: list[requests.Response | BaseException | None] = [None] * CONCURRENT_CLICKS

    def click(index: int) -> None:
        try:
            barrier.wait(timeout=REQUEST_TIMEOUT)
            answers[index] = client.request(
                "alice", "POST", "/v1/payments", key=key, body=body, show=False
            )
        except BaseException as exc:  # reported below, in the main thread
            answers[index] = exc

    threads = [
        threading.Thread(target=click, args=(i,), daemon=True) for i in range(CONCURRENT_CLICKS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    responses: list[requests.Response] = []
    for index, answer in enumerate(answers, 1):
        if not isinstance(answer, requests.Response):
            raise ExpectationFailed(f"click #{index} failed: {answer!r}")
        responses.append(answer)
        kind = (
            "replayed" if is_replay(answer) else "ran" if answer.status_code == 201 else "refused"
        )
        extra = code_of(answer) if answer.status_code != 201 else f"payment {answer.json()['id']}"
        say(f"<- #{index:02d} {answer.status_code} {kind:8s} {extra}  {response_headers(answer)}")

    if not any(response.status_code == 409 for response in responses):
        say("   (On SQLite the other clicks queue for the database's write lock, so they")
        say("   usually see the finished record and get its replay; on PostgreSQL some")
        say("   answer 409 idempotency_request_in_progress instead. Both are safe.)")
    fresh = [r for r in responses if r.status_code == 201 and not is_replay(r)]
    check(
        len(fresh) == 1,
        "exactly one click ran the view (one fresh 201)",
        f"{len(fresh)} fresh 201s",
    )
    original = fresh[0]
    for index, response in enumerate(responses, 1):
        if response is original:
            continue
        if response.status_code == 409:
            check(
                code_of(response) == "idempotency_request_in_progress"
                and "Retry-After" in response.headers,
                f"click #{index}: 409 idempotency_request_in_progress with Retry-After",
                response.text,
            )
        else:
            check(
                response.status_code == 201
                and is_replay(response)
                and response.content == original.content,
                f"click #{index}: a replay of the same 201 body",
                f"{response.status_code} {response.headers} {response.text}",
            )

    say()
    say("The user clicks once more, after everything settled:")
    retry = client.request("alice", "POST", "/v1/payments", key=key, body=body)
    check(
        retry.status_code == 201 and is_replay(retry),
        "the retry is a replayed 201 (Idempotent-Replayed: true)",
        f"{retry.status_code} {retry.headers}",
    )
    check(retry.content == original.content, "the replay carries the original body bytes")
    check(
        retry.headers.get("Location") == original.headers.get("Location"),
        "the replay carries the original Location",
    )
    payments = client.payments_for_order("alice", "ORD-1001")
    check(
        len(payments) == 1, "exactly one payment exists for ORD-1001", f"{len(payments)} payments"
    )
    created: dict[str, Any] = original.json()
    return created


def lost_response(client: Client) -> tuple[str, dict[str, Any]]:
    heading("b. Lost response: the payment went through, the answer did not")
    key = new_key("lost-response")
    body = {"order_id": "ORD-1002", "amount": 2500, "currency": "EUR"}
    show_request("alice", "POST", "/v1/payments", key, body)
    lost = client.request("alice", "POST", "/v1/payments", key=key, body=body, show=False)
    say("<- ... (the connection drops: the client never sees this answer)")
    say()
    say("The client cannot know whether it was charged, so it retries with the same key:")
    retry = client.request("alice", "POST", "/v1/payments", key=key, body=body)
    check(
        lost.status_code == 201 and not is_replay(lost),
        "the lost request created the payment",
        f"{lost.status_code} {lost.text}",
    )
    check(
        retry.status_code == 201 and is_replay(retry),
        "the retry gets the stored 201 with Idempotent-Replayed: true",
        f"{retry.status_code} {retry.headers}",
    )
    check(
        retry.content == lost.content,
        "the body bytes are identical to the lost answer's",
        f"{retry.content!r} != {lost.content!r}",
    )
    payments = client.payments_for_order("alice", "ORD-1002")
    check(len(payments) == 1, "still exactly one payment for ORD-1002", f"{len(payments)} payments")
    payment: dict[str, Any] = lost.json()
    return key, payment


def reused_key(client: Client, key: str, payment: dict[str, Any]) -> None:
    heading("c. The same key with a different amount")
    body = {"order_id": "ORD-1002", "amount": 9900, "currency": "EUR"}
    response = client.request("alice", "POST", "/v1/payments", key=key, body=body)
    check_refusal(
        response, 422, "idempotency_key_reused", ": a changed request is refused, never replayed"
    )
    check(not is_replay(response), "the refusal is not a replay")
    detail = client.request("alice", "GET", f"/v1/payments/{payment['id']}")
    check(
        detail.status_code == 200 and detail.json()["amount"] == payment["amount"],
        f"payment {payment['id']} still has its original amount {payment['amount']}",
        detail.text,
    )


def two_tenants(client: Client) -> None:
    heading("d. Two tenants, the same key and the same body")
    key = new_key("shared-key")
    body = {"order_id": "ORD-2001", "amount": 1500, "currency": "USD"}
    alice = client.request("alice", "POST", "/v1/payments", key=key, body=body)
    bob = client.request("bob", "POST", "/v1/payments", key=key, body=body)
    check(
        alice.status_code == 201 and not is_replay(alice),
        "alice's payment is created",
        f"{alice.status_code} {alice.text}",
    )
    check(
        bob.status_code == 201 and not is_replay(bob),
        "bob's request runs too: alice's key does not replay for bob",
        f"{bob.status_code} {bob.headers} {bob.text}",
    )
    alice_id, bob_id = alice.json()["id"], bob.json()["id"]
    check(alice_id != bob_id, f"two different payments ({alice_id} and {bob_id})")
    peek = client.request("alice", "GET", f"/v1/payments/{bob_id}")
    check(peek.status_code == 404, "alice cannot see bob's payment (404)", str(peek.status_code))


def domain_guard(client: Client) -> None:
    heading("e. A new key for an order that is already paid")
    say("A buggy client makes up a fresh key for the same order: the database's")
    say("unique constraint on (owner, order_id) is the second line of defence.")
    key = new_key("fresh-key")
    body = {"order_id": "ORD-1001", "amount": 4200, "currency": "EUR"}
    response = client.request("alice", "POST", "/v1/payments", key=key, body=body)
    check_refusal(response, 409, "order_already_paid")
    payments = client.payments_for_order("alice", "ORD-1001")
    check(len(payments) == 1, "still exactly one payment for ORD-1001", f"{len(payments)} payments")


def refunds(client: Client, payment: dict[str, Any]) -> None:
    path = f"/v1/payments/{payment['id']}/refunds"
    heading(f"f. Refunds of payment {payment['id']} ({payment['amount']} {payment['currency']})")
    key = new_key("refund")
    first = client.request("alice", "POST", path, key=key, body={"amount": 1000})
    check(
        first.status_code == 201 and not is_replay(first),
        "the refund is created",
        f"{first.status_code} {first.text}",
    )
    again = client.request("alice", "POST", path, key=key, body={"amount": 1000})
    check(
        again.status_code == 201 and is_replay(again) and again.content == first.content,
        "its retry is a replay: no second refund",
        f"{again.status_code} {again.text}",
    )
    say()
    too_much = {"amount": 2000}
    key = new_key("refund")
    refused = client.request("alice", "POST", path, key=key, body=too_much)
    check(
        refused.status_code == 400 and not is_replay(refused),
        "a refund beyond the payment is refused with 400",
        f"{refused.status_code}",
    )
    replayed = client.request("alice", "POST", path, key=key, body=too_much)
    check(
        replayed.status_code == 400 and is_replay(replayed) and replayed.content == refused.content,
        "a definitive 4xx is stored (FAILED) and replayed",
        f"{replayed.status_code}",
    )
    detail = client.request("alice", "GET", f"/v1/payments/{payment['id']}")
    check(
        detail.json().get("status") == "partially_refunded",
        "the payment is partially refunded, once",
        detail.text,
    )


def ninja_refund(client: Client, payment: dict[str, Any]) -> None:
    path = f"/ninja/v1/payments/{payment['id']}/refunds"
    heading(f"j. A refund of payment {payment['id']} through the Django Ninja API")
    key = new_key("ninja-refund")
    first = client.request("alice", "POST", path, key=key, body={"amount": 500})
    check(
        first.status_code == 201 and not is_replay(first),
        "the Ninja operation refunds",
        f"{first.status_code} {first.text}",
    )
    again = client.request("alice", "POST", path, key=key, body={"amount": 500})
    check(
        again.status_code == 201 and is_replay(again) and again.content == first.content,
        "its retry is a replay, the same bytes: no second refund",
        f"{again.status_code} {again.text}",
    )
    other = client.request("alice", "POST", path, key=key, body={"amount": 600})
    check_refusal(other, 422, "idempotency_key_reused", ", in Ninja's error shape")


def provider_charges(provider_url: str, order_id: str) -> list[dict[str, Any]]:
    """The provider's charges for one of alice's orders, from its own ledger."""
    try:
        response = requests.get(f"{provider_url}/ledger", timeout=REQUEST_TIMEOUT)
        response.raise_for_status()
    except requests.RequestException as exc:
        raise ExpectationFailed(f"the provider's ledger could not be read: {exc}") from exc
    return [
        charge
        for charge in response.json()["charges"]
        if charge["metadata"].get("order_id") == order_id
    ]


def provider_timeout(client: Client, provider_url: str, env: Mapping[str, str]) -> None:
    heading("h. The provider charged the card, but its answer never came")
    say("The provider is told to charge, then go silent (X-Simulate, passed through by the")
    say(f"demo's settings); the API gives up after its {PROVIDER_TIMEOUT} s timeout. Did the")
    say("card get charged? The API cannot know, so it must not guess.")
    key = new_key("provider-timeout")
    body = {"order_id": "ORD-4001", "amount": 1999, "currency": "EUR"}
    first = client.request(
        "alice",
        "POST",
        "/v1/payments",
        key=key,
        body=body,
        extra_headers={"X-Simulate": "charge-then-timeout", "X-Simulate-Delay": "5"},
    )
    check_refusal(first, 502, "payment_provider_unavailable", ": the outcome is unknown")
    charges = provider_charges(provider_url, "ORD-4001")
    check(len(charges) == 1, "the provider's ledger shows the charge", f"{charges}")
    check(
        not client.payments_for_order("alice", "ORD-4001"),
        "the API has no payment for ORD-4001 yet",
    )
    say()
    say("The client retries with the same key, at once:")
    busy = client.request("alice", "POST", "/v1/payments", key=key, body=body)
    check_refusal(
        busy,
        503,
        "idempotency_outcome_uncertain",
        ": the record is UNCERTAIN, nothing runs twice; Retry-After says when recovery looks",
    )
    say()
    say("Recovery runs (Celery beat does every minute; cron users run the command):")
    say("$ manage.py idempotency_recover")
    report = manage(env, "idempotency_recover")
    say(f"   {report.strip()}")
    check(
        "completed 1" in report,
        "the reconciler found the charge by the provider key and completed the payment",
        report,
    )
    say()
    say("The client's next retry gets the settled outcome:")
    settled = client.request("alice", "POST", "/v1/payments", key=key, body=body)
    check(
        settled.status_code == 201 and is_replay(settled),
        "a replayed 201 with the payment the reconciler recorded",
        f"{settled.status_code} {settled.headers} {settled.text}",
    )
    payments = client.payments_for_order("alice", "ORD-4001")
    check(
        len(payments) == 1 and payments[0]["id"] == settled.json()["id"],
        "exactly one payment for ORD-4001, the one in the answer",
        f"{payments}",
    )
    check(
        settled.headers.get("Location") == f"/v1/payments/{payments[0]['id']}",
        "the answer's Location names it",
    )
    charges = provider_charges(provider_url, "ORD-4001")
    check(len(charges) == 1, "and still exactly one charge at the provider", f"{charges}")


def declined_card(client: Client, provider_url: str) -> None:
    heading("i. A declined card")
    key = new_key("declined")
    body = {"order_id": "ORD-4002", "amount": 500, "currency": "EUR"}
    first = client.request(
        "alice",
        "POST",
        "/v1/payments",
        key=key,
        body=body,
        extra_headers={"X-Simulate": "decline"},
    )
    check_refusal(first, 402, "card_declined")
    say("The retry (the card would go through now) gets the same decline: it is this")
    say("key's definitive outcome, stored as FAILED. A new attempt needs a new key.")
    retry = client.request("alice", "POST", "/v1/payments", key=key, body=body)
    check(
        retry.status_code == 402 and is_replay(retry) and retry.content == first.content,
        "a replayed 402, the same bytes",
        f"{retry.status_code} {retry.text}",
    )
    check(not provider_charges(provider_url, "ORD-4002"), "no charge at the provider")
    check(not client.payments_for_order("alice", "ORD-4002"), "no payment for ORD-4002")


def missing_key(client: Client) -> None:
    heading("g. No Idempotency-Key at all")
    body = {"order_id": "ORD-3001", "amount": 100, "currency": "EUR"}
    response = client.request("alice", "POST", "/v1/payments", body=body)
    check_refusal(response, 400, "idempotency_key_missing")


# -- the server -----------------------------------------------------------------


def _gunicorn_version() -> tuple[int, ...]:
    import gunicorn as gunicorn_package

    return tuple(gunicorn_package.version_info)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def server_env(database: Path, provider_url: str) -> dict[str, str]:
    env = dict(os.environ)
    # Only the child processes see these: never the user's DATABASE_URL.
    env["DATABASE_URL"] = f"sqlite:///{database}"
    env["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    env["PYTHONUNBUFFERED"] = "1"
    env["PAYMENTS_PROVIDER_URL"] = provider_url
    env["PAYMENTS_PROVIDER_TIMEOUT"] = str(PROVIDER_TIMEOUT)
    env["PAYMENTS_PROVIDER_SIMULATION"] = "1"  # X-Simulate reaches the simulator
    env.pop("PAYMENTS_CRASH_HOOKS", None)
    return env


def reset_database(database: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)


def manage(env: Mapping[str, str], *args: str) -> str:
    command = [sys.executable, str(HERE / "manage.py"), *args]
    result = subprocess.run(
        command, env=dict(env), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        raise SetupFailed(
            f"`manage.py {' '.join(args)}` failed ({result.returncode}):\n"
            f"{result.stdout}{result.stderr}"
        )
    return result.stdout


@contextmanager
def provider(ledger: Path, log_path: Path) -> Iterator[str]:
    """The payment provider simulator, its own process with its own ledger file."""
    reset_database(ledger)
    port = free_port()
    command = [
        sys.executable,
        str(HERE / "provider" / "server.py"),
        "--port",
        str(port),
        "--ledger",
        str(ledger),
    ]
    say(f"Starting the payment provider simulator: {' '.join(command[1:])}")
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if process.poll() is not None:
                raise SetupFailed(
                    f"the provider exited with {process.returncode}:\n{log_tail(log_path)}"
                )
            try:
                if requests.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise SetupFailed(f"the provider did not answer within {STARTUP_TIMEOUT} s")
            time.sleep(0.05)
        say(f"Provider up at {url} (pid {process.pid}); its log: {log_path}")
        yield url
    finally:
        stop(process, "Provider")


def log_tail(log_path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no server log)"


@contextmanager
def gunicorn(env: Mapping[str, str], log_path: Path) -> Iterator[str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "testproject.wsgi",
        "--chdir",
        str(HERE),
        "-w",
        "3",
        "--threads",
        "4",
        "-b",
        f"127.0.0.1:{port}",
        "--graceful-timeout",
        "5",
        "--access-logfile",
        "-",
    ]
    if _gunicorn_version() >= (25, 1):
        # Its control socket lives at one fixed path per user: concurrent
        # demo runs (or other gunicorns) would fight over it.
        command.append("--no-control-socket")
    say(f"Starting: {' '.join(command[1:])}")
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command,
            env=dict(env),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the demo, which stops the server
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if process.poll() is not None:
                raise SetupFailed(
                    f"gunicorn exited with {process.returncode}:\n{log_tail(log_path)}"
                )
            try:
                requests.get(f"{base_url}/v1/payments", timeout=1)
                break
            except requests.RequestException:
                if time.monotonic() > deadline:
                    raise SetupFailed(
                        f"gunicorn did not answer within {STARTUP_TIMEOUT} s:\n{log_tail(log_path)}"
                    ) from None
                time.sleep(0.1)
        say(f"Server up at {base_url} (pid {process.pid}); its log: {log_path}")
        yield base_url
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes], name: str = "Server") -> None:
    if process.poll() is None:
        process.terminate()  # gunicorn's graceful shutdown
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the session started above
            process.wait(timeout=10)
    say(f"{name} stopped (exit status {process.returncode}).")


# -- main -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--database-file",
        type=Path,
        default=HERE / "demo.sqlite3",
        help="the throw-away SQLite file (deleted and recreated; default: %(default)s)",
    )
    options = parser.parse_args(argv)
    database: Path = options.database_file.resolve()
    log_path = database.with_name(database.stem + "-server.log")
    ledger = database.with_name(database.stem + "-provider.sqlite3")
    provider_log = database.with_name(database.stem + "-provider.log")

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    started = time.monotonic()
    try:
        with provider(ledger, provider_log) as provider_url:
            env = server_env(database, provider_url)
            say(f"Recreating the demo database {database}")
            reset_database(database)
            manage(env, "migrate", "--noinput")
            manage(env, "seed_demo")
            say("Migrated; seeded the users alice and bob (fixed tokens) and admin/admin.")
            with gunicorn(env, log_path) as base_url:
                client = Client(base_url)
                double_click(client)
                key, payment = lost_response(client)
                reused_key(client, key, payment)
                two_tenants(client)
                domain_guard(client)
                refunds(client, payment)
                missing_key(client)
                provider_timeout(client, provider_url, env)
                declined_card(client, provider_url)
                ninja_refund(client, payment)
    except ExpectationFailed as exc:
        say()
        say(f"FAILED: {exc}")
        say(f"({len(check.passed)} expectations held before this one.)")
        say(f"(the server log is {log_path}; its end:)\n{log_tail(log_path)}")
        say(f"(the provider's log is {provider_log}; its end:)\n{log_tail(provider_log, 10)}")
        return 1
    except SetupFailed as exc:
        say()
        say(f"SETUP FAILED: {exc}")
        return 2
    except KeyboardInterrupt:
        say()
        say("Interrupted.")
        return 130
    heading("Summary")
    say(f"All {len(check.passed)} expectations held, in {time.monotonic() - started:.1f} s:")
    say("  a. a double click ran the payment once; every other click got a 409 or the replay")
    say("  b. a lost response was recovered by retrying with the same key (identical bytes)")
    say("  c. the same key with another amount was refused with 422")
    say("  d. the same key from two tenants made two payments")
    say("  e. a fresh key for a paid order hit the domain guard (409 order_already_paid)")
    say("  f. refunds ran once per key; a refused refund (400) was replayed")
    say("  g. a missing key was refused with 400")
    say("  h. a charge whose answer was lost: 502, then 503 until recovery asked the provider,")
    say("     then the replayed 201; one charge, one payment")
    say("  i. a declined card: a 402 stored and replayed, nothing charged")
    say("  j. a refund through the Django Ninja API ran once; its retry was replayed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
