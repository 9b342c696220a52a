#!/usr/bin/env python3
"""Drive an efabus NATS listener with nats-py, the NATS project's Python
client: publish and subscribe with wildcards, headers, request/reply (both
a Python responder and no responders at all), a queue group, auto-unsubscribe
and drain, and messages to and from a native efabus client.

Usage: nats-py-check.py nats://HOST:PORT [CA [CERT KEY]]

With CA (a PEM file) it connects over TLS, verifying the server against
that authority, and with CERT and KEY presents that client certificate.

It prints `ready` once subscribed to `from.native` and published on
`to.native`; whoever runs it then publishes one message on `from.native`
with a native client. Every step is bounded by a timeout; the exit status
is 0 when every check passed and 1 (with the failed check on stderr)
otherwise.
"""

import asyncio
import ssl
import sys

import nats
from nats.errors import NoRespondersError

WAIT = 10


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def tls_context(files):
    if not files:
        return None
    context = ssl.create_default_context(cafile=files[0])
    if len(files) == 3:
        context.load_cert_chain(certfile=files[1], keyfile=files[2])
    return context


async def run(url, tls_files):
    nc = await nats.connect(
        url, name="nats-py-check", allow_reconnect=False, tls=tls_context(tls_files)
    )
    if tls_files:
        # nats-py starts TLS on a nats:// URL only when INFO requires it.
        check(nc._server_info.get("tls_required") is True, "INFO requires TLS")
        print("tls: ok", flush=True)

    sub = await nc.subscribe("py.*")
    await nc.publish("py.one", b"1")
    await nc.publish("py.two.deep", b"not for py.*")
    await nc.publish("py.two", b"2", headers={"Trace-Id": "t-7"})
    await nc.flush(timeout=WAIT)
    first = await sub.next_msg(timeout=WAIT)
    second = await sub.next_msg(timeout=WAIT)
    check((first.subject, first.data) == ("py.one", b"1"), f"wildcard: {first}")
    check((second.subject, second.data) == ("py.two", b"2"), f"wildcard: {second}")
    check(second.headers == {"Trace-Id": "t-7"}, f"headers: {second.headers}")
    print("wildcards and headers: ok", flush=True)

    async def upper(msg):
        await msg.respond(msg.data.upper())

    await nc.subscribe("py.svc", cb=upper)
    answer = await nc.request("py.svc", b"hello", timeout=WAIT)
    check(answer.data == b"HELLO", f"request: {answer.data}")
    try:
        await nc.request("nobody.home", b"", timeout=WAIT)
        check(False, "a request without responders was answered")
    except NoRespondersError:
        pass
    print("request/reply and no responders: ok", flush=True)

    counts = [0, 0]

    def member(index):
        async def take(_msg):
            counts[index] += 1

        return take

    await nc.subscribe("py.jobs", queue="workers", cb=member(0))
    await nc.subscribe("py.jobs", queue="workers", cb=member(1))
    await nc.flush(timeout=WAIT)
    for n in range(100):
        await nc.publish("py.jobs", str(n).encode())
    await nc.flush(timeout=WAIT)
    for _ in range(WAIT * 100):
        if sum(counts) >= 100:
            break
        await asyncio.sleep(0.01)
    # Settle: a job delivered twice would show now.
    await nc.flush(timeout=WAIT)
    await asyncio.sleep(0.2)
    check(sum(counts) == 100, f"queue group: {counts}")
    print(f"queue group: ok {counts}", flush=True)

    limited = await nc.subscribe("py.limited")
    await limited.unsubscribe(limit=2)
    for n in range(5):
        await nc.publish("py.limited", str(n).encode())
    await nc.flush(timeout=WAIT)
    got = [(await limited.next_msg(timeout=WAIT)).data for _ in range(2)]
    check(got == [b"0", b"1"], f"auto-unsubscribe: {got}")
    try:
        extra = await limited.next_msg(timeout=0.3)
    except (nats.errors.TimeoutError, nats.errors.BadSubscriptionError):
        extra = None  # the subscription ended, or nothing came
    check(extra is None, f"auto-unsubscribe: a third message {extra}")
    print("auto-unsubscribe: ok", flush=True)

    native = await nc.subscribe("from.native")
    await nc.publish("to.native", b"from python", headers={"Lang": "python"})
    # nats-py writes a flush's PING straight to the socket, ahead of the
    # SUB and PUB its flusher task has not written yet, so the first PONG
    # may come before the server saw them. The second flush's PING goes
    # out after them: its PONG means the subscription is in place.
    await nc.flush(timeout=WAIT)
    await nc.flush(timeout=WAIT)
    print("ready", flush=True)
    message = await native.next_msg(timeout=WAIT)
    check(message.data == b"from native", f"native message: {message.data}")
    print("native interop: ok", flush=True)

    # Drain waits for every subscription's queue to be read: subscriptions
    # read with next_msg() that still hold messages (the py.* one saw the
    # requests) are ended first.
    await sub.unsubscribe()
    await native.unsubscribe()
    await asyncio.wait_for(nc.drain(), timeout=WAIT)
    check(nc.is_closed, "the connection is closed after drain")
    print("drained: ok", flush=True)


def main():
    if len(sys.argv) not in (2, 3, 5):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        asyncio.run(asyncio.wait_for(run(sys.argv[1], sys.argv[2:]), timeout=60))
    except Exception as err:  # any failure is the script's answer
        print(f"nats-py check failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
